"""diagnose's what-if keeps the time budget it states, and says when it was cut short.

A fit whose step is slow (a layer that sleeps inside the step, so the
replayed `train_function` is slow too) is diagnosed with a small budget; a
signal during the what-if is reported as stopping the what-if, not training.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from keras_gpufix.analysis.what_if import (BUDGET_S, BUDGET_SHARE, Cycles, block_timings,
                                           what_if_budget, what_if_until_known)
from keras_gpufix.diagnose.report import format_report
from keras_gpufix.diagnose.what_if import Budget, input_rate, replay_rates

SLOW_STEP = """\
import os
import signal
import time
import numpy as np
import tensorflow as tf
import keras

STEP_S = float(os.environ.get("STEP_S", "0.4"))
trained = []  # set once training ended: the what-if's replayed steps come after


class Slow(keras.layers.Layer):
    # a step of STEP_S seconds, inside the train function (its replay is slow too)

    def call(self, x):
        def sleep():
            if trained and os.environ.get("KILL_IN_WHAT_IF"):
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(STEP_S)
            return np.float32(0)

        done = tf.numpy_function(sleep, [], tf.float32)
        done.set_shape(())
        return x + 0.0 * done


class Ended(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        trained.append(True)


xs = np.random.rand(96, 8).astype("float32")
ys = np.random.rand(96, 1).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(8).prefetch(2)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), Slow(),
                          keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(ds, epochs=1, steps_per_epoch=int(os.environ.get("STEPS", "10")), verbose=0,
          callbacks=[Ended()])
print("slow step script done")
"""


LOOP_KILLED_IN_WHAT_IF = """\
import os
import signal
import time
import numpy as np
import tensorflow as tf
import keras

trained = []


def sleep():
    if trained:  # a step replayed by the what-if, after the loop ended
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.02)
    return np.float32(0)


xs = np.random.rand(96, 8).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, xs[:, :1])).batch(8).prefetch(2)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.Adam()


@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2) + 0.0 * tf.numpy_function(sleep, [], tf.float32)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for x, y in ds:
    step(x, y)
