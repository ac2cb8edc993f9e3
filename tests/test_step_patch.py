"""diagnose's patched copy of an eager step (`diagnose.step_patch`): changed until
tf.function runs it, checked to compute the same, written as a patch that applies.

The step is an XTTS-like trainer's: gradient accumulation over a tensor count (AutoGraph
makes it a tf.while_loop), a None accumulator set inside it, a name first set inside it
from `max()` of a tensor (AutoGraph then says "'loss' must be defined before the loop"),
`float()`/`.numpy()` reads, `self.current_step += 1`, and a `tf.print` in the loss.
"""

import contextlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from keras_gpufix.analysis.verdicts import compiled_step_fix  # noqa: E402
from keras_gpufix.diagnose.step_blockers import step_blockers  # noqa: E402
from keras_gpufix.diagnose.step_patch import make_runnable, write_patch  # noqa: E402

TRAINER = '''\
import sys

import keras
import numpy as np
import tensorflow as tf

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 1
keras.utils.set_random_seed(0)  # the same weights in every process: losses compared
rng = np.random.default_rng(0)
xs = rng.random((64, 8), dtype=np.float32)
ys = xs[:, :1] * 2.0
lengths = rng.integers(1, 50, 64).astype(np.int32)
dataset = tf.data.Dataset.from_tensor_slices((xs, ys, lengths)).batch(16)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.01)
loss_fn = keras.losses.MeanSquaredError()


def compute_loss(x, y):
    loss = loss_fn(y, model(x, training=True))
    tf.print("loss", loss, output_stream=sys.stderr)  # runs in tf.function; XLA refuses it
    return loss


class Trainer:
    def __init__(self):
        self.current_step = 0
        self.accumulation_steps = tf.constant(2)  # a tensor count: a tf.while_loop

    def train_step(self, x, y, text_lengths):
        accumulated = None
        size = tf.shape(x)[0] // self.accumulation_steps
        for step in range(self.accumulation_steps):
            micro_x = x[step * size:(step + 1) * size]
            micro_y = y[step * size:(step + 1) * size]
            text_maxlen = max(text_lengths[step * size:(step + 1) * size])
            with tf.GradientTape() as tape:
                loss = compute_loss(micro_x, micro_y)
            grads = tape.gradient(loss, model.trainable_variables)
            accumulated = grads if accumulated is None else [
                a + g for a, g in zip(accumulated, grads)]
        optimizer.apply(accumulated, model.trainable_variables)
        self.current_step += 1
        return {"loss": float(loss.numpy()), "text_maxlen": int(text_maxlen)}


trainer = Trainer()
for x, y, text_lengths in dataset.take(STEPS):
    logs = trainer.train_step(x, y, text_lengths)
print("done", trainer.current_step, "loss %.6f" % logs["loss"], flush=True)
'''


