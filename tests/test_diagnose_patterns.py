"""diagnose and kg.watch on the shapes real speech trainers take (`loop_patterns.py`).

Each test runs the pattern script in a subprocess (each imports TensorFlow): under
`keras-gpufix diagnose --json`, or with `--watch` under `kg.watch` alone.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "loop_patterns.py")


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = ROOT
    return env


def _line(text):
    with open(SCRIPT) as f:
        return next(i for i, line in enumerate(f, start=1) if text in line)


def diagnose(mode, steps, *flags, script_steps=None):
    """(process, result) of `keras-gpufix diagnose --steps STEPS -- python SCRIPT MODE`."""
    args = [] if script_steps is None else ["--steps", str(script_steps)]
    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
         "--steps", str(steps), *flags, "--", "python", SCRIPT, mode, *args],
        capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def run_script(mode, *args):
    proc = subprocess.run([sys.executable, SCRIPT, mode, *args], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_loop_over_a_distributed_dataset_is_measured_and_stopped_by_steps():
    # strategy.experimental_distribute_dataset (a one-CPU MirroredStrategy: a
    # DistributedDataset, not a tf.data one) + strategy.run in a tf.function
    proc, result = diagnose("mirrored", 14, "--no-what-if", script_steps=40)
    assert f"done mirrored" in proc.stdout  # the `for` loop ended cleanly, the script ran on
    (loop,) = result["fits"]
    assert loop["kind"] == "loop" and loop["stopped_by_diagnose"] is True
    assert loop["monitor"]["step_time"]["count"] == 14 - 5  # the monitor's warm-up drops 5
    assert [f["name"] for f in loop["step"]["functions"]] == ["distributed_step"]
    assert result["verdict"] != "unknown", result["evidence"]


@pytest.mark.slow
def test_a_loop_over_a_pydataset_is_measured_and_a_loop_never_seen_says_what_was():
    proc, result = diagnose("pydataset", 14, "--no-what-if")
    (loop,) = result["fits"]
    assert loop["stopped_by_diagnose"] is True and result["verdict"] != "unknown"
    assert loop["monitor"]["step_time"]["count"] == 14 - 5
    proc, result = diagnose("nothing", 14, "--no-what-if")
    assert result["verdict"] == "unknown" and result["fits"] == []
    text = result["evidence"][0]["text"]
    assert f"Batches (loop_patterns.py:{_line('for x, y in Batches()')}" in text.replace(
        SCRIPT, "loop_patterns.py")
    assert re.search(r"predict \(.*loop_patterns.py:\d+\): 64 calls", text)
    assert "kg.watch(batches, model=model)" in text


def test_iter_of_watch_without_with_prints_its_verdict_at_the_programs_end():
    proc = run_script("watch_iter", "--steps", "20")
    out = proc.stdout + proc.stderr
    done = out.index("done watch_iter")
    verdict = re.search(r"GPUOscillationMonitor: verdict (\w+);", out)
    assert verdict and verdict.start() > done, out[-2000:]  # at exit: the data never ran out
    assert verdict.group(1) == "periodic_stall"  # the plot every 5 steps
