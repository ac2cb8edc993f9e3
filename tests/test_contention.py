"""Load beside a run is measured and named (issue 47, item 3): `cpu_load.sample()` and
`analysis.cpu_contention`; the same script quiet and beside CPU burners gives the same
verdict, or its report names the contention."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from keras_gpufix import cpu_load
from keras_gpufix.analysis import contention_text, cpu_contention


def _sample(wall, own, busy, total, delays, load=1.0):
    return {"wall_s": wall, "own_cpu_s": own, "busy_s": busy, "total_s": total,
            "run_delay_s": delays, "load": load, "cpus": 2, "machine_cpus": 2}


def test_other_processes_share_is_the_busy_time_less_the_runs_own():
    # 10 s on 2 CPUs (20 CPU-s): 16 s busy, 4 of them the run's own: others used 60%
    start = _sample(100.0, 1.0, 500.0, 1000.0, {"1": 0.5, "2": 0.0})
    end = _sample(110.0, 5.0, 516.0, 1020.0, {"1": 2.5, "2": 1.0, "3": 0.5}, load=3.2)
    c = cpu_contention(start, end)
    assert c["others_share"] == pytest.approx(0.6)
    assert c["waited_share"] == pytest.approx((2.0 + 1.0 + 0.5) / 10)  # a new thread counts whole
    assert c["contended"] and c["own_cpu_s"] == pytest.approx(4.0)
    text = contention_text(c, "input_bound")
    assert text.startswith("other processes used 60% of the CPU during the run (load 3.2 on 2 ")
    assert "the input pipeline competes with them" in text and "0.3 s for a CPU" in text
    # a quiet machine: the run used what was busy
    quiet = cpu_contention(start, _sample(110.0, 5.0, 505.0, 1020.0, {"1": 0.6}))
    assert quiet["others_share"] == pytest.approx(0.05) and not quiet["contended"]
    assert contention_text(quiet, "input_bound") is None
    # without /proc/stat (macOS): the load beside the run's own use, per CPU
    rough = cpu_contention(_sample(0.0, 0.0, None, None, None),
                           _sample(10.0, 10.0, None, None, None, load=2.0))
    assert rough["others_share"] == pytest.approx(0.5) and rough["waited_share"] is None
    assert cpu_contention(None, start) is None and cpu_contention(start, start) is None
    # pinned to one CPU of the two (taskset): others' share of that CPU, beside the machine's
    pinned = cpu_contention({**start, "mine_busy_s": 200.0, "mine_total_s": 500.0},
                            {**end, "mine_busy_s": 209.0, "mine_total_s": 510.0})
    assert pinned["others_mine_share"] == pytest.approx(0.5)  # 9 s busy, 4 of them its own
    assert pinned["others_share"] == pytest.approx(0.6) and c["others_mine_share"] is None


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc")
def test_a_sample_reads_the_machine_and_this_process():
    start = cpu_load.sample()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # 0.2 s of this process's CPU
        pass
    c = cpu_contention(start, cpu_load.sample())
    assert c["own_cpu_s"] >= 0.2 and 0.0 <= c["others_share"] <= 1.0
    assert 0.0 <= c["others_mine_share"] <= 1.0
    assert c["waited_share"] is not None and c["waited_share"] >= 0.0


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import keras_gpufix as kg
    from keras_gpufix.analysis import headline
    from keras_gpufix.run_record import RunRecord

    def batches(n):  # the input: 12 ms of Python work a batch, on the host's CPU
        for _ in range(n):
            deadline = time.process_time() + 0.012
            while time.process_time() < deadline:
                pass
            yield np.zeros((4, 2), np.float32)

    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    with kg.watch(batches(120), callbacks=[monitor]) as watched:
        for _ in watched:
            time.sleep(0.01)  # the step: a device's time, no CPU
    record = RunRecord.from_monitor(watched.report()).data
    print(json.dumps({"verdict": record["verdict"]["verdict"],
                      "contention": record["contention"], "headline": headline(record)}))
""")


def _run(tmp_path):
    script = tmp_path / "contended.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, KERAS_BACKEND="jax"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two runs of the script (about 3 s each), one beside CPU burners
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc")
def test_the_same_script_quiet_and_beside_cpu_burners_same_verdict_or_contention_named(
        tmp_path):
    quiet = _run(tmp_path)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(max(2, len(os.sched_getaffinity(0))))]
    try:
        loaded = _run(tmp_path)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print("quiet:", quiet["verdict"], quiet["contention"])
    print("beside burners:", loaded["verdict"], loaded["contention"])
    assert loaded["contention"]["contended"]  # the burners were seen
    assert loaded["contention"]["others_share"] > quiet["contention"]["others_share"]
    named = loaded["headline"][1].startswith("load:    other processes used")
    assert named  # a contended run says so, on a line of its own under the verdict
    assert loaded["verdict"] == quiet["verdict"] or named
