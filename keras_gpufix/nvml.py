"""GPU utilisation sampling through NVML (optional: `pip install nvidia-ml-py`).

`NvmlSampler` polls `nvmlDeviceGetUtilizationRates` for every visible GPU in
a daemon thread (20 Hz by default) and answers "what was the mean GPU
utilisation between t0 and t1". It never raises into training: a failing
NVML call stops the thread and is kept in `error`.
"""

import bisect
import os
import threading
import time

__all__ = ["NvmlSampler", "nvml_status", "visible_gpus"]

INSTALL_HINT = "pip install nvidia-ml-py  (or: pip install keras-gpufix[nvml])"


def _import_pynvml():
    try:
        import pynvml
    except ImportError as exc:
        raise ImportError(f"GPU sampling needs NVML bindings: {INSTALL_HINT}") from exc
    return pynvml


def _visible_indices(count):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    out = []
    for item in visible.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < count:
            out.append(int(item))
    return out


def visible_gpus():
    """The visible GPUs (`CUDA_VISIBLE_DEVICES` applied), as NVML names them,
    without initialising CUDA: a list of `{"name", "compute_capability"}`
    (`[major, minor]`, or None where the driver does not say).

    Raises:
        ImportError: without NVML bindings (`INSTALL_HINT`).
        Exception: NVML's own error where it cannot start (no driver).
    """
    pynvml = _import_pynvml()
    pynvml.nvmlInit()
    try:
        gpus = []
        for i in _visible_indices(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            try:
                capability = list(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except Exception:  # older drivers and bindings
                capability = None
            gpus.append({"name": name.decode() if isinstance(name, bytes) else name,
                         "compute_capability": capability})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def nvml_status():
    """Whether NVML sampling can run here, as a dict (`available`, `reason`,
    `gpus`: names of the visible GPUs)."""
    try:
        gpus = visible_gpus()
    except ImportError as exc:
        return {"available": False, "reason": str(exc), "gpus": []}
    except Exception as exc:  # NVMLError: no driver, no GPU
        return {"available": False, "reason": f"NVML init failed: {exc}", "gpus": []}
    if not gpus:
        return {"available": False, "reason": "NVML sees no GPU", "gpus": []}
    return {"available": True, "reason": "", "gpus": [g["name"] for g in gpus]}


class NvmlSampler:
    """Samples GPU utilisation in the background.

    Args:
        interval: seconds between samples. Defaults to 0.05 (20 Hz).
        maxlen: samples kept. Defaults to 72000 (an hour at 20 Hz).
    """

    def __init__(self, interval=0.05, maxlen=72000):
        if not 0 < interval <= 0.1:
            raise ValueError(
                f"`interval` must be in (0, 0.1] (>= 10 Hz). Received: interval={interval}"
            )
        self.interval = interval
        self.maxlen = maxlen
        self._times = []   # time.time() of each sample
        self._values = []  # mean utilisation of the visible GPUs, 0..1
        self._lock = threading.Lock()
        self.error = None
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        """Starts sampling; raises ImportError/RuntimeError when NVML is unusable."""
        pynvml = _import_pynvml()
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                   for i in _visible_indices(pynvml.nvmlDeviceGetCount())]
        if not handles:
            pynvml.nvmlShutdown()
            raise RuntimeError("NVML sees no GPU")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(pynvml, handles), name="keras_gpufix-nvml", daemon=True
        )
        self._thread.start()

    def _run(self, pynvml, handles):
        try:
            while not self._stop.is_set():
                now = time.time()
                util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
                with self._lock:
                    self._times.append(now)
                    self._values.append(sum(util) / (100.0 * len(util)))
                    if len(self._times) > self.maxlen:
                        del self._times[: self.maxlen // 2]
                        del self._values[: self.maxlen // 2]
                self._stop.wait(self.interval)
        except Exception as exc:
            self.error = exc
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def mean_between(self, t0, t1):
        """Mean utilisation (0..1) of samples in [t0, t1], None if none."""
        with self._lock:
            lo = bisect.bisect_left(self._times, t0)
            hi = bisect.bisect_right(self._times, t1)
            values = self._values[lo:hi]
        return sum(values) / len(values) if values else None
