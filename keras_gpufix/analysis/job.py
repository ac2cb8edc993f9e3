"""One report for a multi-worker job, from each worker's summary.

Under `MultiWorkerMirroredStrategy` every worker runs the same steps in
lockstep: a step ends on all workers when the slowest has sent its
gradients. So each worker's figures alone mislead: all show the same slow
step, and time spent waiting in the all-reduce for another worker is
counted as `step`. Each worker summarises its own run (`worker_summary`);
`judge_job` puts the summaries side by side:

| key             | meaning                                                    |
|-----------------|------------------------------------------------------------|
| `workers`       | summaries judged, and `missing` (task indices expected, not found) |
| `steps`         | steps of the job (the chief's count)                        |
| `cycle_ms`      | the job's time per step (the workers' median)               |
| `samples_per_s` | the job's throughput, counted once: every worker counts the global batches of its steps (`kg.data` and `kg.data.instrument` see the batch before Keras splits it), so this is their median, not their sum |
| `per_worker`    | per task (the table below)                                  |
| `straggler`     | None, or `task`, `cause`, `phase`, `excess_ms`, `share`, `gain`, `others_wait_share`, `fix` (below) |
| `series`        | the job's timeline: `first_step`, `steps`, and per task (`workers`, keyed by the task as a string) `input_wait_ms`, `compute_ms`, `collective_wait_ms`, `between_ms` per point, the points every worker has |
| `message`       | one line for people                                         |

Per worker (`per_worker`), per step:

| key                  | meaning                                                 |
|----------------------|---------------------------------------------------------|
| `input_wait_ms`      | waiting for its batch (None: not measured)              |
| `step_ms`            | its step, as its host saw it (its own compute and its wait at the all-reduce) |
| `collective_wait_ms` | its wait at the all-reduce for the others: its step above the shortest step of the job (the worker that joins the all-reduce last waits least). Estimated, point by point of the timeline: TensorFlow tells no worker when the others joined |
| `compute_ms`         | `step_ms - collective_wait_ms`: its own step (an estimate: see "a slow step" below) |
| `between_ms`         | host time between its steps                              |
| `cpu_wait_ms`        | its threads' wait for a CPU (`schedstat` run delay, summed over threads), per step (None: not measured) |
| `own_cpu_share`      | its CPU time over its run's wall time and its usable CPUs |
| `others_share`       | other processes' share of the machine's CPU over its run |

The straggler is the worker that makes the others wait: the one whose
lateness per step exceeds the median of the other workers' by at least
`THRESHOLDS["straggler_share"]` of the job's cycle and `MIN_EXCESS_MS`.
Its lateness, by cause (`cause`):

- `input`: its input wait above the others' (`phase` `input_wait`);
- `between`: its time between steps above the others' (callbacks, logging,
  checkpoints on that worker; `phase` `between`);
- `cpu_shared`: its threads' wait for a CPU per step and per usable CPU
  (threads that wait at the same time on c CPUs count once per CPU)
  exceeds the others' by at least `THRESHOLDS["straggler_share"]` of the
  cycle, and by more than its host time's excess (a starved input pipeline
  also shows as input wait), while it used less than `SHARED_BELOW` of its
  own CPUs (so the CPUs it waited for ran other processes, not its own
  threads), and it is its own: the others' threads wait less than
  `QUIET_WAIT` of the cycle and it waits `CPU_WAIT_RATIO` times as long.
  Its lateness is that excess wait (at most the cycle less its own CPU
  time per step and CPU): an estimate, stated as such (`phase` `cpu`). Where every worker's
  threads wait (a host loaded by other work), no one of them is named.

A slow step (a slower device, a heavier share of the work) is not told
apart: the all-reduce ends every worker's step together, so each worker's
step lasts as long as the slowest one's and its own compute is hidden in
it. The report says so when the workers' steps are the job's cycle and no
worker is late.

What the others lose: `others_wait_share`, the median of the other
workers' `collective_wait_ms` over the cycle (measured: time they spent in
the all-reduce waiting), and `share` (`excess_ms` over the cycle) and
`gain` (`cycle / (cycle - excess_ms)`): how much faster the job would run
if the straggler were as fast as the others, at most: a matched pair still
waits for whichever worker is late at each step (on the loaded 2-core host
of benchmarks/straggler.py, which re-measures it, the job's loss was
over-predicted by 4-44%, depending on the load).

Pure Python and NumPy: no TensorFlow, no Keras.
"""

