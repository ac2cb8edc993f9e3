"""`diagnose --steps N` on a loop that calls `next()` itself inside the script's own
`except Exception` (a trainer's "Training failed" handler, as MyXTTSModel's
train_main.py has around `trainer.train()`): the stop is not taken for a failure,
and the report names the `next()` line; a `for` loop still ends cleanly.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = '''\
import sys

import tensorflow as tf

ds = tf.data.Dataset.from_tensor_slices(tf.ones([64, 4])).batch(2)
w = tf.Variable(tf.ones([4, 1]))


def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x @ w)
    w.assign_sub(0.01 * tape.gradient(loss, w))
    return loss


def train_epoch(batches):
    for i in range(30):
        x = next(batches)
        step(x)


try:
    if sys.argv[1] == "next":
        train_epoch(iter(ds))
    else:
        for x in ds:
            step(x)
    print("ran on")
except Exception as e:
    print(f"ERROR - Training failed: {e!r}")
    raise
'''


def _diagnose(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
         "--no-what-if", "--steps", "8", "--", "python", str(script), mode],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def _line(text):
    return next(i for i, line in enumerate(SCRIPT.splitlines(), start=1) if text in line)


def test_a_stop_in_the_scripts_own_next_is_no_failure_of_its_except_exception(tmp_path):
    proc, result = _diagnose(tmp_path, "next")
    assert proc.returncode == 0 and result["exit_code"] == 0, proc.stderr[-2000:]
    # the script's handler never saw the stop: no "Training failed", no traceback
    assert "Training failed" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "ran on" not in proc.stdout
    assert result["ended_by"] is None
    stopped = result["stopped"]
    assert stopped["how"] == "own_next" and stopped["steps_run"] == 8
    assert stopped["where"] == f"{tmp_path / 'train.py'}:{_line('x = next(batches)')}"
    assert "past the script's `except Exception`" in stopped["text"]


@pytest.mark.slow  # the `for` loop's clean end is also test_diagnose_patterns's
def test_a_for_loop_still_ends_cleanly_and_the_script_runs_on(tmp_path):
    proc, result = _diagnose(tmp_path, "for")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ran on" in proc.stdout and "Training failed" not in proc.stdout
    assert result["stopped"]["how"] == "ran_on"
