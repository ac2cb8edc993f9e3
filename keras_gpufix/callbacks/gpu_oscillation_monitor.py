"""GPUOscillationMonitor: names the cause of a slow or oscillating `fit`.

One line is enough: `model.fit(..., callbacks=[kg.GPUOscillationMonitor()])`.
It times every step (through a `StepTimer`), samples GPU utilisation with
NVML in a background thread where `nvidia-ml-py` and a GPU exist, reads the
input wait and batch shapes of a dataset that went through
`kg.data.instrument`, and feeds them to `keras_gpufix.analysis
.OscillationDetector`. Each event is printed once and kept in `events`.

Steps left out of the detector: the first `warmup` steps of a `fit`
(compilation) and the first step of every epoch (iterator creation and
shuffle-buffer filling happen there; their mean is reported as
`epoch_start_ms`). A hook that covers N steps (`steps_per_execution=N`)
counts as one observation of its per-step time.

Logged TensorBoard scalars (run `keras_gpufix` under `log_dir`):

| tag                          | when          | value                            |
|------------------------------|---------------|----------------------------------|
| `oscillation/cv`             | each judgement| coefficient of variation         |
| `oscillation/median_ms`      | each judgement| median step time                 |
| `oscillation/input_wait`     | each judgement| input-wait share (when measured) |
| `oscillation/gpu_util`       | each judgement| mean GPU utilisation (NVML)      |
| `oscillation/verdict`        | each event    | index into `analysis.VERDICTS`   |

Nothing is added to the Keras `logs` dict.
"""

import sys
import warnings

from keras_gpufix.analysis import VERDICTS, OscillationDetector
from keras_gpufix.callbacks._base import GuardedCallback, ScalarWriter
from keras_gpufix.callbacks.step_timer import TimedCallback
from keras_gpufix.exceptions import GpufixWarning
from keras_gpufix.nvml import NvmlSampler

__all__ = ["GPUOscillationMonitor"]


