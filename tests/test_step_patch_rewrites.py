"""The rewrites diagnose's step copy makes on trainer code of MyXTTSModel's shape
(`diagnose.step_patch`), each on a synthetic pattern of its own: the copy traces, runs,
computes what the eager step computes, and its patch applies with `patch -p1`.

- a tensor-count loop (a `tf.while_loop`) whose None accumulator takes the gradients
  of variables first named inside the loop, and a dict of accumulators whose keys
  appear in it: zeros made from what is bound before the loop, every key set before it;
- a count from `tf.shape(x)[0] // k` (and `if ... == 0: k = n`), with a Python `if` on
  a tensor that adds a dict key in the loop: the shapes' numbers keep the loop a
  Python loop, and the `if` becomes `tf.where` (the key set on both paths);
- a Keras loss whose `call` (which AutoGraph does not convert: Keras calls it) has a
  Python `if` on a tensor, and a helper that makes `tf.constant` of a tensor: the
  functions the step calls are changed too, in the same patch.
"""

import importlib.util
import shutil
import subprocess

import pytest

tf = pytest.importorskip("tensorflow")

from keras_gpufix.diagnose.step_patch import make_runnable, write_patch  # noqa: E402

HEAD = '''\
import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
xs = rng.random((16, 8), dtype=np.float32)
ys = xs[:, :1] * 2.0
dataset = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(8)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.01)
'''

TENSOR_LOOP = HEAD + '''

class Trainer:
    def __init__(self):
        self.model = model
        self.accumulation_steps = tf.constant(2)  # a tensor count: a tf.while_loop

    def variables(self):
        return self.model.trainable_variables

    def train_step(self, x, y):
        accumulated = None
        totals = {}
        for step in range(self.accumulation_steps):
            current_vars = self.variables()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self.model(x[step * 4:(step + 1) * 4])
                                       - y[step * 4:(step + 1) * 4]) ** 2)
            grads = tape.gradient(loss, current_vars)
            accumulated = grads if accumulated is None else [
                a + g for a, g in zip(accumulated, grads)]
            totals["loss"] = totals.get("loss", 0.0) + loss
        optimizer.apply(accumulated, self.model.trainable_variables)
        return totals
'''

SHAPE_COUNT = HEAD + '''

class Trainer:
    def __init__(self):
        self.model = model

    def train_step(self, x, y, accumulation_steps=2):
        micro = tf.shape(x)[0] // accumulation_steps
        if micro == 0:
            micro = 1
            accumulation_steps = tf.shape(x)[0]
        accumulated = None
        totals = {}
        for step in range(accumulation_steps):
            end = min((step + 1) * micro, tf.shape(x)[0])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self.model(x[step * micro:end]) - y[step * micro:end]) ** 2)
            grads = tape.gradient(loss, self.model.trainable_variables)
            if accumulated is None:
                accumulated = list(grads)
            else:
                accumulated = [a + g for a, g in zip(accumulated, grads)]
            totals["loss"] = totals.get("loss", 0.0) + loss
            reg = tf.reduce_sum(self.model.trainable_variables[0] ** 2)
            if reg != 0.0:
                totals["reg"] = totals.get("reg", 0.0) + reg
        optimizer.apply(accumulated, self.model.trainable_variables)
        return totals
'''

KERAS_LOSS = HEAD + '''

class Loss(keras.losses.Loss):
    def __init__(self):
        super().__init__(name="xtts_like")
        self.enabled = tf.Variable(True, trainable=False)

    def safe(self, t, fallback):
        return tf.where(tf.math.is_finite(t), t, tf.constant(fallback, dtype=tf.float32))

    def weight(self):
        if not self.enabled:
            return tf.constant(1.0)
        return tf.constant(2.0)

    def call(self, y_true, y_pred):
        mse = tf.reduce_mean((y_true - y_pred) ** 2)
        return self.safe(mse, mse) * self.weight()


class Trainer:
    def __init__(self):
        self.model = model
        self.criterion = Loss()

    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.criterion(y, self.model(x))
        grads = tape.gradient(loss, self.model.trainable_variables)
        optimizer.apply(grads, self.model.trainable_variables)
        return {"loss": loss}
'''


def _load(path):
    spec = importlib.util.spec_from_file_location(f"pattern_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(source, text):
    return next(i for i, line in enumerate(source.splitlines(), start=1) if text in line)


def _made(tmp_path, source):
    path = tmp_path / "train.py"
    path.write_text(source)
    module = _load(path)
    x, y = next(iter(module.dataset))
    made = make_runnable(module.Trainer.train_step, (module.Trainer(), x, y))
    assert made["runs"], made.get("blocker")
    assert made["same"] is True, made["differs"]
    changes = {(c["kind"], int(c["where"].rpartition(":")[2])) for c in made["changes"]}
    return path, module, (x, y), made, changes


def _patched_losses(tmp_path, path, made, args):
    """The patch applied with `patch -p1` to a copy; the loss of one step of the
    copy's trainer (compiled) and of the original's (eager), from the same weights."""
    out = write_patch(made["step"], str(tmp_path / "logs"), cwd=str(tmp_path))
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "train.py")
    if not shutil.which("patch"):  # pragma: no cover - a machine without patch(1)
        pytest.skip("no patch binary")
    subprocess.run(["patch", "-p1", "-i", out], cwd=copy, check=True, capture_output=True)
    patched, original = _load(copy / "train.py"), _load(path)
    trainers = patched.Trainer(), original.Trainer()  # held: tf.function binds weakly
    got, want = (t.train_step(*args) for t in trainers)
    return (copy / "train.py").read_text(), got, want