trained.append(True)
"""


def _diagnose(tmp_path, *options, env=None, source=SLOW_STEP):
    script = tmp_path / "train.py"
    script.write_text(source)
    cmd = [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
           "--log-dir", str(tmp_path / "logs"), *options, "--", "python", str(script)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {})))
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1]), time.monotonic() - t0


def test_the_budget_is_a_minute_or_a_share_of_the_run_and_a_block_shrinks_to_fit():
    assert what_if_budget(10.0) == BUDGET_S
    assert what_if_budget(100 * BUDGET_S) == pytest.approx(100 * BUDGET_S * BUDGET_SHARE)
    assert what_if_budget(10_000.0, given=5) == 5.0
    assert block_timings(0.002, 0.375) == (4, 46)  # a fast step: four timings of 46 calls
    assert block_timings(0.4, 1.0) == (2, 1)  # two calls fit: two timings of one
    assert block_timings(5.0, 0.375) == (0, 0)  # a multi-second step: its sizing call only


class _Clock:
    """A budget whose time is what the test says it is."""

    def __init__(self, seconds, spent=0.0):
        self.seconds, self.now, self.cut = seconds, spent, None

    def spent(self):
        return self.now

    def left(self):
        return max(0.0, self.seconds - self.now)

    def stop(self):
        self.cut = self.cut or f"budget reached after {self.now:.0f} s"


def _cycles():
    cycles = Cycles(skip=0)
    for _ in range(20):
        cycles.add(0.02, 0.0, 0.02)
    return cycles


def test_a_what_if_with_no_room_for_another_measurement_says_the_budget_stopped_it():
    budget = _Clock(60.0)
    disagree = {"cached": [[50.0]] * 4, "real": [[33.3]] * 2 + [[10.0], [48.0]]}

    def measure():  # 40 s a measurement: a second would not fit in 60 s
        budget.now += 40.0
        return disagree

    result = what_if_until_known(_cycles(), 100.0, measure, budget=budget)
    assert result["repeats"] == 1 and result["known"] is False
    assert (result["budget_s"], result["spent_s"]) == (60.0, 40.0)
    assert result["cut_short"] == "budget reached after 40 s"
    # the same measurement, with room for three: measured three times, no cut
    budget = _Clock(600.0)
    result = what_if_until_known(_cycles(), 100.0, measure, budget=budget)
    assert result["repeats"] == 3 and result["cut_short"] is None


def test_a_measurement_cut_short_keeps_its_figures_and_does_not_know():
    budget = _Clock(60.0, spent=61.0)
    budget.stop()  # the replay stopped after one pair of blocks
    result = what_if_until_known(_cycles(), 100.0,
                                 lambda: {"cached": [[50.0]], "real": [[40.0]]}, budget=budget)
    assert result["speedup_if_input_free"] == pytest.approx(1.25, rel=0.01)
    assert result["known"] is False and result["cut_short"] == "budget reached after 61 s"
    # cut before its first block: the step as measured in the run
    result = what_if_until_known(_cycles(), 100.0, lambda: {"cached": [], "real": []},
                                 budget=budget)
    assert result["method"] == "in_run" and result["known"] is False


def test_the_input_drain_and_replay_run_only_what_their_budget_holds():
    import tensorflow as tf

    v = tf.Variable(1.0)

    def step():  # a 50 ms step
        time.sleep(0.05)
        v.assign_add(1.0)

    budget = Budget(0.6)
    rates = replay_rates(step, [v], real=lambda: step, budget=budget)
    blocks = len(rates["cached"]) + len(rates["real"])
    assert 1 <= blocks < 8 and budget.cut.startswith("budget reached after")
    assert all(len(b) >= 1 and min(b) > 0 for b in rates["cached"] + rates["real"])
    assert float(v.numpy()) == 1.0  # the state is restored
    rates = replay_rates(step, [v], real=lambda: step, seconds=0.4, rounds=2)
    assert len(rates["cached"]) == len(rates["real"]) == 4  # no budget: every block
    spent = Budget(0.0)  # nothing left: the input is not drained
    assert input_rate(tf.data.Dataset.range(8).batch(2), budget=spent) is None and spent.cut


def test_a_slow_step_what_if_ends_within_its_stated_budget_and_says_it_was_cut(tmp_path):
    proc, result, _ = _diagnose(tmp_path, "--what-if-budget", "2")
    assert proc.returncode == 0 and result["exit_code"] == 0, proc.stderr[-3000:]
    what_if = result["what_if"]
    assert what_if["budget_s"] == 2.0
    # a 0.4 s step or two past the budget at most; unbounded (--what-if-budget 1000)
    # this what-if takes 4.7 s
    assert what_if["spent_s"] < 2.0 + 1.5, what_if
    assert what_if["cut_short"].startswith("budget reached after") and not what_if["known"]
    assert what_if["step_batches_per_s"] > 0  # what it measured is kept
    line = next(x for x in format_report(result).splitlines() if x.startswith("what-if:"))
    assert "cut short, budget reached after" in line and "what-if budget 2 s" in line, line


def test_a_signal_during_the_what_if_says_the_what_if_was_stopped_not_training(tmp_path):
    proc, result, _ = _diagnose(tmp_path, env={"KILL_IN_WHAT_IF": "1", "STEP_S": "0.05"})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    ended = result["ended_by"]
    fit = result["fits"][0]
    assert ended["during"] == "what_if" and ended["steps_seen"] == fit["steps_run"] == 10
    assert ended["text"].startswith("SIGTERM stopped diagnose's what-if of fit 1 "), ended
    assert "not training: training had ended after 10 training steps" in ended["text"]
    assert fit["what_if"]["reason"].startswith("SIGTERM stopped the what-if after")
    assert fit["monitor"]["step_time"]["count"] > 0  # the run's own figures are kept


def test_a_signal_during_a_loops_what_if_says_the_what_if_was_stopped(tmp_path):
    proc, result, _ = _diagnose(tmp_path, source=LOOP_KILLED_IN_WHAT_IF)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    ended = result["ended_by"]
    assert ended["during"] == "what_if" and ended["steps_seen"] == 12, ended
    assert ended["text"].startswith("SIGTERM stopped diagnose's what-if of loop 1 "), ended
    assert result["fits"][0]["what_if"]["reason"].startswith("SIGTERM stopped the what-if")


@pytest.mark.slow
def test_a_fit_of_multi_second_steps_keeps_the_default_budget(tmp_path):
    proc, result, wall = _diagnose(tmp_path, env={"STEP_S": "3.5", "STEPS": "8"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    what_if = result["what_if"]
    assert what_if["budget_s"] == BUDGET_S
    assert what_if["spent_s"] < BUDGET_S + 2 * 3.5, what_if  # two steps past it at most
    assert what_if["step_batches_per_s"] > 0
    print(f"8 steps of 3.5 s: what-if {what_if['spent_s']:.1f} s of {BUDGET_S:.0f} s "
          f"(cut short: {what_if['cut_short']}), diagnose {wall:.0f} s in all")
