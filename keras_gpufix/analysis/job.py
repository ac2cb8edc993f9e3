"""One report for a multi-worker job, from each worker's summary.

Under `MultiWorkerMirroredStrategy` every worker runs the same steps in
lockstep: a step ends on all workers when the slowest has sent its
gradients. So each worker's figures alone mislead: all show the same slow
step, and time spent waiting in the all-reduce for another worker is
counted as `step`. Each worker summarises its own run (`worker_summary`);
`judge_job` puts the summaries side by side:

| key                 | meaning                                                |
|---------------------|--------------------------------------------------------|
| `workers`           | summaries judged, and `missing` (task indices expected, not found) |
| `steps`             | steps of the job (the chief's count)                    |
| `samples_per_s`     | the job's throughput, counted once: every worker counts the global batches of its steps (`kg.data` and `kg.data.instrument` see the batch before Keras splits it), so this is their median, not their sum |
| `per_worker`        | per task: `step_ms`, `input_wait_ms`, `between_ms` per step, and `collective_wait_ms`: its step time above the fastest worker's step time (time spent waiting in the all-reduce for the others) |
| `straggler`         | None, or `task`, `phase` (`input_wait` or `between`), `excess_ms` per step and `share` of the job's cycle |
| `message`           | one line for people                                    |

The straggler is the worker whose own host time per step (`input_wait` +
`between`: the time before it can join the all-reduce) exceeds the median
of the other workers' by at least `THRESHOLDS["straggler_share"]` of the
job's cycle and `THRESHOLDS["min_slow_ms"]`. A worker whose *step* is slow
(a slower device) is not told apart: the all-reduce makes every worker's
step as long as the slowest one's.

Pure Python and NumPy: no TensorFlow, no Keras.
"""

import numpy as np

from keras_gpufix.analysis.verdicts import THRESHOLDS

__all__ = ["judge_job", "worker_summary"]

_OWN_PHASES = ("input_wait", "between")


def worker_summary(task, summary, chief=False, end_time=None) -> dict:
    """One worker's `StepLog.summary()` as the job report needs it.

    Args:
        task: the worker's task index.
        summary: its `StepLog.summary()`.
        chief: whether it is the chief. Defaults to False.
        end_time: wall time (s since the epoch) it was written; tells this
            run's summaries from an older run's. Defaults to None.

    Returns:
        A JSON-able dict: `task`, `chief`, `steps`, `total_s`, `samples`
        (None when the batch size was unknown), `input_wait_s` (None when
        not measured), `step_s`, `between_s`, `end_time`.
    """
    total = summary.get("total_s") or 0.0
    phases = summary.get("phases") or {}
    rate = summary.get("samples_per_s")
    wait = phases.get("input_wait")
    return {
        "task": int(task),
        "chief": bool(chief),
        "steps": int(summary.get("count") or 0),
        "total_s": float(total),
        "samples": None if rate is None else float(rate * total),
        "input_wait_s": None if wait is None else float(wait * total),
        "step_s": float(phases.get("step", 0.0) * total),
        "between_s": float(phases.get("between", 0.0) * total),
        "end_time": end_time,
    }


def judge_job(summaries, expected=None) -> dict:
    """The job's report from its workers' `worker_summary` dicts.

    Args:
        summaries: one `worker_summary` dict per worker (any order).
        expected: the number of workers in the job. Defaults to None (the
            summaries given).

    Returns:
        A dict with the keys of the module's table.

    Raises:
        ValueError: when `summaries` is empty or names a task twice.
    """
    summaries = sorted((s for s in summaries if s["steps"] > 0), key=lambda s: s["task"])
    if not summaries:
        raise ValueError("`summaries` must hold at least one worker's summary with steps.")
    tasks = [s["task"] for s in summaries]
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"`summaries` names a task twice. Received tasks: {tasks}")
    expected = len(summaries) if expected is None else int(expected)
    per = {}
    for s in summaries:
        n = s["steps"]
        per[s["task"]] = {
            "task": s["task"],
            "steps": n,
            "step_ms": s["step_s"] / n * 1e3,
            "input_wait_ms": None if s["input_wait_s"] is None else s["input_wait_s"] / n * 1e3,
            "between_ms": s["between_s"] / n * 1e3,
        }
    fastest = min(w["step_ms"] for w in per.values())
    for w in per.values():
        w["collective_wait_ms"] = w["step_ms"] - fastest
    rates = [s["samples"] / s["total_s"] for s in summaries
             if s["samples"] is not None and s["total_s"] > 0]
    chief = next((s for s in summaries if s["chief"]), summaries[0])
    cycle_ms = float(np.median([s["total_s"] / s["steps"] for s in summaries])) * 1e3
    straggler = _straggler(list(per.values()), cycle_ms)
    report = {
        "workers": len(summaries),
        "missing": sorted(set(range(expected)) - set(tasks)),
        "steps": chief["steps"],
        "cycle_ms": cycle_ms,
        "samples_per_s": float(np.median(rates)) if rates else None,
        "per_worker": [per[t] for t in tasks],
        "straggler": straggler,
    }
    report["message"] = _message(report)
    return report


def _own_ms(worker):
    return (worker["input_wait_ms"] or 0.0) + worker["between_ms"]


def _straggler(workers, cycle_ms):
    if len(workers) < 2 or cycle_ms <= 0:
        return None
    slowest = max(workers, key=_own_ms)
    others = [w for w in workers if w is not slowest]
    excess = {p: (slowest[f"{p}_ms"] or 0.0)
              - float(np.median([w[f"{p}_ms"] or 0.0 for w in others]))
              for p in _OWN_PHASES}
    total = sum(excess.values())
    if total < THRESHOLDS["min_slow_ms"] or total / cycle_ms < THRESHOLDS["straggler_share"]:
        return None
    phase = max(excess, key=excess.get)
    return {"task": slowest["task"], "phase": phase, "excess_ms": total,
            "share": total / cycle_ms}


def _message(report):
    rate = report["samples_per_s"]
    line = (f"job of {report['workers']} workers, {report['steps']} steps, "
            f"{report['cycle_ms']:.1f} ms per step"
            + ("" if rate is None else f", {rate:.1f} samples/s (counted once)"))
    if report["missing"]:
        line += f"; no summary from task(s) {report['missing']}"
    s = report["straggler"]
    if s is None:
        return line + "; no straggler"
    waiting = max(w["collective_wait_ms"] for w in report["per_worker"])
    return (line + f"; straggler: worker {s['task']} ({s['phase']}: {s['excess_ms']:.1f} ms "
            f"more per step than the others, {s['share']:.0%} of the cycle; the others wait "
            f"up to {waiting:.1f} ms per step in the all-reduce)")
