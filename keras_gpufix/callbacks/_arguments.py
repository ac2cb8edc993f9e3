"""The callbacks' argument checks, without Keras.

Each constructor calls its function here first; `keras-gpufix validate`
calls the same function on a config's `callbacks` section, with the
constructor's defaults read from its source, so it imports neither Keras nor
TensorFlow. Each function raises the `ValueError` its constructor does and
returns what the constructor keeps of the arguments.
"""

import numpy as np

from keras_gpufix.analysis import OscillationDetector, StepLog

__all__ = ["CHECKS"]

_TRIGGERS = ("oscillation", "slow_step")


def step_timer(batch_size, warmup, window):
    """`StepTimer`'s arguments -> its `StepLog` of `window` records."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1. Received: batch_size={batch_size}")
    if warmup < 0:
        raise ValueError(f"`warmup` must be >= 0. Received: warmup={warmup}")
    return StepLog(window)


def gpu_oscillation_monitor(window, warmup, min_windows, thresholds, on_detect):
    """`GPUOscillationMonitor`'s arguments -> its `OscillationDetector`."""
    if on_detect is not None and not (
        callable(on_detect) or hasattr(on_detect, "on_oscillation")
    ):
        raise ValueError(
            "`on_detect` must be callable or have an `on_oscillation` method. "
            f"Received: on_detect={on_detect!r}"
        )
    return OscillationDetector(window=window, warmup=warmup, min_windows=min_windows,
                               **dict(thresholds or {}))


def profiler_trigger(log_dir, trigger, steps, max_traces, cooldown, warmup, analysis_timeout):
    """`ProfilerTrigger`'s arguments -> `(kinds, steps)` of its `trigger`:
    the set of event kinds and the sorted step numbers it traces at."""
    if not log_dir:
        raise ValueError(f"`log_dir` must be a directory path. Received: log_dir={log_dir!r}")
    kinds, at_steps = _parse_trigger(trigger)
    for name, value, low in (("steps", steps, 1), ("max_traces", max_traces, 1),
                             ("cooldown", cooldown, 0), ("warmup", warmup, 0)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(
                f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
    if not analysis_timeout >= 0:
        raise ValueError("`analysis_timeout` must be >= 0 (seconds). "
                         f"Received: analysis_timeout={analysis_timeout}")
    return kinds, at_steps


def _parse_trigger(trigger):
    items = [trigger] if isinstance(trigger, (str, int)) else list(trigger or [])
    kinds, steps = set(), set()
    for item in items:
        if isinstance(item, str) and item in _TRIGGERS:
            kinds.add(item)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool) and item >= 0:
            steps.add(int(item))
        else:
            items = None
            break
    if not items:
        raise ValueError(
            "`trigger` must be 'oscillation', 'slow_step', a step number >= 0, or a "
            f"list of these. Received: trigger={trigger!r}"
        )
    return kinds, sorted(steps)


def retracing_monitor(functions, max_new_shapes):
    """`RetracingMonitor`'s arguments -> its `functions` as a list (or None)."""
    if functions is not None:
        if callable(functions):
            functions = [functions]
        if (not isinstance(functions, (list, tuple)) or not functions
                or not all(callable(f) for f in functions)):
            raise ValueError("`functions` must be a list of the loop's step functions "
                             f"(tf.function or Python callables). Received: "
                             f"functions={functions!r}")
        functions = list(functions)
    if max_new_shapes is not None and (
            not isinstance(max_new_shapes, (int, np.integer)) or max_new_shapes < 1):
        raise ValueError("`max_new_shapes` must be an integer >= 1. "
                         f"Received: max_new_shapes={max_new_shapes!r}")
    return functions


# Each public callback's name -> its check.
CHECKS = {"StepTimer": step_timer, "GPUOscillationMonitor": gpu_oscillation_monitor,
          "ProfilerTrigger": profiler_trigger, "RetracingMonitor": retracing_monitor}
