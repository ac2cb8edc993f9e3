"""Hardware facts, and whether a dtype policy is fast here: the one owner.

`device_info()` reads the GPUs and the CPU's bfloat16 flags without
initialising a device; `usable_cpus()` counts the cores this process may
run on; `precision_support(policy)` says whether a policy
runs faster than float32 on them and why; `auto_policy()` is the policy
`"auto"` means. `compile_model`, `enable_mixed_precision`, `kg.validate`
and `diagnose` all use these, so "fast here" has one definition.

Rule for several GPUs: the weakest GPU (lowest compute capability) decides,
because every replica runs the same policy and the step waits for the
slowest replica.
"""

import os
import sys
from typing import Optional, Tuple

__all__ = ["POLICIES", "auto_policy", "device_info", "precision_support", "usable_cpus"]

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")

_ALIASES = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


def device_info() -> dict:
    """This machine's GPUs and bfloat16 CPU support, without initialising a device.

    Returns:
        A dict: `gpus`, a list of `{"name", "compute_capability"}` (a
        `[major, minor]` list, or None when unknown) of the physical GPUs the
        Keras backend uses (`_gpus`); `cpu_bf16`, whether the CPU has AMX-BF16
        (AVX512-BF16 alone runs a whole step slower than float32);
        `cpu_bf16_flags`, the CPU's bfloat16 flags (`amx_bf16`, `avx512_bf16`)
        that are present.
    """
    flags = sorted(_cpu_flags() & {"amx_bf16", "avx512_bf16"})
    return {"gpus": _gpus(), "cpu_bf16": "amx_bf16" in flags, "cpu_bf16_flags": flags}


def _gpus():
    """The physical GPUs, without importing a framework the process has not
    imported yet: TensorFlow's list where the Keras backend is TensorFlow and
    it is imported (as `compile_model` runs); else NVML's visible GPUs; else
    the backend's own list (TensorFlow's, `jax.devices()`, `torch.cuda`),
    importing it only where a GPU driver may be loaded: on Linux without an
    NVIDIA or AMD driver there is no GPU to list. So `validate` and
    `enable_mixed_precision('auto')` on JAX import no TensorFlow, and
    `validate` on TensorFlow imports none where NVML answers or there is no
    driver."""
    from keras_gpufix.backends import name as backend_name
    from keras_gpufix.nvml import visible_gpus

    backend = backend_name()
    if backend == "tensorflow" and "tensorflow" in sys.modules:
        return _tensorflow_gpus()
    try:
        return visible_gpus()
    except Exception:  # no NVML bindings (ImportError) or no driver
        pass
    if sys.platform.startswith("linux") and not any(
            os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/kfd")):
        return []
    try:
        if backend == "tensorflow":
            return _tensorflow_gpus()
        if backend == "jax":
            import jax

            return [{"name": d.device_kind, "compute_capability": _capability(
                getattr(d, "compute_capability", None))} for d in jax.devices()
                if d.platform == "gpu"]
        if backend == "torch":
            import torch

            return [{"name": torch.cuda.get_device_name(i),
                     "compute_capability": list(torch.cuda.get_device_capability(i))}
                    for i in range(torch.cuda.device_count())]
    except Exception:  # no GPU runtime: CPU only
        pass
    return []


def _tensorflow_gpus():
    import tensorflow as tf

    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device)
        except Exception:  # details are best-effort
            details = {}
        cc = details.get("compute_capability")
        gpus.append({"name": details.get("device_name", device.name),
                     "compute_capability": list(cc) if cc else None})
    return gpus


def _capability(text):
    """`[major, minor]` from JAX's "9.0", or None."""
    try:
        major, minor = str(text).split(".")[:2]
        return [int(major), int(minor)]
    except (TypeError, ValueError):
        return None


def precision_support(policy: str, info: Optional[dict] = None) -> Tuple[bool, str]:
    """Whether `policy` computes faster than float32 on this machine, and why.

    Several GPUs: the weakest (lowest compute capability) decides, since
    every replica runs the policy. A GPU whose compute capability is unknown
    is not counted; when none is known the answer is "not fast".

    Args:
        policy: `"float32"`, `"mixed_bfloat16"`, `"mixed_float16"`, or the
            short names `"bfloat16"`, `"float16"`.
        info: a `device_info()` dict. Defaults to None (this machine's).

    Returns:
        `(fast, reason)`: `fast` is True for float32 (nothing to gain) and for
        a mixed policy the hardware runs natively; `reason` is one sentence.

    Raises:
        ValueError: for another `policy`.
    """
    policy = _ALIASES.get(policy, policy)
    if policy not in ("float32", "mixed_bfloat16", "mixed_float16"):
        raise ValueError(
            "`policy` must be 'float32', 'mixed_bfloat16', 'mixed_float16', "
            f"'bfloat16' or 'float16'. Received: policy={policy!r}"
        )
    if policy == "float32":
        return True, "float32 runs at full speed everywhere"
    info = device_info() if info is None else info
    if info["gpus"]:
        caps = [(tuple(g["compute_capability"]), g["name"])
                for g in info["gpus"] if g["compute_capability"]]
        if not caps:
            return False, "GPU compute capability unknown"
        (major, minor), name = min(caps)
        where = f"{name}, compute capability {major}.{minor}"
        if policy == "mixed_bfloat16":
            if major >= 8:
                return True, f"{where}: bfloat16 tensor cores, and bfloat16 needs no loss scaling"
            return False, f"{where}: no fast bfloat16 math; it needs 8.0 (Ampere) or newer"
        if major >= 7:
            return True, f"{where}: float16 tensor cores; float16 needs loss scaling"
        return False, f"{where}: no tensor cores, float16 would not be faster than float32"
    if policy == "mixed_float16":
        return False, "CPU only: float16 runs emulated, slower than float32"
    if info["cpu_bf16"]:
        return True, "CPU only, with AMX-BF16: bfloat16 matrix tiles in hardware"
    if "avx512_bf16" in info["cpu_bf16_flags"]:
        return False, (
            "CPU only, AVX512-BF16 without AMX: the casts cost more than the faster "
            "matmuls save in a whole training step (measured: examples/train_tts.py "
            "under XLA, 26 ms/step in mixed_bfloat16 against 14 ms in float32)"
        )
    return False, "CPU only, without AMX-BF16/AVX512-BF16: bfloat16 is emulated"


def auto_policy(info: Optional[dict] = None) -> Tuple[str, str]:
    """The policy `"auto"` means here: `(policy, reason)`.

    `"mixed_bfloat16"` where bfloat16 is fast (it needs no loss scaling),
    else `"mixed_float16"` where float16 is fast, else `"float32"`.

    Args:
        info: a `device_info()` dict. Defaults to None (this machine's).
    """
    info = device_info() if info is None else info
    bf16_fast, bf16_why = precision_support("mixed_bfloat16", info)
    if bf16_fast:
        return "mixed_bfloat16", bf16_why
    f16_fast, f16_why = precision_support("mixed_float16", info)
    if f16_fast:
        return "mixed_float16", f16_why
    return "float32", f16_why if info["gpus"] else bf16_why


def usable_cpus() -> int:
    """Cores this process may run on (its CPU affinity; `os.cpu_count()` where
    the platform has no affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _cpu_flags():
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
