"""What the machine's other processes take of the CPU while a run runs.

`sample()` reads, in well under a millisecond, what `analysis.cpu_contention`
compares between a run's start and its end:

- `busy_s`, `total_s`: the CPU time of every process and the time of every CPU
  (`/proc/stat`; Linux);
- `own_cpu_s`: this process's CPU time, all its threads (`time.process_time`);
- `run_delay_s`: per thread, the time it was runnable but waited for a CPU (the
  2nd field of `/proc/self/task/*/schedstat`; Linux);
- `load`: the 1-minute load average (`os.getloadavg`; Unix).

A figure that cannot be read is None; nothing here raises.
"""

import os
import time

__all__ = ["sample"]


def _proc_stat():
    """`(busy_s, total_s)` of all CPUs since boot, or `(None, None)`."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None, None
    # user nice system idle iowait irq softirq steal (guest is inside user)
    idle = sum(fields[3:5])
    total = sum(fields[:8])
    return (total - idle) / tick, total / tick


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
    busy, total = _proc_stat()
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {"wall_s": time.monotonic(), "own_cpu_s": time.process_time(), "busy_s": busy,
            "total_s": total, "run_delay_s": _run_delays(), "load": load,
            "cpus": cpus, "machine_cpus": os.cpu_count()}
