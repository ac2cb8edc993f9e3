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
| `series`        | the job's timeline: `first_step`, `steps`, and per task (`workers`, keyed by the task as a string) `input_wait_ms`, `compute_ms`, `collective_wait_ms`, `between_ms` per point, the points every worker has (per point, the wait at the all-reduce is estimated: a step above that point's shortest; the CPU is measured over the run only) |
| `message`       | one line for people                                         |

Per worker (`per_worker`), per step:

| key                  | meaning                                                 |
|----------------------|---------------------------------------------------------|
| `input_wait_ms`      | waiting for its batch (None: not measured)              |
| `step_ms`            | its step, as its host saw it (its own compute and its wait at the all-reduce) |
| `compute_ms`         | its own time in its step: its CPU time and the share of its threads' wait for a CPU that lengthened its step (below); where a worker's CPU figures are unknown, the job's shortest step (an estimate) |
| `collective_wait_ms` | `step_ms - compute_ms`: its wait at the all-reduce for the others |
| `between_ms`         | host time between its steps                              |
| `cpu_ms`             | its CPU time (all its threads), per step (None: not measured) |
| `cpu_wait_ms`        | its threads' wait for a CPU (`schedstat` run delay, summed over threads), per step (None: not measured) |
| `own_cpu_share`      | its CPU time over its run's wall time and its usable CPUs |
| `others_share`       | other processes' share of the machine's CPU over its run |
| `others_mine_share`  | other processes' share of the CPUs it may use (its affinity) over its run |
| `others_cpu_ms`      | other processes' time on its CPUs, per step, per CPU (`others_mine_share` of the cycle) |

CPU figures are the worker's steady steps' (from its first step after
warmup), per step of the job's cycle.

How a worker's step splits, on CPU devices: a worker waiting at the
all-reduce for another sleeps, neither running nor waiting for a CPU; so
its own time in its step is its CPU time and the time its threads waited
while other processes held its CPUs. Its threads' summed wait for a CPU
(`schedstat` run delay) also holds their waits for each other (many
threads on few CPUs), which do not lengthen its step beyond its CPU time;
so the wait that counts is at most other processes' time on the CPUs it
may use (`others_cpu_ms`, from `/proc/stat`'s per-CPU lines over its
affinity: a worker pinned with `taskset` shares only those), and at most
its threads' wait. Both are per usable CPU. The time every worker's step
holds besides (the all-reduce's own latency: the least over the workers)
is its own too. Where every worker's step holds more than the straggler
threshold besides (a custom loop's `next()` agreeing with the others), the
CPU cannot split the steps, and they are split as without CPU figures: the
job's shortest step stands for every worker's own (an estimate). On a GPU
the device's work is not in the host's CPU time: a slower GPU reads as
time at the all-reduce.

The straggler is the worker that makes the others wait: the one that
joins the all-reduce later than the median of the other workers by at
least `THRESHOLDS["straggler_share"]` of the job's cycle and
`MIN_EXCESS_MS`, and whose cause's part alone does too (two workers' small
differences in every part add up); where the cause is its own step's work,
`THRESHOLDS["straggler_step_share"]` (CPU time per step varies more between
identical workers than their input wait). Its cause (`cause`) is the largest
part:

- `input`: its input wait above the others' (`phase` `input_wait`);
- `between`: its time between steps above the others' (callbacks, logging,
  checkpoints on that worker; `phase` `between`);
- `step`: its CPU time per step above the others' (more work in its step:
  a heavier share, extra ops; `phase` `step`);
- `cpu_shared`: its threads' wait while other processes held its CPUs,
  above the others' (another process on its CPUs; `phase` `cpu`).

The last two need the CPU to split the steps (Linux); elsewhere a slow
step is not told apart, and the message says so. Its lateness (`excess_ms`):
for `input` and `between`, its input wait and time between steps above
the others' (its CPU work ran while it waited); for `step` and
`cpu_shared`, those and its own time in its step above theirs.

What the others lose: `others_wait_share`, the median of the other
workers' `collective_wait_ms` over the cycle, and `share` (`excess_ms`
over the cycle) and `gain` (`cycle / (cycle - excess_ms)`): how much faster
the job would run if the straggler were as fast as the others, at most: a
matched pair still waits for whichever worker is late at each step
(benchmarks/straggler.py re-measures it: docs/distributed.md).