import numpy as np

from keras_gpufix.analysis.verdicts import THRESHOLDS

__all__ = ["CPU_WAIT_RATIO", "MIN_EXCESS_MS", "QUIET_WAIT", "SERIES_POINTS", "SHARED_BELOW",
           "judge_job", "job_headline", "worker_summary"]

#: Least lateness per step, in ms, that makes a straggler.
MIN_EXCESS_MS = 2.0
#: A straggler's own use of its usable CPUs below which the CPUs its threads
#: waited for were taken by other processes (at or above it, its own threads
#: compete for them).
SHARED_BELOW = 0.9
#: A straggler's CPU is shared only where the other workers' threads wait for a
#: CPU less than this share of the cycle (per usable CPU, per step) ...
QUIET_WAIT = 0.5
#: ... and its own threads wait at least this many times as long as theirs: on
#: a host every worker shares with other work (a 2-core machine at load 13 in
#: benchmarks/straggler.py), the threads' waits differ from one run to the next by
#: up to 5x with nothing planted, and no one worker is named for them.
CPU_WAIT_RATIO = 3.0
#: Points of each worker's timeline the job report keeps.
SERIES_POINTS = 64
_COLUMNS = ("input_wait_ms", "step_ms", "between_ms")
#: What to do, by cause (`{task}`: the straggler).
FIXES = {
    "input": "speed up worker {task}'s input (its pipeline, its storage): parallel map, "
             "prefetch, a feature cache on that host",
    "between": "move worker {task}'s work between steps (callbacks, logging, checkpoints) "
               "off the step path, or to the chief alone",
    "cpu_shared": "give worker {task} its CPUs back: stop or move the other processes on "
                  "its host (or pin them to other CPUs)",
}
_CAUSE_WORDS = {"input": "its input", "between": "its work between steps",
                "cpu_shared": "its CPU shared with another process"}


def worker_summary(task, report, chief=False, end_time=None) -> dict:
    """One worker's monitor report as the job report needs it.

    Args:
        task: the worker's task index.
        report: its `GPUOscillationMonitor.report()` (or a dict with its
            `step_time`, the `StepLog.summary()`, and optionally its
            `contention`, `analysis.cpu_contention`, and `series`,
            `StepSeries.as_dict()`).
        chief: whether it is the chief. Defaults to False.
        end_time: wall time (s since the epoch) it was written; tells this
            run's summaries from an older run's. Defaults to None.

    Returns:
        A JSON-able dict: `task`, `chief`, `steps`, `total_s`, `samples`
        (None when the batch size was unknown), `input_wait_s` (None when
        not measured), `step_s`, `between_s`, `end_time`; the worker's CPU
        over its whole run (None where not measured): `wall_s`,
        `own_cpu_s`, `waited_s` (its threads' wait for a CPU), `cpus`,
        `others_share`; and `series`, its timeline in at most
        `SERIES_POINTS` points (`first_step`, `steps`, `input_wait_ms`,
        `step_ms`, `between_ms`).
    """
    summary = report.get("step_time") or {}
    total = summary.get("total_s") or 0.0
    phases = summary.get("phases") or {}
    rate = summary.get("samples_per_s")
    wait = phases.get("input_wait")
    cpu = report.get("contention") or {}
    waited = cpu.get("waited_share")
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
        "wall_s": cpu.get("wall_s"),
        "own_cpu_s": cpu.get("own_cpu_s"),
        "waited_s": None if waited is None else float(waited * cpu["wall_s"]),
        "cpus": cpu.get("cpus"),
        "others_share": cpu.get("others_share"),
        "series": _coarse(report.get("series") or {}),
    }


