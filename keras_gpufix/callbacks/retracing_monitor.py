"""RetracingMonitor: tf.function traces and new input shapes, and what they cost.

Two ways a variable-length input makes training slow:

- the train step's `tf.function` is traced again (Python values or new
  structures in the batch, or `reduce_retracing=False`): counted with
  `experimental_get_tracing_count()` of the functions inside
  `model.train_function`;
- under `jit_compile=True` XLA compiles once per distinct input shape,
  while the trace count stays at 2 (Keras traces with `reduce_retracing=
  True`, so the second trace has `None` dimensions). Only the shapes show
  it: they are read from a dataset that went through `kg.data.instrument`.

A step at a new shape (or with a new trace) costs its time minus the median
step: that is the estimated recompile cost. When more than `max_new_shapes`
new shapes were slow, or the step was traced more than `max_new_shapes`
times, the verdict is `recompiling` and one warning per cause names the
shapes and the fix.

Steps are timed, and shapes read every quarter second and at epoch end, by an
inner `StepTimer`; per hook the monitor adds one read of the trace counter. Nothing is written to the Keras
`logs` dict; results are in `report()`.
"""

import time
import warnings
from collections import deque

import numpy as np

from keras_gpufix.analysis import FIXES
from keras_gpufix.callbacks.step_timer import TimedCallback
from keras_gpufix.exceptions import GpufixWarning
from keras_gpufix.keras_internals import traced_functions

__all__ = ["RetracingMonitor"]

_NO_PROBE = ("RetracingMonitor: input shapes are not visible (the dataset did not go "
             "through kg.data.instrument); counting tf.function traces and slow steps "
             "only. Pass the dataset through kg.data.instrument(ds) (kg.data builders "
             "do) to see which new shapes cost an XLA recompile.")


def _as_lists(key):
    return [list(dims) for dims in key]