Pure Python and NumPy: no TensorFlow, no Keras.
"""

import numpy as np

from keras_gpufix.analysis.verdicts import THRESHOLDS

__all__ = ["MIN_EXCESS_MS", "SERIES_POINTS",
           "judge_job", "job_headline", "worker_summary"]

#: Least lateness per step, in ms, that makes a straggler.
MIN_EXCESS_MS = 2.0
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
    "step": "even out the workers' steps: worker {task} does more work per step (a heavier "
            "share of the batch, a slower or busier device); give it a smaller share or a "
            "faster device",
}
_CAUSE_WORDS = {"input": "its input", "between": "its work between steps",
                "step": "its own step's work", "cpu_shared": "its CPU shared with another process"}
#: The causes the CPU tells (where it splits the steps).
_CPU_CAUSES = ("step", "cpu_shared")
#: The phase of the cycle each cause lengthens.
_PHASES = {"input": "input_wait", "between": "between", "step": "step", "cpu_shared": "cpu"}


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
    cpu = report.get("steady_contention") or report.get("contention") or {}
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
        "others_mine_share": cpu.get("others_mine_share"),
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
    split = _splits(per, cycle_ms)
    straggler = _straggler(per, cycle_ms, split)
    # a worker late for its input ran its CPU work meanwhile: the CPU splits no step
    _split_steps(per, split and (straggler is None or straggler["cause"] in _CPU_CAUSES))
    if straggler is not None:
        others = [w["collective_wait_ms"] for w in per if w["task"] != straggler["task"]]
        straggler["others_wait_share"] = float(np.median(others)) / cycle_ms
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
        "straggler": straggler,
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
        "cpu_ms": (s["own_cpu_s"] / wall * cycle_ms
                   if s.get("own_cpu_s") is not None and wall else None),
        "own_cpu_share": (s["own_cpu_s"] / wall / cpus
                          if s.get("own_cpu_s") is not None and wall and cpus else None),
        "cpus": cpus,
        "others_share": s.get("others_share"),
        "others_mine_share": s.get("others_mine_share"),
        "others_cpu_ms": (None if s.get("others_mine_share") is None
                          else s["others_mine_share"] * cycle_ms),
    }


def _split_steps(workers, split):
    """Each worker's `compute_ms` (its own time in its step) and `collective_wait_ms`
    (the rest: its wait at the all-reduce). Where the CPU splits the steps, its own
    time is its CPU time and its wait for others' use of its CPUs (`_busy`), and the
    time every step holds besides (the all-reduce's own latency: the least over the
    workers); elsewhere, estimated: the job's shortest step is every worker's own."""
    fastest = min(w["step_ms"] for w in workers)
    common = min(w["step_ms"] - _busy(w) for w in workers) if split else 0.0
    for w in workers:
        w["compute_ms"] = _busy(w) + common if split else fastest
        w["collective_wait_ms"] = w["step_ms"] - w["compute_ms"]


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


def _per_cpu(worker):
    """`(own CPU, its wait for a CPU other processes took)` per step, per usable CPU.

    Its threads' summed wait for a CPU (`cpu_wait_ms`) holds waits for each other (a
    process's many threads on few CPUs), which do not lengthen its step beyond its CPU
    time, and waits while another process held its CPUs, which do: those are at most
    the other processes' time on its CPUs (`others_cpu_ms`), and at most its wait.
    Threads that run or wait at the same time on c CPUs hold up c streams of work, not
    more."""
    cpus = worker["cpus"] or 1
    return worker["cpu_ms"] / cpus, min(worker["others_cpu_ms"], worker["cpu_wait_ms"] / cpus)


def _splits(workers, cycle_ms):
    """Whether the CPU splits the workers' steps: every worker's CPU figures known, and
    some worker's step all its own (its CPU time, its wait for others' use of its CPUs,
    and less than the straggler threshold of the job's `cycle_ms` besides: the worker
    that joins the all-reduce last waits for no one). Where every step holds more (a
    custom loop's `next()` agreeing with the others), the CPU cannot split them."""
    keys = ("cpu_ms", "cpu_wait_ms", "others_cpu_ms")
    if not all(w[k] is not None for w in workers for k in keys):
        return False
    return min(w["step_ms"] - sum(_per_cpu(w)) for w in workers) < _least(cycle_ms)


def _least(cycle_ms, cause=None):
    """The least lateness that makes a straggler (of `cause` `step`: more, its CPU time
    per step varies more between identical workers)."""
    share = THRESHOLDS["straggler_step_share" if cause == "step" else "straggler_share"]
    return max(MIN_EXCESS_MS, share * cycle_ms)


def _busy(worker):
    """Its own time in its step: its CPU time and its wait for others' use of its CPUs,
    per usable CPU (at most its step)."""
    return min(worker["step_ms"], sum(_per_cpu(worker)))


def _lateness(worker, others, split):
    """`(excess_ms, cause, phase, part_ms)` of `worker` against the median of `others`.

    The parts: its input wait and its time between steps above theirs, and (where
    the CPU splits the steps) its CPU time and its wait for others' use of its CPUs
    above theirs. The cause is the largest part. The lateness of a host cause is its
    two host parts: its CPU work ran while it waited. Of a CPU cause, the host parts
    and its own time in its step above theirs (`_busy`), less the other CPU cause's
    part where that is above theirs too: other processes moved off its CPUs leave its
    own heavier work (benchmarks/straggler.py: a shared CPU's loss read 32-37% against
    27-29% re-measured with its CPU time 1-2 ms above the others' counted in)."""
    def above(value):
        return value(worker) - float(np.median([value(w) for w in others]))

    parts = {"input": above(lambda w: w["input_wait_ms"] or 0.0),
             "between": above(lambda w: w["between_ms"])}
    excess = parts["input"] + parts["between"]
    if split:
        parts["step"] = above(lambda w: _per_cpu(w)[0])
        parts["cpu_shared"] = above(lambda w: _per_cpu(w)[1])
    cause = max(parts, key=parts.get)
    if cause in _CPU_CAUSES:
        other = next(c for c in _CPU_CAUSES if c != cause)
        excess += max(0.0, above(_busy) - max(0.0, parts[other]))
    return excess, cause, _PHASES[cause], parts[cause]


def _straggler(workers, cycle_ms, split):
    """The straggler (its `others_wait_share` left to the caller), or None."""
    if len(workers) < 2 or cycle_ms <= 0:
        return None
    late = {w["task"]: _lateness(w, [o for o in workers if o is not w], split)
            for w in workers}
    task = max(late, key=lambda t: late[t][0])
    excess, cause, phase, part = late[task]
    # the lateness, and its cause alone: small differences of every part add up
    if min(excess, part) < _least(cycle_ms, cause):
        return None
    return {"task": task, "cause": cause, "phase": phase, "excess_ms": excess,
            "share": excess / cycle_ms, "gain": cycle_ms / max(cycle_ms - excess, 1e-9),
            "others_wait_share": None, "fix": FIXES[cause].format(task=task)}


def _cause_text(s):
    return f"{_CAUSE_WORDS[s['cause']]}: {s['excess_ms']:.1f} ms per step later than the others"


def _bound(s):
    """How far the gain holds: a late input's or host work's is at most it (a matched
    pair still waits for whichever worker is late each step), and so is a shared CPU's
    (the other processes' time on its CPUs bounds its wait: they also run while it
    idles, at the all-reduce's latency); a slow step's is about it
    (benchmarks/straggler.py: 43-46% predicted against 48-51% measured, paired)."""
    return "about" if s["cause"] == "step" else "at most"


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
        return line + ("; no straggler" if _splits(report["per_worker"], report["cycle_ms"]) else
                       "; no straggler (a slow step on one worker is not told apart: no CPU "
                       "figures split the workers' steps)")
    return (line + f"; straggler: worker {s['task']} ({_cause_text(s)}); "
            f"{_wait_text(s, 'the others')}; the job {_bound(s)} {s['gain']:.2f}x faster if it "
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
            f"{s['fix']}: the job {_bound(s)} {s['gain']:.2f}x faster if worker {s['task']} "
            "matched the others (its lateness removed)")
