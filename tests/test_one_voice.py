"""One voice: every output of one run names the same verdict (issue 21).

A table of planted runs (input-bound, periodic work in a user callback, an
eager step, a one-off stall, healthy), each run by `fit`, a
`keras.callbacks.CallbackList` loop, `kg.watch` and `keras-gpufix diagnose`.
For each run, the outputs a user reads — the monitor's final console line,
every callback's `report()`, the TensorBoard text and diagnose's verdict —
must name one verdict, the planted one; the Keras `logs` (`History`) carry
the monitor's input wait, not a verdict index (a progress bar shows numbers).

Affordable in CI: a tiny model whose step a user callback makes 8 ms long
(`StepWork`, so the host's own jitter and the fixed cost of `next()` on a
tf.data iterator stay small beside it), 130 steps a run (enough for the
default window of 96 to judge twice), and ONE diagnose subprocess that runs the five
planted fits of the table in one script (diagnose's verdict of each run is
`rank_causes` over that run's entry, as diagnose computes its top line).
"""

import gc
import glob
import json
import os
import re
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.diagnose import rank_causes
from planted import SleepEvery, StallOnce, StepWork, planted_dataset, tiny_model

STEPS = 130
HERE = os.path.dirname(os.path.abspath(__file__))


# planted verdict -> (dataset kind: "slow" sleeps 30 ms a batch, run eagerly,
# the user's callbacks listed after ours)
ROWS = {
    "input_bound": ("slow", False, lambda: []),
    "periodic_stall": ("healthy", False, lambda: [SleepEvery(6, 0.02)]),
    "eager_step": ("healthy", True, lambda: []),
    "irregular_stall": ("healthy", False, lambda: [StallOnce()]),
    "healthy": ("healthy", False, lambda: []),
}


def planted(verdict):
    """(model, dataset, the user's callbacks before ours, after ours) of one row."""
    kind, eager, after = ROWS[verdict]
    model = tiny_model()
    if eager:
        model.compile("adam", "mse", run_eagerly=True)
    return model, planted_dataset(kind, batches=STEPS, sleep=0.03), [StepWork(0.008)], after()


def fit_all_rows():
    """The script diagnose runs: one `fit` per row, the user's callbacks only."""
    for verdict in ROWS:
        model, dataset, before, after = planted(verdict)
        model.fit(dataset, epochs=1, verbose=0, callbacks=before + after)


# -- the three in-process ways to run a loop ---------------------------------

def run_fit(model, dataset, callbacks):
    return model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks).history, None


def run_callback_list(model, dataset, callbacks):
    history = keras.callbacks.History()
    hooks = keras.callbacks.CallbackList([*callbacks, history], model=model)
    hooks.on_train_begin()
    hooks.on_epoch_begin(0)
    for batch, (x, y) in enumerate(dataset):
        hooks.on_train_batch_begin(batch)
        logs = model.train_on_batch(x, y, return_dict=True)
        hooks.on_train_batch_end(batch, logs)
    hooks.on_epoch_end(0, {})
    hooks.on_train_end()
    return history.history, None


def run_watch(model, dataset, callbacks):
    history = keras.callbacks.History()
    with kg.watch(dataset, callbacks=[*callbacks, history], model=model) as watched:
        for x, y in watched:
            model.train_on_batch(x, y)
    return history.history, watched.report()["verdict"]


def console_verdicts(text):
    return re.findall(r"GPUOscillationMonitor: verdict (\w+);", text)


def tensorboard_verdict(folder):
    """The verdict of the last `oscillation/verdict` text (`final: <verdict>. ...`)."""
    texts = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"),
                                 recursive=True)):
        for event in tf.compat.v1.train.summary_iterator(path):
            texts += [tf.make_ndarray(v.tensor).item().decode() for v in event.summary.value
                      if v.tag == "oscillation/verdict"]
    assert texts and texts[-1].startswith("final: "), texts
    return texts[-1][len("final: "):].split(".")[0]


def _rows_and_loops():
    """Every row by `fit`; the CallbackList loop and kg.watch on the rows whose hooks
    differ most from fit's (an eager step, work between steps) in the default run,
    the other six pairs `slow` (each a 4-9 s run; CI's time)."""
    for verdict in ROWS:
        for loop, name in ((run_fit, "fit"), (run_callback_list, "CallbackList"),
                           (run_watch, "kg.watch")):
            quick = name == "fit" or verdict in ("eager_step", "periodic_stall")
            yield pytest.param(verdict, loop, id=f"{verdict}-{name}",
                               marks=() if quick else pytest.mark.slow)


@pytest.mark.parametrize("verdict, loop", list(_rows_and_loops()))
def test_every_output_of_a_run_names_its_verdict(verdict, loop, tmp_path, capsys):
    model, dataset, before, after = planted(verdict)
    monitor = kg.GPUOscillationMonitor(nvml=False, log_dir=str(tmp_path))
    ours = [monitor, kg.RetracingMonitor(verbose=0), kg.StepTimer()]
    # The garbage of the tests before (a long pytest process) collected now,
    # not as a pause of 100+ ms inside this 1 s run (a real one-off stall:
    # it read irregular_stall once in a full-suite run).
    gc.collect()
    history, watch_report = loop(model, dataset, [*before, *ours, *after])
    named = {
        "console": console_verdicts(capsys.readouterr().out),
        "report()": [cb.report()["verdict"] for cb in ours],
        "TensorBoard text": [tensorboard_verdict(str(tmp_path))],
        "kg.watch report()": [] if watch_report is None else [watch_report],
    }
    assert named["console"], "no final console line"
    assert "verdict" not in history
    if "input_wait" in history:
        # the report's figure at the epoch's end (a last record or two may come at train end)
        assert history["input_wait"][-1] == pytest.approx(monitor.report()["input_wait"],
                                                          abs=0.01)
    assert {v for vs in named.values() for v in vs} == {verdict}, named


def test_diagnose_names_the_verdict_every_output_of_each_run_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from test_one_voice import fit_all_rows\n\nfit_all_rows()\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    # diagnose's own entry point with the monitors printing (the CLI's --json
    # silences them), its result written to a file
    diagnose = ("import json, sys; from keras_gpufix.diagnose import run_diagnosis; "
                "json.dump(run_diagnosis(sys.argv[2:], log_dir=sys.argv[1], trace=False, "
                "what_if=False), open('result.json', 'w'))")
    proc = subprocess.run(
        [sys.executable, "-c", diagnose, str(tmp_path / "logs"), "python", str(script)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    console = console_verdicts(proc.stdout)
    assert len(result["fits"]) == len(ROWS) == len(console), proc.stdout[-3000:]
    for verdict, fit, line in zip(ROWS, result["fits"], console):
        folder = str(tmp_path / "logs" / f"fit_{fit['index']}")
        named = {
            "console": [line],
            "report()": [fit[key]["verdict"] for key in ("monitor", "retracing", "timer")],
            "diagnose": [rank_causes([fit], result["scan"])[0]],
            "TensorBoard text": [tensorboard_verdict(folder)],
        }
        assert {v for vs in named.values() for v in vs} == {verdict}, (verdict, named)