@pytest.mark.parametrize("set_in_loop, zeros_of", [
    # what `current_vars` is set to in the loop, all its names bound before it
    ("current_vars = self.variables()", "self.variables()"),
    # it reads a name set in the loop: the attribute holding the eager tape's variables
    ("holder = self.model\n            current_vars = holder.trainable_variables",
     "self.model.trainable_variables"),
])
def test_zeros_and_keys_of_a_tensor_loop_come_from_what_is_bound_before_it(
        tmp_path, set_in_loop, zeros_of):
    source = TENSOR_LOOP.replace("current_vars = self.variables()", set_in_loop)
    path, module, args, made, changes = _made(tmp_path, source)
    # never `current_vars` itself (first set in the loop: UnboundLocalError before it)
    assert ("none_before_loop", _line(source, "accumulated = None")) in changes
    zeros = next(c for c in made["changes"] if c["code"] == "accumulated = None")
    assert f"tf.zeros_like(v) for v in {zeros_of})" in zeros["change"]
    # the dict's key that appears in the loop is set before it
    key = next(c for c in made["changes"] if "totals['loss'] = " in c["change"])
    assert key["where"].endswith(f":{_line(source, 'for step in range(')}")
    text, got, want = _patched_losses(tmp_path, path, made, args)
    assert f"for v in {zeros_of})" in text and set_in_loop in text
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)


def test_a_shape_count_keeps_a_python_loop_and_a_tensor_if_adds_its_key_on_both_paths(
        tmp_path):
    path, module, args, made, changes = _made(tmp_path, SHAPE_COUNT)
    for text in ("micro = tf.shape(x)[0]", "accumulation_steps = tf.shape(x)[0]",
                 "end = min("):
        assert ("static_shape", _line(SHAPE_COUNT, text)) in changes
    assert ("tensor_if", _line(SHAPE_COUNT, "if reg != 0.0:")) in changes
    # a Python loop: the None accumulator is left as written
    assert not any(kind == "none_before_loop" for kind, _ in changes)
    text, got, want = _patched_losses(tmp_path, path, made, args)
    assert ('totals["reg"] = tf.where(reg != 0.0, totals.get("reg", 0.0) + reg, '
            'totals.get("reg", 0.0))') in text
    assert sorted(got) == sorted(want) == ["loss", "reg"]
    for key in want:
        assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-5)


def test_functions_a_keras_loss_calls_are_changed_in_the_same_patch(tmp_path):
    path, module, args, made, changes = _made(tmp_path, KERAS_LOSS)
    assert changes == {("constant_of_tensor", _line(KERAS_LOSS, "tf.constant(fallback")),
                       ("autograph", _line(KERAS_LOSS, "def call(self"))}
    # the user's class is as it was once diagnose is done
    assert module.Loss.call.__code__.co_filename == str(path)
    text, got, want = _patched_losses(tmp_path, path, made, args)
    assert "    @tf.autograph.to_graph\n    def call(self, y_true, y_pred):" in text
    assert "tf.convert_to_tensor(fallback, dtype=tf.float32)" in text
    assert "    @tf.function\n    def train_step(self, x, y):" in text
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)


def test_the_headline_names_the_steps_def_that_the_patch_compiles():
    # the run measured the eager gradient at its tape line; the fix the user makes is
    # the patch, which compiles the step's def: the headline names the def
    from keras_gpufix.analysis.headline import headline
    from keras_gpufix.diagnose.step_patch import attach_patches

    fixes = [{"verdict": "eager_step", "fix": "wrap the step", "expected_speedup": 3.2,
              "run_speedup": 2.9, "source": "patched-run",
              "where": ["/x/trainer.py:1490: the eager gradient"]}]
    fits = [{"compiled_step": {"patch": "/x/logs/step.patch",
                               "function": "train_step_with_accumulation (/x/trainer.py:1276)"}}]
    attach_patches(fixes, fits, [], None)
    assert fixes[0]["where"] == ["/x/trainer.py:1276: the step's def, which the patch compiles",
                                 "/x/trainer.py:1490: the eager gradient"]
    lines = headline({"verdict": {"verdict": "eager_step", "cost_share": 0.7},
                      "causes": [{"verdict": "eager_step", "share": 0.7}], "fixes": fixes})
    fix = next(line for line in lines if line.startswith("fix:"))
    assert fix.startswith("fix:     compile the step at /x/trainer.py:1276: "
                          "`patch -p1 < /x/logs/step.patch`"), fix
    assert fix.endswith("3.20x the steps/s, measured with the patch applied (the whole loop "
                        "2.90x)")
    # a line that would pass 200 characters names the file alone (the evidence has its path)
    deep = "/" + "/".join(["a_long_folder_name"] * 8)
    fixes[0]["where"] = [w.replace("/x/", deep + "/") for w in fixes[0]["where"]]
    lines = headline({"verdict": {"verdict": "eager_step", "cost_share": 0.7},
                      "causes": [{"verdict": "eager_step", "share": 0.7}], "fixes": fixes})
    fix = next(line for line in lines if line.startswith("fix:"))
    assert fix.startswith("fix:     compile the step at trainer.py:1276: "), fix
    assert len(fix) <= 200
