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
    items = {i["item"]: i for i in result["own_cost"]["items"]}
    assert items["patched run"]["seconds"] > 0 and not items["patched run"]["counted"]
    # the user's files as they were: the script, and no bytecode of a patched copy
    assert hashlib.sha256(script.read_bytes()).hexdigest() == digest
    assert not (tmp_path / "__pycache__").exists()
