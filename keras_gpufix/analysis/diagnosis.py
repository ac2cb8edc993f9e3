"""What `keras-gpufix diagnose` decides about a run, beside the verdict itself.

Pure functions over the monitors' reports, so every threshold and choice of
a diagnosis lives in `analysis/`: how long the monitors warm up and when a
run's traces are taken (`trace_plan`), the period of the run's periodic stall whose line the
loop patch looks for (`stall_period`), and which run's what-if is the
report's (`main_what_if`). Imports neither TensorFlow nor Keras.
"""

__all__ = ["MONITOR_WARMUP", "trace_plan", "stall_period", "main_what_if"]

#: Steps the diagnose monitors leave out at the start of each run (trace,
#: compile, the pipeline's start-up).
MONITOR_WARMUP = 5

def trace_plan(total) -> dict:
    """When diagnose's `ProfilerTrigger` traces a run of `total` steps (None: unknown).

    Returns:
        A dict of the trigger's arguments: `at` (the step of the fixed
        trigger, after the warm-up and about a third into the run, by step
        10 at the latest), `steps` (traced steps: 2-10, half of what is left
        after `at`) and `max_traces` (2).
    """
    total = total or 30
    at = min(10, max(MONITOR_WARMUP, total // 3))
    return {"at": at, "steps": max(2, min(10, (total - at) // 2)), "max_traces": 2}


def stall_period(monitor) -> "int | None":
    """The period, in steps, of the run's periodic stall, or None.

    Args:
        monitor: a `GPUOscillationMonitor.report()` (or None): the latest of
            its `events` and `causes` that is a `periodic_stall` with a
            period (the verdict, or a cause beside it).
    """
    monitor = monitor or {}
    periods = [e.get("period") for e in (*(monitor.get("events") or ()),
                                         *(monitor.get("causes") or ()))
               if e.get("verdict") == "periodic_stall" and e.get("period")]
    return periods[-1] if periods else None


def main_what_if(fits):
    """The what-if of the run that took longest (`wall_s`), or None when no run has one.

    Args:
        fits: diagnose's runs (`fit` or custom loop), each a dict.
    """
    runs = sorted(fits, key=lambda f: -(f.get("wall_s") or 0))
    return next((f["what_if"] for f in runs if f.get("what_if")), None)
