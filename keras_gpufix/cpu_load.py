"""What the machine's other processes take of the CPU while a run runs.

`sample()` reads, in well under a millisecond, what `analysis.cpu_contention`
compares between a run's start and its end:

- `busy_s`, `total_s`: the CPU time of every process and the time of every CPU
  (`/proc/stat`; Linux);
- `mine_busy_s`, `mine_total_s`: the same over the CPUs this process may run on
  (its affinity: a worker pinned with `taskset` shares only those);
- `own_cpu_s`: this process's CPU time, all its threads (`time.process_time`);
- `run_delay_s`: per thread, the time it was runnable but waited for a CPU (the
  2nd field of `/proc/self/task/*/schedstat`; Linux);
- `load`: the 1-minute load average (`os.getloadavg`; Unix).

A figure that cannot be read is None; nothing here raises.
"""

import os
import time

__all__ = ["sample"]


def _busy_total(fields, tick):
    # user nice system idle iowait irq softirq steal (guest is inside user)
    total = sum(fields[:8])
    return (total - sum(fields[3:5])) / tick, total / tick


def _proc_stat(mine):
    """`(busy_s, total_s, mine_busy_s, mine_total_s)` since boot: of all CPUs, and of
    the CPUs in `mine` (None: unknown); None for what cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
        tick = os.sysconf("SC_CLK_TCK")
        every = _busy_total([int(v) for v in rows[0][1:]], tick)
        ours = [_busy_total([int(v) for v in row[1:]], tick) for row in rows[1:]
                if mine is not None and int(row[0][3:]) in mine]
    except (OSError, ValueError, AttributeError, IndexError):
        return None, None, None, None
    if not ours:
        return (*every, None, None)
    return (*every, sum(b for b, _ in ours), sum(t for _, t in ours))


def _run_delays():
    """`{thread id: seconds it waited runnable for a CPU}` of this process's threads, or
    None where the kernel does not keep them."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat", encoding="ascii") as f:
                out[task] = int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return out or None


def sample() -> dict:
    """The machine's CPU figures now, for `analysis.cpu_contention(start, end)`."""
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:
        mine = None
    busy, total, mine_busy, mine_total = _proc_stat(mine)
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = None
    return {"wall_s": time.monotonic(), "own_cpu_s": time.process_time(), "busy_s": busy,
            "total_s": total, "mine_busy_s": mine_busy, "mine_total_s": mine_total,
            "run_delay_s": _run_delays(), "load": load,
            "cpus": os.cpu_count() if mine is None else len(mine),
            "machine_cpus": os.cpu_count()}
