"""diagnose runs the eager step's patch before it offers it (`diagnose.patched_run`):
the patch read back as `patch -p1` applies it, the script run again with it in memory
(the user's files untouched), its steps/s the fix's gain, and a patch whose script
fails is not offered.
"""

import difflib
import hashlib
import json
import os
import subprocess
import sys

import pytest

from keras_gpufix.diagnose.patched_run import apply, skip_statement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _diff(tmp_path, old, new, name="train.py"):
    patch = tmp_path / "step.patch"
    patch.write_text("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                  f"a/{name}", f"b/{name}")))
    return str(patch)


def test_the_patch_is_read_back_as_patch_p1_applies_it_and_a_stale_one_is_named(tmp_path):
    old = "".join(f"line {i}\n" for i in range(40))
    new = old.replace("line 3\n", "line 3\n@decorated\n").replace("line 30\n", "line thirty\n")
    (tmp_path / "train.py").write_text(old)
    patch = _diff(tmp_path, old, new)
    assert apply(patch, str(tmp_path)) == {str(tmp_path / "train.py"): new}
    assert (tmp_path / "train.py").read_text() == old  # in memory only
    # the file changed since the patch was written: the hunk, the file and the fix
    (tmp_path / "train.py").write_text(old.replace("line 29\n", "line 29 edited\n"))
    with pytest.raises(ValueError, match=r"step.patch:\d+: its hunk does not apply to "
                                         r"train.py at line 30 .*run diagnose again"):
        apply(patch, str(tmp_path))


def test_a_stalls_line_is_skipped_as_its_whole_statement_and_never_a_loops_header(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("for step in range(3):\n    train(step)\n    if step % 5 == 4:\n"
                      "        plot(step,\n             'spectrogram')\n")
    (path, text), = skip_statement(f"{script}:5").items()  # the call's second line
    assert path == str(script) and text == ("for step in range(3):\n    train(step)\n"
                                            "    if step % 5 == 4:\n        pass\n\n")
    assert skip_statement(f"{script}:1") is None  # the loop itself: no training left
    assert skip_statement(f"{script}:3") is None
    assert "plot(step" in script.read_text()  # in memory only


TRAINER = '''\
import json
import sys

import keras
import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
xs = rng.random((256, 16), dtype=np.float32)
data = tf.data.Dataset.from_tensor_slices((xs, xs[:, :1])).batch(16).repeat()
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.01)


def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return float(loss.numpy())


for i, (x, y) in enumerate(data.take(int(sys.argv[1]))):
    loss = train_step(x, y)
    if i % 10 == 0:
        print(json.dumps({"step": i, "loss": loss}))  # a Python float only
'''


def test_a_patch_whose_script_fails_is_not_offered_and_the_files_stay_as_they_were(tmp_path):
    # the step's copy runs and computes the same on one batch, but the script reads its
    # return as a Python float (json.dumps): with the patch (the tensor returned) the
    # script fails; diagnose ran it, says so, and offers no patch
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    digest = hashlib.sha256(script.read_bytes()).hexdigest()
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace", "--steps",
         "30", "--log-dir", "logs", "--", "python", "train.py", "40"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    fix = next(f for f in result["fixes"] if f["verdict"] == "eager_step")
    changes = result["fits"][0]["compiled_step"]["changes"]
    assert any("float(loss.numpy())" in c["code"] for c in changes), changes
    assert (tmp_path / "logs" / "step.patch").is_file()  # written, traced, checked ...
    predicted = fix["predicted"]  # ... and run: the script failed with it
    assert fix.get("patch") is None and predicted["source"] == "patched-run-failed", fix
    assert predicted["speedup"] is None
    assert "not offered" in predicted["text"] and "JSON serializable" in predicted["text"]
    assert fix["refused"].startswith("the script with the patch failed: ")  # the headline's why
    items = {i["item"]: i for i in result["own_cost"]["items"]}
    assert items["patched run"]["seconds"] > 0 and not items["patched run"]["counted"]
    # the user's files as they were: the script, and no bytecode of a patched copy
    assert hashlib.sha256(script.read_bytes()).hexdigest() == digest
    assert not (tmp_path / "__pycache__").exists()


def _diagnosed(wall_ms, others=0.1, steps=40, seed=0):
    """A diagnose result of one run as `run_pairs` reads it: one loop of `steps` steady
    steps of about `wall_ms`, beside other processes' `others` share of the CPU."""
    import numpy as np

    cycles = list(wall_ms * (1 + 0.05 * np.random.default_rng(seed).standard_normal(steps)))
    series = {"steps": [1] * steps, "input_wait_ms": [0.0] * steps, "step_ms": cycles,
              "between_ms": [0.0] * steps, "judged": [True] * steps}
    series.update({k: [None] * steps for k in ("first_step", "max_ms", "compiles", "gpu_util",
                                               "epoch", "epoch_first", "stall")})
    monitor = {"verdict": "healthy", "step_time": {"count": steps}, "series": series,
               "contention": {"others_share": others, "waited_share": 0.1, "load": 2.0,
                              "cpus": 2, "own_cpu_s": 1.0}}
    return {"command": ["python", "train.py"], "exit_code": 0,
            "stopped": {"steps_run": steps}, "environment": {"gpus": []},
            "fits": [{"monitor": monitor, "wall_s": sum(cycles) / 1000}]}


def test_reruns_alternate_as_is_and_fixed_runs_until_the_range_is_known(monkeypatch, tmp_path):
    # no process runs: each rerun's result is made here, in the order asked for (and
    # the records' environment is not read: it would start TensorFlow)
    from keras_gpufix import run_record
    from keras_gpufix.diagnose import patched_run

    monkeypatch.setattr(run_record, "_environment", lambda: {"host": "h"})

    calls = []
    walls = {"as_is": [20, 20, 20], "fixed": [10, 10, 10], "other": [19.6, 20.4, 19.8],
             "together": [9, 9, 9]}
    seconds_each = 10.0  # runs long enough that rounds stop at MAX_ROUNDS
    loads = {"as_is": [0.1, 0.1, 0.1], "fixed": [0.8, 0.12, 0.1]}  # a burner in round 1

    def fake(command, patches, steps, log_dir, cwd=None, timeout=None, sources=None):
        name = os.path.basename(log_dir).rsplit("_", 1)[0] if log_dir[-2] == "_" else \
            os.path.basename(log_dir)
        kind = {"as_is": "as_is", "patched_run": "fixed", "skipped_run": "other",
                "together_run": "together"}[name]
        r = sum(1 for c in calls if c == name)
        calls.append(name)
        return dict(_diagnosed(walls[kind][r % 3], (loads.get(kind) or [0.1] * 3)[r % 3],
                               seed=len(calls)), seconds=seconds_each)

    monkeypatch.setattr(patched_run, "run_patched", fake)
    variants = {"patched_run": (["step.patch"], None), "skipped_run": ([], {"x.py": "pass"})}
    runs, seconds = patched_run.run_pairs(_diagnosed(20), variants, 40, str(tmp_path),
                                          more=lambda ran: {"together_run": ([], {})})
    # round 1: as is first; round 2: the fixed runs first (the together run added), as is
    # last; round 3: only what is not settled yet (two rounds at least: the together
    # run, added in round 2, runs in round 3 too)
    assert calls[:3] == ["as_is", "patched_run", "skipped_run"]
    assert calls[3:7] == ["patched_run", "skipped_run", "together_run", "as_is"]
    assert "patched_run" not in calls[7:] and "together_run" in calls[7:]
    patched = runs["patched_run"]["paired"]
    # round 1's loads differed (a burner beside the fixed run): left out, named
    assert patched["known"] and patched["gain"] == pytest.approx(2.0, rel=0.05)
    assert [g["round"] for g in patched["load_gaps"]] == [1]
    assert patched["load_gaps"][0]["left_out"]
    # the skipped line gains nothing measurable in 40 steps a run: run to the last round,
    # then not known yet, with the steps that would settle it (or known: within 5% of 1)
    other = runs["skipped_run"]["paired"]
    assert other["rounds_run"] == 3 and calls.count("skipped_run") == 3
    assert other["known"] or other["settle_steps"] > 40
    assert runs["together_run"]["paired"]["gain"] == pytest.approx(20 / 9, rel=0.05)
    assert seconds == 10.0 * len(calls)
    # short runs (1 s each): an unsettled gain's rounds go on past MAX_ROUNDS while the
    # reruns so far took under CHEAP_ROUNDS_S, up to MOST_ROUNDS
    from keras_gpufix.analysis.comparison import MAX_ROUNDS, MOST_ROUNDS

    calls.clear()
    seconds_each = 1.0
    walls["other"] = [12.0, 30.0, 14.0]  # a spread that leaves the gain unsettled
    runs, seconds = patched_run.run_pairs(_diagnosed(20), {"skipped_run": ([], {})}, 40,
                                          str(tmp_path))
    other = runs["skipped_run"]["paired"]
    assert MAX_ROUNDS < other["rounds_run"] <= MOST_ROUNDS
    assert other["rounds_run"] == MOST_ROUNDS or other["known"]


def test_the_skipped_line_measures_the_stall_fix_that_names_it(monkeypatch, tmp_path):
    # a run ranked with two stall causes: the line skipped is the periodic stall's, so
    # the rerun's gain is that fix's, not the one ranked after it
    from keras_gpufix.diagnose import patched_run

    script = tmp_path / "train.py"
    script.write_text("for i in range(3):\n    plot(i)\n")
    where = f"{script}:2"
    result = dict(_diagnosed(20), fixes=[
        {"verdict": "periodic_stall", "where": [f"{where}: the plot"],
         "predicted": {"text": "cost"}},
        {"verdict": "irregular_stall", "where": [], "predicted": {"text": "cost"}}])
    result["fits"][0]["step"] = {"stall_where": where}
    paired = {"gain": 1.3, "gain_range": [1.2, 1.4], "known": True, "settle_steps": None,
              "steps_per_s": [10.0, 13.0], "rounds_run": 2, "steps": 40, "load_gaps": []}
    seen = {}

    def fake(result, variants, *args, **kwargs):
        seen.update(variants)
        return {n: {"paired": paired, "failed": None, "unfinished": None, "whole": 1.3}
                for n in variants}, 1.0

    monkeypatch.setattr(patched_run, "run_pairs", fake)
    patched_run.check_fixes(result, 40, str(tmp_path))
    assert list(seen) == ["skipped_run"]
    periodic, irregular = result["fixes"]
    assert periodic["predicted"]["source"] == "skipped-run"
    assert periodic["predicted"]["speedup"] == 1.3
    assert irregular["predicted"] == {"text": "cost"}