def _coarse(series):
    """`series`' per-step phases in at most `SERIES_POINTS` points, neighbours merged
    (each point the mean per step of its steps)."""
    steps = list(series.get("steps") or ())
    if not steps:
        return None
    group = -(-len(steps) // SERIES_POINTS)
    out = {"first_step": [], "steps": []}
    for k in range(0, len(steps), group):
        n = steps[k:k + group]
        out["first_step"].append(series["first_step"][k])
        out["steps"].append(sum(n))
        for column in _COLUMNS:
            values = series[column][k:k + group]
            out.setdefault(column, []).append(
                None if any(v is None for v in values)
                else round(sum(v * m for v, m in zip(values, n)) / sum(n), 3))
    return out


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
    cycle_ms = float(np.median([s["total_s"] / s["steps"] for s in summaries])) * 1e3
    per = [_worker(s, cycle_ms) for s in summaries]
    series = _timeline(summaries)
    fastest = min(w["step_ms"] for w in per)
    for w in per:
        w["collective_wait_ms"] = w["step_ms"] - fastest
        w["compute_ms"] = fastest
    rates = [s["samples"] / s["total_s"] for s in summaries
             if s["samples"] is not None and s["total_s"] > 0]
    chief = next((s for s in summaries if s["chief"]), summaries[0])
    report = {
        "workers": len(summaries),
        "missing": sorted(set(range(expected)) - set(tasks)),
        "steps": chief["steps"],
        "cycle_ms": cycle_ms,
        "samples_per_s": float(np.median(rates)) if rates else None,
        "per_worker": per,
        "straggler": _straggler(per, cycle_ms),
        "series": series,
    }
    report["message"] = _message(report)
    return report


def _worker(s, cycle_ms):
    n = s["steps"]
    wall, waited, cpus = s.get("wall_s"), s.get("waited_s"), s.get("cpus")
    return {
        "task": s["task"],
        "chief": s["chief"],
        "steps": n,
        "step_ms": s["step_s"] / n * 1e3,
        "input_wait_ms": None if s["input_wait_s"] is None else s["input_wait_s"] / n * 1e3,
        "between_ms": s["between_s"] / n * 1e3,
        "cpu_wait_ms": waited / wall * cycle_ms if waited is not None and wall else None,
        "own_cpu_share": (s["own_cpu_s"] / wall / cpus
                          if s.get("own_cpu_s") is not None and wall and cpus else None),
        "cpus": cpus,
        "others_share": s.get("others_share"),
    }


def _timeline(summaries):
    """The points every worker's series has (by first step), with each worker's wait at
    the all-reduce per point: its step above the shortest step of that point."""
    kept = [s.get("series") or {} for s in summaries]
    common = set.intersection(*(set(k.get("first_step") or ()) for k in kept))
    if not common:
        return None
    firsts = sorted(common)
    rows = []
    for k in kept:
        at = {f: i for i, f in enumerate(k["first_step"])}
        rows.append({c: [k[c][at[f]] for f in firsts] for c in (*_COLUMNS, "steps")})
    shortest = [min(r["step_ms"][i] for r in rows) for i in range(len(firsts))]
    return {"first_step": firsts, "steps": rows[0]["steps"], "workers": {
        str(s["task"]): {"input_wait_ms": r["input_wait_ms"], "between_ms": r["between_ms"],
                         "compute_ms": shortest,
                         "collective_wait_ms": [round(a - b, 3)
                                                for a, b in zip(r["step_ms"], shortest)]}
        for s, r in zip(summaries, rows)}}


def _host_ms(worker):
    return (worker["input_wait_ms"] or 0.0) + worker["between_ms"]


def _lateness(worker, others, cycle_ms):
    """`(excess_ms, cause, phase)` of `worker` against the median of `others`."""
    excess = {p: (worker[f"{p}_ms"] or 0.0)
              - float(np.median([w[f"{p}_ms"] or 0.0 for w in others]))
              for p in ("input_wait", "between")}
    host = sum(excess.values())
    phase = max(excess, key=excess.get)
    cause = "input" if phase == "input_wait" else "between"
    waits = [_per_cpu(w) for w in others if _per_cpu(w) is not None]
    if _per_cpu(worker) is None or not waits:
        return host, cause, phase
    usual = float(np.median(waits))
    cpu = _per_cpu(worker) - usual
    shared = worker["own_cpu_share"] is not None and worker["own_cpu_share"] < SHARED_BELOW
    # its own: the others' threads wait little, and it waits several times as long
    alone = usual < QUIET_WAIT * cycle_ms and _per_cpu(worker) >= CPU_WAIT_RATIO * usual
    if shared and alone and cpu > host and cpu >= THRESHOLDS["straggler_share"] * cycle_ms \
            and cpu >= MIN_EXCESS_MS:
        # with its CPUs back, its step still takes its own CPU work
        return min(cpu, cycle_ms * (1 - worker["own_cpu_share"])), "cpu_shared", "cpu"
    return host, cause, phase


def _per_cpu(worker):
    """Its threads' wait for a CPU per step, per usable CPU (threads that wait at the same
    time on c CPUs hold up c streams of work, not more), or None."""
    if worker["cpu_wait_ms"] is None:
        return None
    return worker["cpu_wait_ms"] / (worker["cpus"] or 1)


def _straggler(workers, cycle_ms):
    if len(workers) < 2 or cycle_ms <= 0:
        return None
    late = {w["task"]: _lateness(w, [o for o in workers if o is not w], cycle_ms)
            for w in workers}
    task = max(late, key=lambda t: late[t][0])
    excess, cause, phase = late[task]
    if excess < MIN_EXCESS_MS or excess / cycle_ms < THRESHOLDS["straggler_share"]:
        return None
    others = [w["collective_wait_ms"] for w in workers if w["task"] != task]
    return {"task": task, "cause": cause, "phase": phase, "excess_ms": excess,
            "share": excess / cycle_ms, "gain": cycle_ms / max(cycle_ms - excess, 1e-9),
            "others_wait_share": float(np.median(others)) / cycle_ms,
            "fix": FIXES[cause].format(task=task)}


def _cause_text(s):
    return f"{_CAUSE_WORDS[s['cause']]}: {s['excess_ms']:.1f} ms per step later than the others"


def _wait_text(s, others):
    """How the others wait for the straggler: measured at the all-reduce, or (a slowed
    step, `cpu_shared`) inside their steps, which its step ends late."""
    if s["cause"] == "cpu_shared" and s["others_wait_share"] < s["share"] / 2:
        return (f"its slowed steps end {others}' steps late (their wait at the all-reduce is "
                "inside their step times)")
    return (f"{others} wait {s['others_wait_share']:.0%} of the job's time for it in the "
            "all-reduce")


def _message(report):
    rate = report["samples_per_s"]
    line = (f"job of {report['workers']} workers, {report['steps']} steps, "
            f"{report['cycle_ms']:.1f} ms per step"
            + ("" if rate is None else f", {rate:.1f} samples/s (counted once)"))
    if report["missing"]:
        line += f"; no summary from task(s) {report['missing']}"
    s = report["straggler"]
    if s is None:
        return line + "; no straggler (a slow step on one worker is not told apart)"
    return (line + f"; straggler: worker {s['task']} ({_cause_text(s)}); "
            f"{_wait_text(s, 'the others')}; the job at most {s['gain']:.2f}x faster if it "
            f"matched them. Fix: {s['fix']}")


def job_headline(job) -> "tuple | None":
    """`(verdict text, fix text)` a job's headline says when one worker holds the others
    back, or None (no job, no straggler): `straggler; worker 1 (its input) costs the job
    48% of its time ...`."""
    s = (job or {}).get("straggler")
    if not s:
        return None
    return (f"straggler; worker {s['task']} ({_CAUSE_WORDS[s['cause']]}) costs the job "
            f"{s['share']:.0%} of its time: {_wait_text(s, 'the other workers')}",
            f"{s['fix']}: the job at most {s['gain']:.2f}x faster if worker {s['task']} "
            "matched the others (its lateness removed)")
