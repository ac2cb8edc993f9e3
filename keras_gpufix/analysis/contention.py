"""Load beside a run, judged: how much of the CPU other processes took while it ran.

A run shares its machine: on a 2-core host another job can take the cores its
input pipeline needs, and the same script then looks input-bound one time and
healthy, or stalled, the next. `cpu_contention(start, end)` takes two
`keras_gpufix.cpu_load.sample()`s (the run's start and end) and says what
other processes used:

- `others_share`: the machine's CPU time spent by other processes over the
  run (all CPUs' busy time less this process's, over all CPUs' time), from
  `/proc/stat`; elsewhere, the load average less this process's own use, per
  CPU (a rougher figure);
- `others_mine_share`: the same over the CPUs the run may use (its
  affinity); where it may use every CPU, `others_share`;
- `waited_share`: the time this process's threads waited, runnable, for a CPU
  (`schedstat`), per second of the run (threads that ended before the end
  are not counted: a lower bound);
- `contended`: `others_share >= CONTENTION_SHARE`: the run's figures were
  taken beside other work, and `contention_text` says so in one sentence,
  naming what competes (the input pipeline for an input-bound run). The
  threads' wait alone does not make it: on 2 cores the run's own input
  threads and its step wait for each other.

Imports neither TensorFlow nor Keras.
"""

__all__ = ["CONTENTION_SHARE", "CONTENTION_WAIT", "cpu_contention", "contention_text"]

#: Other processes' share of the machine's CPU over the run from which it is named.
CONTENTION_SHARE = 0.25
#: The run's threads' wait for a CPU, per second of the run, from which it is said.
CONTENTION_WAIT = 0.25
#: What competes with other processes, by the run's verdict.
_COMPETES = {"input_bound": "the input pipeline competes with them",
             "recompiling": "the compiles compete with them"}


def cpu_contention(start: dict, end: dict) -> "dict | None":
    """Other processes' use of the CPU between two samples (`cpu_load.sample()`).

    Returns:
        A dict `others_share` (None when it could not be measured),
        `others_mine_share` (likewise, over the CPUs it may use),
        `waited_share` (None likewise), `load` (the 1-minute load average
        at the end), `cpus` (this process's usable CPUs), `wall_s`,
        `own_cpu_s`, `contended`; None when the samples are missing or
        span no time.
    """
    if not start or not end:
        return None
    wall = end["wall_s"] - start["wall_s"]
    if wall <= 0:
        return None
    own = max(0.0, end["own_cpu_s"] - start["own_cpu_s"])
    others = _others(start, end, own, "busy_s", "total_s")
    if others is None and end.get("load") is not None and end.get("machine_cpus"):
        others = min(1.0, max(0.0, end["load"] - own / wall) / end["machine_cpus"])
    mine = _others(start, end, own, "mine_busy_s", "mine_total_s")
    waited = None
    before, after = start.get("run_delay_s"), end.get("run_delay_s")
    if before is not None and after is not None:
        waited = sum(max(0.0, d - before.get(t, 0.0)) for t, d in after.items()) / wall
    contended = others is not None and others >= CONTENTION_SHARE
    return {"others_share": others, "others_mine_share": mine, "waited_share": waited,
            "load": end.get("load"),
            "cpus": end.get("cpus"), "wall_s": wall, "own_cpu_s": own,
            "contended": contended}


def _others(start, end, own, busy, total):
    """Other processes' share of the CPUs whose busy and total time the samples hold at
    `busy`, `total` (`own`: this process's CPU time meanwhile), or None."""
    if start.get(total) is None or end.get(total) is None:
        return None
    spanned = end[total] - start[total]
    if spanned <= 0:
        return None
    return min(1.0, max(0.0, (end[busy] - start[busy] - own) / spanned))


def contention_text(contention, verdict=None) -> "str | None":
    """The sentence a contended run's report says, or None when it was not contended:
    `other processes used 60% of the CPU during the run (load 3.1 on 2 CPUs); the input
    pipeline competes with them: a quiet run can differ`."""
    if not contention or not contention.get("contended"):
        return None
    others, waited = contention.get("others_share"), contention.get("waited_share")
    load = contention.get("load")
    words = (f"other processes used {others:.0%} of the CPU during the run" if others is not None
             else "other processes took the CPU during the run")
    if load is not None and contention.get("cpus"):
        words += f" (load {load:.1f} on {contention['cpus']} CPUs)"
    if waited is not None and waited >= CONTENTION_WAIT:
        words += f"; its threads waited {waited:.1f} s for a CPU per second"
    # at most 185 characters: the headline's load line stays under 200
    return (f"{words}; {_COMPETES.get(verdict, 'the steps and the input compete with them')}"
            ": a quiet run can differ")