def _load(path, steps="1"):
    """Runs the script at `path` as `python path STEPS` would, in this process."""
    spec = importlib.util.spec_from_file_location(f"trainer_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [path, steps]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def _line(path, text):
    with open(path) as f:
        return next(i for i, line in enumerate(f, start=1) if text in line)


@pytest.fixture
def trainer(tmp_path):
    path = str(tmp_path / "train.py")
    with open(path, "w") as f:
        f.write(TRAINER)
    module = _load(path)
    x, y, lengths = next(iter(module.dataset))
    return path, module, (module.trainer, x, y, lengths)


def _made(module, args):
    fn = module.Trainer.train_step
    try:
        tf.function(fn).get_concrete_function(*args)
        raise AssertionError("the step traced as written")
    except Exception as exc:  # the trace's error, as compile_step has it
        static = [b for b in step_blockers(fn, exc) if b["kind"] in ("python_state",
                                                                      "host_read")]
    return make_runnable(fn, args, static=static)


def test_a_step_only_a_trace_unblocks_is_changed_until_it_runs_and_computes_the_same(trainer):
    path, module, args = trainer
    weights = [v.numpy().copy() for v in module.model.variables]
    made = _made(module, args)
    assert made["runs"], made.get("blocker")
    # each line changed, by its line: the ones a scan reads and the ones only a trace names
    changed = {(c["kind"], int(c["where"].rsplit(":", 1)[1])) for c in made["changes"]}
    for kind, code in (("host_read", "return {\"loss\": float(loss.numpy())"),
                       ("python_state", "self.current_step += 1"),
                       ("none_before_loop", "accumulated = None"),
                       ("none_before_loop", "accumulated = grads if accumulated is None"),
                       ("none_before_loop", "for step in range(self.accumulation_steps)"),
                       ("host_read", "text_maxlen = max(")):
        assert (kind, _line(path, code)) in changed, made["changes"]
    assert made["traces"] >= 3  # only tracing found the loop's blockers
    # the same result, and the user's run unchanged (weights, Python state restored)
    assert made["same"] is True, made["differs"]
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(weights, module.model.variables))
    assert module.trainer.current_step == 1
    # independently: the changed step from the same weights gives the eager loss and weights
    eager = module.Trainer.train_step(*args)
    eager_weights = [v.numpy() for v in module.model.trainable_variables]
    for v, w in zip(module.model.variables, weights):
        v.assign(w)
    patched = made["function"](*args)
    assert np.isclose(float(patched["loss"]), eager["loss"], rtol=1e-4)
    assert all(np.allclose(a, v.numpy(), rtol=1e-4, atol=1e-5)
               for a, v in zip(eager_weights, module.model.trainable_variables))
    # XLA refuses the tf.print: named at its line
    assert made["xla_function"] is None and made["xla_op"] == "StringFormat"
    assert made["xla_where"] == f"{path}:{_line(path, 'tf.print(')}"


def test_the_patch_applies_with_patch_p1_and_the_patched_script_runs(trainer, tmp_path):
    path, module, args = trainer
    made = _made(module, args)
    assert "step" in made, made.get("blocker")
    out = write_patch(made["step"], str(tmp_path / "logs"), cwd=str(tmp_path))
    with open(out) as f:
        diff = f.read()
    assert diff.startswith("--- a/train.py\n+++ b/train.py\n")
    assert "+    @tf.function\n+    def _train_step_compiled(self, x, y, text_lengths):" in diff
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "train.py")
    if shutil.which("patch"):
        subprocess.run(["patch", "-p1", "-i", out], cwd=copy, check=True, capture_output=True)
    else:  # pragma: no cover - a machine without patch(1)
        pytest.skip("no patch binary")
    losses = []
    for folder in (copy, tmp_path):  # patched, then as written; in this process (each
        # sets its own seeds): two more processes importing TensorFlow cost CI ~40 s
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            _load(str(folder / "train.py"), "3")
        done = re.search(r"^done (\d+) loss (\S+)$", printed.getvalue(), re.M)
        assert done and done.group(1) == "3", printed.getvalue()  # the moved count ran at each step
        losses.append(float(done.group(2)))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)  # the same training, compiled
    # the fix says so, naming the patch
    fix = compiled_step_fix({"function": "train_step (train.py:27)", "eager_ms": 9.0,
                             "function_ms": 3.0, "xla_ms": None, "xla_op": "StringFormat",
                             "xla_where": made["xla_where"], "best": "tf.function",
                             "best_ms": 3.0, "blockers": [], "changes": made["changes"],
                             "traces": made["traces"], "patch": out})
    assert f"`patch -p1 < {out}` from the folder diagnose ran in applies" in fix
    assert f"the {len(made['changes'])} changes below" in fix


def test_the_check_compares_the_steps_own_variables_not_the_processs(trainer):
    # another variable of the process changes while diagnose checks the copy (a thread,
    # another model): not the step's, so neither saved, compared nor put back
    path, module, args = trainer
    other = tf.Variable(0.0)
    done = threading.Event()

    def elsewhere():
        while not done.is_set():
            other.assign_add(1.0)
            time.sleep(0.001)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    try:
        made = _made(module, args)
    finally:
        done.set()
        thread.join()
    assert made["runs"] and made["same"] is True, made.get("differs") or made.get("blocker")
    assert other.numpy() > 0