class RetracingMonitor(TimedCallback):
    """Counts train-step traces and new input shapes; prices their compiles.

    Args:
        max_new_shapes: slow steps at new shapes (or traces) tolerated in
            one `fit` before the verdict is `recompiling`. Defaults to 8
            (`kg.data` with `num_buckets=8`).
        warn: warn once per cause (`shapes`, `traces`) when it is reached.
            Defaults to True.
        spike_factor: a step slower than this x the median step is a spike.
            Defaults to 3.0.
        min_spike_ms: ... and slower than the median by at least this.
            Defaults to 2.0.
        verbose: 0 silent, 1 prints a one-line summary at the end of `fit`
            and, once, that shapes are not visible. Defaults to 1.

    Example:

    >>> monitor = kg.RetracingMonitor()
    >>> model.fit(kg.data.instrument(ds), callbacks=[monitor])
    >>> monitor.report()["recompile_ms"]
    """

    MEDIAN_WINDOW = 256

    def __init__(self, max_new_shapes=8, warn=True, spike_factor=3.0, min_spike_ms=2.0,
                 verbose=1):
        super().__init__()
        if not isinstance(max_new_shapes, (int, np.integer)) or max_new_shapes < 1:
            raise ValueError("`max_new_shapes` must be an integer >= 1. "
                             f"Received: max_new_shapes={max_new_shapes!r}")
        if not spike_factor > 1.0:
            raise ValueError(f"`spike_factor` must be > 1. Received: spike_factor={spike_factor}")
        self.max_new_shapes = int(max_new_shapes)
        self.warn = warn
        self.spike_factor = float(spike_factor)
        self.min_spike_ms = float(min_spike_ms)
        self.verbose = verbose
        self._told_no_probe = False
        self._reset()

    def _reset(self):
        self._functions = {}
        self._baseline = 0
        self._traces = 0
        self._fit_t0 = time.time()
        self._fit_t1 = None
        self._global = 0
        self._trace_deltas = []  # new traces per hook
        # results
        self._seen = {}
        self._events = []  # hooks at a new shape or with new traces
        self._normal = deque(maxlen=self.MEDIAN_WINDOW)
        self._spikes = 0
        self._spike_ms = 0.0
        self._steps = 0
        self._step_s = 0.0
        self._warned = set()
        self.notes = []

    def _begin(self):
        self._reset()
        self._functions = traced_functions(getattr(self.model, "train_function", None))
        if self._functions:
            self._baseline = self._trace_total()
        elif getattr(self.model, "run_eagerly", False):
            self.notes.append("cannot count traces: the model runs eagerly "
                              "(run_eagerly=True), so nothing is traced")
        else:
            self.notes.append(
                "cannot count traces: model.train_function "
                f"({type(getattr(self.model, 'train_function', None)).__name__}) holds no "
                "tf.function this Keras version exposes; shapes are still checked")
        self._traces = self._baseline

    def _trace_total(self):
        return sum(int(f.experimental_get_tracing_count()) for f in self._functions.values())

    def _after_hook(self):
        traces = self._trace_total() if self._functions else self._traces
        self._trace_deltas.append(traces - self._traces)
        self._traces = traces

    def _end(self):
        self._fit_t1 = time.time()
        if self.verbose:
            r = self.report()
            traces = "?" if r["trace_count"] is None else r["trace_count"]
            print(f"RetracingMonitor: {r['new_shapes']} input shapes, {traces} new traces, "
                  f"estimated recompile cost {r['recompile_ms']:.0f} ms "
                  f"({r['recompile_share']:.0%} of fit time) -> {r['verdict']}")

    # -- internals -------------------------------------------------------

    def _read_hooks(self, start, stop):
        """Judges the hooks the timer has read."""
        timer = self.timer
        hooks = range(start, stop)
        if timer.input_probe is None and _NO_PROBE not in self.notes:
            self.notes.append(_NO_PROBE)
            if self.verbose and not self._told_no_probe:
                print(_NO_PROBE)
            self._told_no_probe = True
        batch_normal = []
        for i in hooks:
            seconds, count, key = timer.durations[i], timer.counts[i], timer.shapes[i]
            # Time spent waiting for the batch is the input's, not a compile.
            seconds -= min(seconds, timer.input_waits[i] or 0.0)
            new_traces = self._trace_deltas[i]
            self._global += count
            self._steps += count
            self._step_s += seconds
            new_shape = key is not None and key not in self._seen
            if new_shape:
                self._seen[key] = self._global - count
            if new_shape or new_traces:
                self._events.append({"step": self._global - count, "steps": count,
                                     "shape": key, "traces": new_traces,
                                     "step_ms": seconds * 1e3})
            elif not timer.epoch_first[i]:
                batch_normal.append(seconds / count)
        if batch_normal:
            self._normal.extend(batch_normal)
            median = float(np.median(self._normal))
            for step_s in batch_normal:
                if self._is_spike(step_s, median):
                    self._spikes += 1
                    self._spike_ms += (step_s - median) * 1e3
        self._judge()

    def _median_ms(self):
        return float(np.median(self._normal)) * 1e3 if self._normal else None

    def _is_spike(self, step_s, median_s):
        return (step_s > self.spike_factor * median_s
                and (step_s - median_s) * 1e3 > self.min_spike_ms)

    def _priced(self):
        """Events with `cost_ms` and `slow`, priced against the current median."""
        median = self._median_ms()
        out = []
        for e in self._events:
            e = dict(e)
            if median is None:
                # Every step so far was at a new shape or traced: nothing to
                # compare with, so each whole step counts (an upper bound).
                e["cost_ms"], e["slow"] = e["step_ms"], True
            else:
                base = median * e["steps"]
                e["cost_ms"] = max(0.0, e["step_ms"] - base)
                e["slow"] = self._is_spike(e["step_ms"] / e["steps"] / 1e3, median / 1e3)
            out.append(e)
        return out

    def _causes(self, priced):
        causes = {}
        slow_shapes = [e for e in priced if e["shape"] is not None and e["slow"]]
        # Without XLA a new shape costs nothing unless it retraces (counted below).
        jit = getattr(getattr(self, "_model", None), "jit_compile", None) is not False
        if jit and len(slow_shapes) > self.max_new_shapes:
            causes["shapes"] = slow_shapes
        new_traces = (self._traces - self._baseline) if self._functions else 0
        if new_traces > self.max_new_shapes:
            causes["traces"] = [e for e in priced if e["traces"]]
        return causes

    def _judge(self):
        if not self.warn:
            return
        priced = self._priced()
        for cause, events in self._causes(priced).items():
            if cause in self._warned:
                continue
            self._warned.add(cause)
            warnings.warn(self._message(cause, events, priced), GpufixWarning, stacklevel=3)

    def _message(self, cause, events, priced):
        cost = sum(e["cost_ms"] or 0.0 for e in events)
        share = self._share(cost)
        jit = getattr(getattr(self, "_model", None), "jit_compile", None)
        if cause == "shapes":
            shapes = sorted(self._seen, key=self._seen.get)
            listed = ", ".join(str(s) for s in shapes[:12])
            more = f" and {len(shapes) - 12} more" if len(shapes) > 12 else ""
            return (f"RetracingMonitor: {len(events)} steps at new input shapes were slow "
                    f"(jit_compile={jit}): an estimated {cost:.0f} ms of recompilation, "
                    f"{share:.0%} of fit time so far. Shapes seen: {listed}{more}. "
                    f"Fix: {FIXES['recompiling']}.")
        traced = self._traces - self._baseline
        return (f"RetracingMonitor: the train step was traced {traced} times in this fit "
                f"(estimated cost {cost:.0f} ms, {share:.0%} of fit time so far). Feed "
                "tensors of fixed dtype and structure (no Python numbers or lists in the "
                f"batch) and {FIXES['recompiling']}.")

    def _share(self, cost_ms):
        elapsed = (self._fit_t1 or time.time()) - self._fit_t0
        return cost_ms / 1e3 / elapsed if elapsed > 0 else 0.0

    def report(self):
        """What the monitor measured in the last (or current) `fit`.

        Returns:
            A dict: `trace_count` (traces during the fit, None when they
            cannot be counted), `trace_counts` (function -> total traces),
            `shapes` (distinct input shape keys, as lists, in order seen),
            `new_shapes` (their number), `shape_events` (step, shape,
            step_ms, cost_ms, traces of each step at a new shape or with a
            new trace), `spikes` (other slow steps: more than `spike_factor`
            x the median) and `spike_ms` (their time above it; without
            an instrumented dataset recompiles land here), `median_step_ms`,
            `recompile_ms` (estimated compile cost: time of those steps
            minus the median step), `recompile_share` (of fit wall time),
            `jit_compile`, `verdict` (`recompiling` or `healthy`), `fix`,
            `notes`.
        """
        priced = self._priced()
        causes = self._causes(priced)
        recompile_ms = sum(e["cost_ms"] or 0.0 for e in priced)
        fix = FIXES["recompiling"] if causes else FIXES["healthy"]
        if "traces" in causes:
            fix = ("feed tensors of fixed dtype and structure (no Python numbers or lists "
                   "in the batch); " + fix)
        notes = list(self.notes)
        if (not self._seen and self._spikes > self.max_new_shapes
                and getattr(getattr(self, "_model", None), "jit_compile", False)):
            notes.append(f"{self._spikes} slow steps cost {self._spike_ms:.0f} ms; under "
                         "jit_compile=True new input shapes are the usual cause: instrument "
                         "the dataset (kg.data.instrument) to confirm and name them")
        return {
            "trace_count": (self._traces - self._baseline) if self._functions else None,
            "trace_counts": {n: int(f.experimental_get_tracing_count())
                             for n, f in self._functions.items()},
            "shapes": [_as_lists(k) for k in sorted(self._seen, key=self._seen.get)],
            "new_shapes": len(self._seen),
            "shape_events": [{k: (_as_lists(v) if k == "shape" and v is not None else v)
                              for k, v in e.items()} for e in priced],
            "spikes": self._spikes,
            "spike_ms": self._spike_ms,
            "median_step_ms": self._median_ms(),
            "steps": self._steps,
            "recompile_ms": recompile_ms,
            "recompile_share": self._share(recompile_ms),
            "jit_compile": getattr(getattr(self, "_model", None), "jit_compile", None),
            "verdict": "recompiling" if causes else "healthy",
            "fix": fix,
            "notes": notes,
        }
