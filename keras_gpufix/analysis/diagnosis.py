"""What `keras-gpufix diagnose` decides about a run, beside the verdict itself.

Pure functions over the monitors' reports, so every threshold and choice of
a diagnosis lives in `analysis/`: how long the monitors warm up and when a
run's traces are taken (`trace_plan`, `trace_question`), the period of the run's
periodic stall whose line the loop patch looks for (`stall_period`, `stall_located`; one only
the stack samples found: `sampled_stall`), which run's
what-if is the report's (`main_what_if`), and diagnose's own bill: the seconds it
added beyond the script, item by item, and their bound (`own_cost`,
`traced_extra_s`). Imports neither TensorFlow nor Keras.
"""

__all__ = ["MONITOR_WARMUP", "OWN_COST_SHARE", "OWN_COST_FLOOR_S", "OWN_ITEMS", "TRACE_SLOWDOWN",
           "trace_plan", "trace_question", "trace_cost_text", "stall_period", "stall_located",
           "sampled_stall", "main_what_if",
           "own_cost", "traced_extra_s"]

from keras_gpufix.analysis.verdicts import THRESHOLDS

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


#: diagnose's own seconds beyond the script (the what-if and an opted-in trace
#: aside) are held to this share of the script's own time, or to
#: `OWN_COST_FLOOR_S`, whichever is larger.
OWN_COST_SHARE = 0.10
OWN_COST_FLOOR_S = 5.0

#: diagnose's own items, in the order the report lists them: item -> what it is.
OWN_ITEMS = {
    "start-up": "its imports and patches before the script ran (the script's framework "
                "import, which it pays alone too, left out)",
    "scan": "the static scan of the script and its own modules, and the markers on their "
            "flagged lines",
    "monitors": "the monitors' begin and end hooks of each fit and epoch (and of each "
                "step, on TensorFlow), and freeing a stopped fit's input",
    "trace capture": "starting and saving the profiler traces, and the traced steps' "
                     "slowdown under the profiler",
    "trace analysis": "waiting at a fit's end for XProf's analysis of its traces",
    "what-if": "the input alone and the step alone, after each run (its own budget)",
    "patched run": "the script run again with the eager step's patch, and with a periodic "
                   "stall's line skipped, before they are offered",
    "report": "the judgement, the environment, the run record and its HTML report",
}


def trace_question(mode, gpus) -> "str | None":
    """Why diagnose traces a run, or None when it takes no trace.

    A trace shows what the step log cannot time: on a GPU, whether the
    device idles within a step (kernels, copies, gaps), which the host's
    clock does not see. On a host without one the step log measures what
    XProf's input analysis would say (input wait, step, the time between),
    so no trace is taken unless the user asks (`--trace`): its save pauses
    the run (28 s after 10 steps of 9 s, seen on a CPU) for no new answer.

    Args:
        mode: True (the user opted in: `--trace`), False (`--no-trace`) or
            `"auto"`.
        gpus: the GPUs the run has (a list; empty on a CPU host).
    """
    if mode is True:
        return "asked for (--trace)"
    if mode == "auto" and gpus:
        return ("on the GPU, whether the device idles within a step, which the step log "
                "(the host's clock) cannot see")
    return None


#: A trace's cost (its steps' slowdown under the profiler, starting and saving
#: it) as a share of its steps' own time, at most: TensorFlow on a CPU, 2.0 for
#: steps of ~40 ms (1.6 s for 2 traces of 10 steps), 0.03 for steps of ~2.5 s
#: (0.2 s for 2 steps); benchmarks/diagnose_cost.py, --trace.
TRACE_SLOWDOWN = 2.0


def trace_cost_text(steps, median_s) -> str:
    """What a trace of `steps` steps will cost, said before it starts.

    Args:
        steps: the steps it traces.
        median_s: the run's median step so far, in seconds (None: unknown).
    """
    if not median_s:
        return ("its steps run slower under the profiler and saving it pauses the run "
                "after them; the report lists what it cost")
    return (f"{steps} steps of about {median_s * 1e3:.0f} ms run under the profiler; they "
            f"and its save cost up to about {TRACE_SLOWDOWN * steps * median_s:.1f} s more "
            f"({TRACE_SLOWDOWN:g}x their time, as measured on a CPU); the report lists what "
            "it cost")