HELPER = '''
def helper_reads(t):
    return t.numpy()


def step_calls_a_reader(x):
    return helper_reads(x * 2.0)


def step_draws_in_python(v, x):
    scale = np.random.uniform(0.5, 1.5)  # a Python draw: frozen at the trace
    v.assign_add(scale * tf.reduce_sum(x))
    return tf.reduce_sum(x)
'''


def test_a_change_it_cannot_make_is_named_and_a_copy_that_differs_is_not_offered(tmp_path):
    path = str(tmp_path / "helpers.py")
    with open(path, "w") as f:
        f.write("import numpy as np\nimport tensorflow as tf\n" + HELPER)
    module = _load(path)
    made = make_runnable(module.step_calls_a_reader, (tf.constant([1.0, 2.0]),))
    assert made["runs"] is False
    assert made["blocker"]["where"] == f"{path}:{_line(path, 'return t.numpy()')}"
    assert "numpy" in made["blocker"]["message"] and "calls" in made["blocker"]["message"]
    assert "not checked" in made["unchecked"]
    fix = compiled_step_fix({"function": "step (h.py:1)", "blockers": [
        {"kind": "trace_error", "where": made["blocker"]["where"], "code": "return t.numpy()",
         "message": made["blocker"]["message"]}], "changes": made["changes"],
        "traces": made["traces"], "stopped": {**made["blocker"], "unchecked": made["unchecked"]},
        "reason": "tf.function could not trace it"})
    assert f"stopped at {made['blocker']['where']} (`return t.numpy()`)" in fix
    variable = tf.Variable(0.0)
    np.random.seed(0)
    made = make_runnable(module.step_draws_in_python, (variable, tf.constant([1.0, 2.0])))
    assert made["runs"] is True and made["same"] is False
    assert "variable" in made["differs"]
    assert variable.numpy() == 0.0  # restored


GROWN = '''\
import keras
import tensorflow as tf

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.01)
micro_batches = tf.constant(2)


def step(x, y):
    accumulated = []
    size = tf.shape(x)[0] // micro_batches
    for i in range(micro_batches):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[i * size:(i + 1) * size]) - y[i * size:(i + 1) * size]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        if not accumulated:
            accumulated = list(grads)
        else:
            accumulated = [a + g for a, g in zip(accumulated, grads)]
    optimizer.apply(accumulated, model.trainable_variables)
    return loss
'''


def test_an_accumulator_whose_structure_changes_in_the_loop_starts_as_zeros(tmp_path):
    # an empty list that becomes the gradients' list in a loop over a tensor count:
    # only the trace finds it ("does not have the same nested structure"); the copy
    # starts it as the gradients' zeros and computes what the eager step computes
    path = str(tmp_path / "grown.py")
    with open(path, "w") as f:
        f.write(GROWN)
    module = _load(path)
    x, y = tf.random.normal((16, 8), seed=1), tf.random.normal((16, 1), seed=2)
    made = make_runnable(module.step, (x, y))
    assert made["runs"] and made["same"] is True, made.get("blocker") or made.get("differs")
    (change,) = made["changes"]
    assert change["where"] == f"{path}:{_line(path, 'for i in range(micro_batches)')}"
    assert ("`accumulated = [tf.zeros_like(v) for v in model.trainable_variables]` set before "
            "the loop (the trace: TypeError: 'accumulated' does not have the same nested "
            "structure") in change["change"]


PIPELINE = '''\
import time

import numpy as np
import tensorflow as tf


def read(x):
    time.sleep(0.0001)  # a file read in Python
    return x


frames = tf.data.Dataset.from_tensor_slices(np.arange(8, dtype=np.float32)).map(
    lambda x: tf.py_function(read, [x], tf.float32))
counts = tf.data.Dataset.range(8).map(lambda x: x * 2)
batches = frames.batch(4).repeat(2)
TOTAL = float(sum(float(b.numpy().sum()) for b in batches))
DOUBLED = int(sum(int(c) for c in counts))
'''