class GPUOscillationMonitor(TimedCallback):
    """Detects input-bound, stalling, recompiling or dispatch-bound training.

    Args:
        window: steps per judged window. Defaults to 96.
        warmup: steps ignored at the start of each `fit`. Defaults to 5.
        min_windows: consecutive judgements a verdict must hold before it
            is reported. Defaults to 2.
        thresholds: other `OscillationDetector` arguments by name
            (`spike_factor`, `input_wait_threshold`, ...). Defaults to None.
        log_dir: directory for TensorBoard scalars. Defaults to None.
        on_detect: called with each event dict; an object with an
            `on_oscillation(event)` method (such as `kg.ProfilerTrigger`)
            gets that method called. Our callbacks with `on_oscillation` in
            the same `fit` get every event without wiring. Defaults to None.
        nvml: sample GPU utilisation through NVML when possible.
            Defaults to True.
        verbose: 0 silent, 1 prints each event and a summary at the end of
            `fit`. Defaults to 1.

    Example:

    >>> monitor = kg.GPUOscillationMonitor()
    >>> model.fit(ds, epochs=3, callbacks=[monitor])
    >>> monitor.report()["verdict"]
    'input_bound'
    """

    def __init__(self, window=96, warmup=5, min_windows=2, thresholds=None,
                 log_dir=None, on_detect=None, nvml=True, verbose=1):
        super().__init__(warmup=warmup)
        if on_detect is not None and not (
            callable(on_detect) or hasattr(on_detect, "on_oscillation")
        ):
            raise ValueError(
                "`on_detect` must be callable or have an `on_oscillation` method. "
                f"Received: on_detect={on_detect!r}"
            )
        self.window = window
        self.warmup = warmup
        self.min_windows = min_windows
        self.thresholds = dict(thresholds or {})
        self.log_dir = log_dir
        self.on_detect = on_detect
        self.nvml = nvml
        self.verbose = verbose
        self.detector = OscillationDetector(
            window=window, warmup=warmup, min_windows=min_windows, **self.thresholds
        )
        self.events = []
        self._sampler = None
        self._writer = None
        self._shapes_seen = set()
        self._said_step_times_only = False

    def _begin(self):
        self.detector.reset()
        self.events = []
        self._shapes_seen = set()
        if self.log_dir is not None and self._writer is None:
            self._writer = ScalarWriter(self.log_dir)
        self._start_sampler()

    def _start_sampler(self):
        self._sampler = None  # a stopped sampler keeps its samples for report()
        reason = "disabled (nvml=False)"
        if self.nvml:
            sampler = NvmlSampler()
            try:
                sampler.start()
            except Exception as exc:  # no pynvml, no driver, no GPU
                reason = str(exc).splitlines()[0]
            else:
                self._sampler = sampler
                return
        if self.verbose and not self._said_step_times_only:
            self._said_step_times_only = True
            print(f"GPUOscillationMonitor: GPU utilisation not sampled ({reason}); "
                  "judging from step times" + (
                      " and input wait." if "tensorflow" in sys.modules else "."))

    def _epoch_done(self):
        if self._writer is not None:
            self._writer.flush()

    def _end(self):
        event = self.detector.finish()
        if event is not None:
            self._emit(event)
        if self._sampler is not None:
            self._sampler.stop()
            if self._sampler.error is not None:
                warnings.warn(f"NVML sampling stopped: {self._sampler.error}",
                              GpufixWarning, stacklevel=2)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.verbose:
            r = self.report()
            st = r["step_time"]
            if st["count"]:
                wait = r["input_wait"]
                print(f"GPUOscillationMonitor: verdict {r['verdict']}; "
                      f"{st['count']} steps, median {st['p50_ms']:.1f} ms, "
                      f"p95 {st['p95_ms']:.1f} ms, cv {st['cv']:.2f}"
                      + ("" if wait is None else f", input wait {wait:.0%}")
                      + (f". Fix: {r['fix']}" if r["verdict"] != "healthy" else ""))

    def _read_hooks(self, start, stop):
        """Feeds the hooks the timer has read to the detector."""
        timer = self.timer
        for i in range(start, stop):
            shape = timer.shapes[i]
            new_shape = shape is not None and shape not in self._shapes_seen
            if shape is not None:
                self._shapes_seen.add(shape)
            if timer.epoch_first[i]:
                continue
            per_step = timer.durations[i] / timer.counts[i]
            signals = {"step": timer.steps[i]}
            if timer.input_waits[i] is not None:
                signals["input_wait"] = timer.input_waits[i] / timer.counts[i]
            if shape is not None:
                signals["new_shape"] = new_shape
            if self._sampler is not None:
                signals["gpu_util"] = self._sampler.mean_between(
                    timer.begins[i], timer.ends[i])
            judged = self.detector.judgements
            event = self.detector.update(per_step, **signals)
            if self._writer is not None and self.detector.judgements != judged:
                self._log_judgement(timer.steps[i])
            if event is not None:
                self._emit(event)

    def _log_judgement(self, step):
        evidence = self.detector.last_judgement["evidence"]
        self._writer.add("oscillation/cv", evidence["cv"], step)
        self._writer.add("oscillation/median_ms", evidence["median_ms"], step)
        self._writer.add("oscillation/input_wait", evidence.get("input_wait"), step)
        self._writer.add("oscillation/gpu_util", evidence.get("gpu_util"), step)

    def _emit(self, event):
        self.events.append(event)
        if self.verbose:
            print(f"\nGPUOscillationMonitor: {event['message']}. Fix: {event['fix']}")
        if self._writer is not None:
            self._writer.add("oscillation/verdict", VERDICTS.index(event["verdict"]),
                             event["end_step"])
        targets = [] if self.on_detect is None else [self.on_detect]
        targets += [cb for cb in self.siblings(GuardedCallback)
                    if hasattr(cb, "on_oscillation") and cb is not self.on_detect]
        for target in targets:
            handler = getattr(target, "on_oscillation", target)
            try:
                handler(event)
            except Exception as exc:
                self._report_failure(f"on_detect({type(target).__name__})", exc)

    def report(self):
        """The run's diagnosis as a dict.

        Returns:
            `verdict` (dominant over the run, `healthy` when nothing was
            found), `fix`, `events` (dicts with `verdict`, `start_step`,
            `end_step`, `cv`, `period`, `evidence`, `fix`, `message`),
            `step_time` (`summarize_step_times` of the steps after warmup),
            `input_wait` (share of step time spent waiting for input, None
            when not measured), `gpu_util` (mean, None without NVML),
            `epoch_start_ms` (mean first step of an epoch), `new_shapes`
            and `errors` (internal failures that were skipped).
        """
        from keras_gpufix.analysis import FIXES

        timer = self.timer
        verdict = self.detector.dominant_verdict()
        used = [i for i in range(min(timer.synced, len(timer.durations)))
                if not timer.epoch_first[i]][self.warmup:]
        waits = [timer.input_waits[i] for i in used]
        total = sum(timer.durations[i] for i in used)
        input_wait = (sum(waits) / total if used and total > 0
                      and all(w is not None for w in waits) else None)
        gpu_util = None
        if self._sampler is not None and timer.begins:
            gpu_util = self._sampler.mean_between(timer.begins[0], timer.ends[-1])
        firsts = [timer.durations[i] * 1e3 for i, f in enumerate(timer.epoch_first) if f]
        shapes = {s for s in timer.shapes if s is not None}
        fixes = [e["fix"] for e in self.events if e["verdict"] == verdict]
        return {
            "verdict": verdict,
            "fix": fixes[-1] if fixes else FIXES[verdict],
            "events": [dict(e) for e in self.events],
            "step_time": timer.summary(),
            "input_wait": input_wait,
            "gpu_util": gpu_util,
            "epoch_start_ms": sum(firsts) / len(firsts) if firsts else None,
            "new_shapes": len(shapes),
            "errors": list(self.errors) + list(timer.errors),
        }