def traced_extra_s(cycles, traces) -> float:
    """The seconds the traced steps took beyond the run's other steps: their
    cycles' sum less as many median untraced cycles (0 when not more).

    Args:
        cycles: `{step index: cycle seconds}` of the run's timed steps.
        traces: `(start_step, end_step)` of each trace, inclusive.
    """
    traced = {i for start, end in traces for i in range(start, (end or start) + 1)}
    others = sorted(c for i, c in cycles.items() if i not in traced)
    if not others or not traced:
        return 0.0
    median = others[len(others) // 2]
    mine = [c for i, c in cycles.items() if i in traced]
    return max(0.0, sum(mine) - median * len(mine))


#: Why an item is listed aside of the bound, where it is not an opted-in trace.
_ASIDE = {"what-if": " (its own budget)", "patched run": " (the fixes run before they are offered)"}


def own_cost(seconds, wall_s, opted_in_trace=False) -> dict:
    """diagnose's bill: what it added beyond the script, item by item, against
    its bound (`OWN_COST_SHARE` of the script's own time or `OWN_COST_FLOOR_S`,
    whichever is larger; the what-if, with its own budget, and an opted-in
    trace are listed but not held to it).

    Args:
        seconds: `{item: seconds}` of `OWN_ITEMS` diagnose measured.
        wall_s: the process's wall from its start to the report.
        opted_in_trace: the user asked for the traces (`--trace`).

    Returns:
        A dict: `items` (each `item`, `seconds`, `counted`), `script_s`
        (the wall less every item: the script's own time), `added_s` (the
        counted items), `bound_s`, `within`, `aside_s`, `opted_in_trace` and
        `text` (lines).
    """
    aside = {"what-if", "patched run"} | (
        {"trace capture", "trace analysis"} if opted_in_trace else set())
    items = [{"item": k, "seconds": float(seconds.get(k) or 0.0), "counted": k not in aside}
             for k in OWN_ITEMS]
    script_s = max(0.0, wall_s - sum(i["seconds"] for i in items))
    added = sum(i["seconds"] for i in items if i["counted"])
    aside_s = sum(i["seconds"] for i in items if not i["counted"])
    bound = max(OWN_COST_SHARE * script_s, OWN_COST_FLOOR_S)
    within = added <= bound
    share = f" ({added / script_s:.0%} of it)" if script_s else ""
    listed = ", ".join(f"{i['item']} {i['seconds']:.1f} s" for i in items if i["counted"])
    text = [f"diagnose's own time: {added:.1f} s beyond the script's {script_s:.1f} s{share}, "
            f"{'within' if within else 'OVER'} its bound of {bound:.1f} s (the larger of "
            f"{OWN_COST_SHARE:.0%} of the script's time and {OWN_COST_FLOOR_S:g} s)",
            f"  {listed}"]
    if aside_s:
        text.append("  aside, not held to the bound: " + ", ".join(
            f"{i['item']} {i['seconds']:.1f} s" + _ASIDE.get(i["item"], " (asked for: --trace)")
            for i in items if not i["counted"] and i["seconds"]))
    return {"items": items, "script_s": script_s, "added_s": added, "bound_s": bound,
            "within": within, "aside_s": aside_s, "opted_in_trace": opted_in_trace,
            "text": text}


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


def stall_located(monitor) -> bool:
    """Whether the loop patch looks for the loop-body line of the run's stalls: a
    `periodic_stall` with its period (`stall_period`), or an `irregular_stall`, the
    verdict or a cause beside it (under load the cycles' times lose a period the
    stack samples still hold: `analysis.locate_periodic` with no period).

    Args:
        monitor: a `GPUOscillationMonitor.report()` (or None).
    """
    monitor = monitor or {}
    return stall_period(monitor) is not None or any(
        e.get("verdict") == "irregular_stall" for e in (
            monitor, *(monitor.get("events") or ()), *(monitor.get("causes") or ())))


def sampled_stall(body_share: float, body_of_cycle: float) -> "float | None":
    """The share of the run that work every k cycles costs where only the stack samples
    found it (`locate_periodic` with no stall judged): its share of the loop body's
    sampled time (`sampled_share`) times the loop body's share of the cycles; None
    below `THRESHOLDS["cost_share"]` (no cause)."""
    share = body_share * min(1.0, max(0.0, body_of_cycle))
    return share if share >= THRESHOLDS["cost_share"] else None


def main_what_if(fits):
    """The what-if of the run that took longest (`wall_s`), or None when no run has one.

    Args:
        fits: diagnose's runs (`fit` or custom loop), each a dict.
    """
    runs = sorted(fits, key=lambda f: -(f.get("wall_s") or 0))
    return next((f["what_if"] for f in runs if f.get("what_if")), None)