@pytest.mark.parametrize("kind, edit", [("python", ".cache()"),
                                        ("parallel", "num_parallel_calls=tf.data.AUTOTUNE")])
def test_an_input_fix_at_a_named_line_is_a_patch_that_applies_and_keeps_the_data(
        tmp_path, kind, edit):
    path = tmp_path / "pipeline.py"
    path.write_text(PIPELINE)
    line = _line(str(path), "from_tensor_slices(np.arange") if kind == "python" else _line(
        str(path), "counts = ")
    fixes = [{"verdict": "input_bound", "fix": "the fix",
              "stage": {"kind": kind, "where": f"{path}:{line}"}},
             {"verdict": "periodic_stall", "fix": "plot less often"}]
    scan = [{"trap": "no_prefetch", "file": str(path), "line": _line(str(path), "batches =")}]
    from keras_gpufix.diagnose.step_patch import input_patch

    out = input_patch(fixes, scan, str(tmp_path / "logs"), cwd=str(tmp_path))
    assert fixes[0]["patch"] == out and f"`patch -p1 < {out}`" in fixes[0]["fix"]
    assert "patch" not in fixes[1]  # a choice only the user makes: no patch
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "pipeline.py")
    subprocess.run(["patch", "-p1", "-i", out], cwd=copy, check=True, capture_output=True)
    patched = (copy / "pipeline.py").read_text()
    assert "batches = frames.batch(4).repeat(2).prefetch(tf.data.AUTOTUNE)" in patched
    if kind == "python":
        assert "lambda x: tf.py_function(read, [x], tf.float32)).cache()" in patched
    else:
        assert f"map(lambda x: x * 2, {edit})" in patched
    import runpy

    before, after = runpy.run_path(str(path)), runpy.run_path(str(copy / "pipeline.py"))
    assert (before["TOTAL"], before["DOUBLED"]) == (after["TOTAL"], after["DOUBLED"]) == (
        56.0, 56)


REPEATED = '''\
import tensorflow as tf

items = tf.data.Dataset.range(6).repeat().map(lambda x: tf.py_function(
    lambda v: v * 3, [x], tf.int64), num_parallel_calls=tf.data.AUTOTUNE).batch(4)
FIRST = [int(v) for b in items.take(5) for v in b]
pairs = tf.data.Dataset.range(6).repeat(2).batch(2).map(lambda x: x + 1)
'''


def test_a_cache_after_a_map_over_a_repeat_moves_the_repeat_after_it(tmp_path):
    # `.cache()` after an infinite stream never fills (it never serves and holds every
    # element seen): the map's own `.repeat()` goes after the cache; a repeat further up
    # (calls between it and the map) is left as written, with no cache edit
    path = tmp_path / "repeated.py"
    path.write_text(REPEATED)
    from keras_gpufix.diagnose.step_patch import input_patch

    for name, kind, has_patch in (("items = ", "cache", True), ("pairs = ", "python", False)):
        fixes = [{"verdict": "input_bound", "fix": "the fix",
                  "stage": {"kind": kind, "where": f"{path}:{_line(str(path), name)}"}}]
        out = input_patch(fixes, [], str(tmp_path / name.strip(" =")), cwd=str(tmp_path))
        assert (out is not None) is has_patch and ("patch" in fixes[0]) is has_patch
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "repeated.py")
    subprocess.run(["patch", "-p1", "-i", str(tmp_path / "items" / "input.patch")], cwd=copy,
                   check=True, capture_output=True)
    patched = (copy / "repeated.py").read_text()
    assert "items = tf.data.Dataset.range(6).map(" in patched
    assert "num_parallel_calls=tf.data.AUTOTUNE).cache().repeat().batch(4)" in patched
    import runpy

    before, after = runpy.run_path(str(path)), runpy.run_path(str(copy / "repeated.py"))
    assert before["FIRST"] == after["FIRST"] == [3 * (i % 6) for i in range(20)]


def test_a_step_whose_source_is_no_def_is_timed_as_written_with_no_patch(tmp_path):
    # a lambda (its source is a line, not a def): diagnose cannot copy it, but it traces
    # as written, so it is timed as before and says why no patch was written
    from keras_gpufix.diagnose.what_if import compile_step

    variable = tf.Variable(1.0)
    step = lambda x: variable.assign_add(tf.reduce_sum(x))  # noqa: E731
    compiled = compile_step(step, (tf.constant([1.0, 2.0]),), seconds=0.2,
                            log_dir=str(tmp_path))
    assert compiled["best_ms"] is not None and compiled["patch"] is None
    assert "cannot be read as a def" in compiled["patch_reason"]
    assert compiled["changes"] is None  # nothing checked: the fix claims no check
    assert "diagnose ran it so" not in compiled_step_fix(compiled)
    assert variable.numpy() == 1.0  # restored
    assert not os.listdir(tmp_path)


STATEFUL = '''
import tensorflow as tf


class Trainer:
    def __init__(self):
        self.last = None
        self.weight = tf.Variable(1.0)

    def step(self, x):
        loss = tf.reduce_sum(x * self.weight)
        self.weight.assign_sub(0.1 * loss)
        self.last = loss  # Python state set from a value the step computes
        return loss
'''


def test_a_step_that_traces_but_cannot_be_changed_is_timed_as_written(tmp_path):
    # its Python state reads a value the step computes: diagnose cannot move it out, but
    # the step traces as written, so it is timed as before, with the state's line named
    from keras_gpufix.diagnose.what_if import compile_step

    path = tmp_path / "stateful.py"
    path.write_text(STATEFUL)
    module = _load(str(path))
    trainer = module.Trainer()
    compiled = compile_step(module.Trainer.step, (trainer, tf.constant([1.0, 2.0])),
                            seconds=0.2, log_dir=str(tmp_path / "logs"))
    assert compiled["best_ms"] is not None and compiled["patch"] is None
    line = _line(str(path), "self.last = loss")
    assert compiled["patch_reason"].startswith(f"{path}:{line}: it sets Python state")
    fix = compiled_step_fix(compiled)
    assert f"first move the Python state it changes out of it ({path}:{line}" in fix
    assert trainer.weight.numpy() == 1.0  # restored


def test_a_cache_that_pays_only_from_the_next_run_is_written_on_disk(tmp_path, monkeypatch):
    # one pass over the data: a cache in memory serves nothing in this run (1.00x), one
    # on disk serves every later run; the patch caches on disk and says so
    path = tmp_path / "pipeline.py"
    path.write_text(PIPELINE)
    line = _line(str(path), "from_tensor_slices(np.arange")
    fixes = [{"verdict": "input_bound", "fix": "the fix",
              "stage": {"kind": "python", "where": f"{path}:{line}"},
              "predicted": {"speedup": 1.0, "whole_run": True, "speedup_later_runs": 1.6}}]
    from keras_gpufix.diagnose.step_patch import input_patch

    out = input_patch(fixes, [], str(tmp_path / "logs"), cwd=str(tmp_path))
    assert "the first run writes it" in fixes[0]["fix"]
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "pipeline.py")
    subprocess.run(["patch", "-p1", "-i", out], cwd=copy, check=True, capture_output=True)
    name = f"pipeline_{line}.tfcache"
    assert f"tf.float32)).cache({name!r})" in (copy / "pipeline.py").read_text()
    import runpy

    monkeypatch.chdir(copy)
    runs = [runpy.run_path(str(copy / "pipeline.py")) for _ in range(2)]  # writes, then reads
    assert [r["TOTAL"] for r in runs] == [56.0, 56.0]
    assert (copy / f"{name}.index").exists()
