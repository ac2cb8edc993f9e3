"""Every Keras backend and every Keras data source (issue 30).

The JAX cases run in one subprocess with KERAS_BACKEND=jax and TensorFlow
blocked from import (a `sys.meta_path` finder that refuses it), so they also
show that the package monitors a fit, a `kg.watch` loop, traces and writes
scalars without TensorFlow. Each case is a tiny model on the CPU:

- a `PyDataset` whose batches change length (new shapes in the second
  epoch) -> `recompiling`, with the shapes and JAX's measured compile seconds;
- a `PyDataset` (with and without worker threads) and a generator sleeping
  20 ms per batch before ~1 ms steps -> `input_bound` with its share, no NVML;
- arrays -> `healthy`; no GpufixWarning in any plain JAX fit;
- `ProfilerTrigger` writes a `jax.profiler` trace that TensorBoard's profile
  plugin lists;
- a `jax.jit` loop under `kg.watch` with a new shape each step and
  `RetracingMonitor(functions=[step])` -> `recompiling`, every compile timed;
- a Keras callback that sleeps in `on_train_batch_end` -> `sync_callbacks`
  naming it; our callbacks alone -> no such finding;
- no import of TensorFlow is even tried by those fits, `kg.watch` or
  `keras-gpufix validate` of the example config (exit 0); a config with a
  corpus (the `tf.data` builder) says in one line that it needs TensorFlow.

`keras-gpufix validate` on the TensorFlow backend runs in a second
subprocess with TensorFlow, Keras and JAX blocked (issue 41): the example is
valid, every section's wrong value is still refused with its call's own
message, and the GPUs come from NVML (a fake one) with no import tried.

The TensorFlow cases (slow PyDataset and generator) run in this process.
Run as a script, the JAX cases (or with `--validate` the validate cases)
print their results as one JSON line.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import types
import warnings

import numpy as np
import pytest

SLEEP_S = 0.02
BATCHES = 16
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "tts.yaml")


def _slow_sources(keras):
    class SlowPyDataset(keras.utils.PyDataset):
        def __len__(self):
            return BATCHES

        def __getitem__(self, i):
            time.sleep(SLEEP_S)
            return np.zeros((4, 8), "float32"), np.zeros((4, 1), "float32")

    def slow_generator():
        while True:
            time.sleep(SLEEP_S)
            yield np.zeros((4, 8), "float32"), np.zeros((4, 1), "float32")

    return SlowPyDataset, slow_generator


def _dense(keras):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _verdict(kg, model, data, **fit):
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)
    model.fit(data, epochs=1, verbose=0, callbacks=[monitor], **fit)
    report = monitor.report()
    return {"verdict": report["verdict"], "cost_share": report["cost_share"],
            "fix": report["fix"]}


# -- the JAX subprocess -------------------------------------------------------

class _Blocked:
    """A meta-path finder whose modules (`names` and their submodules) fail
    to import as if they were not installed (ModuleNotFoundError), and that
    keeps each import tried and the package's line that tried it (where it
    tried from our code) in `imported`. Finding one without importing it
    (`importlib.util.find_spec`, as `validate` reads Keras's source) works."""

    def __init__(self, names):
        self.names, self.imported = names, []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.names:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import traceback

        ours = [f"{os.path.basename(f.filename)}:{f.lineno}" for f in traceback.extract_stack()
                if f"{os.sep}keras_gpufix{os.sep}" in f.filename]
        self.imported.append([module.__name__, ours[-1:]])
        raise ModuleNotFoundError(f"No module named {module.__name__!r} (blocked by the test)",
                                  name=module.__name__)


def _jax_cases(log_dir):
    finder = _Blocked(("tensorflow",))
    sys.meta_path.insert(0, finder)
    import keras

    import keras_gpufix as kg

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kg.GpufixWarning)
        out = _jax_fits(keras, kg, log_dir, finder)
    out["gpufix_warnings"] = [str(w.message) for w in caught
                              if issubclass(w.category, kg.GpufixWarning)]
    out["validate_corpus"] = _validate(log_dir, "data: {corpus: .}\n")  # asks for tf.data
    return out


def _validate(folder, text):
    """`keras-gpufix validate` of a config `text` written in `folder`:
    `[exit code, what it printed]`."""
    from keras_gpufix.cli import main

    path = os.path.join(folder, "cfg.yaml")
    with open(path, "w") as f:
        f.write(text)
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        return [main(["validate", path]), said.getvalue()]


def _jax_fits(keras, kg, log_dir, finder):
    out = {}

    class VariableLength(keras.utils.PyDataset):
        """Two lengths per epoch, two new ones each epoch (Keras ends an epoch of
        the PyDataset before training too)."""

        epoch = 0

        def __len__(self):
            return 10

        def __getitem__(self, i):
            t = (8, 12)[i % 2] + 8 * self.epoch
            return np.zeros((4, t, 4), "float32"), np.zeros((4, 1), "float32")

        def on_epoch_end(self):
            self.epoch += 1

    model = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    monitor = kg.GPUOscillationMonitor(verbose=0)
    retracing = kg.RetracingMonitor(warn=False, verbose=0)
    model.fit(VariableLength(), epochs=2, verbose=0, callbacks=[monitor, retracing])
    report, counted = monitor.report(), retracing.report()
    out["variable_length"] = {
        "verdict": report["verdict"], "fix": report["fix"], "shapes": counted["shapes"],
        "recompile_ms": counted["recompile_ms"],
        "measured_compile_s": [e["compile_s"] for e in counted["shape_events"]]}

    slow_pydataset, slow_generator = _slow_sources(keras)
    out["slow_pydataset"] = _verdict(kg, _dense(keras), slow_pydataset())
    # a short queue: a long one fills while the step compiles and hides the wait
    out["slow_pydataset_workers"] = _verdict(kg, _dense(keras),
                                             slow_pydataset(workers=2, max_queue_size=2))
    out["slow_generator"] = _verdict(kg, _dense(keras), slow_generator(),
                                     steps_per_epoch=BATCHES)
    x, y = np.zeros((256, 8), "float32"), np.zeros((256, 1), "float32")
    out["arrays"] = _verdict(kg, _dense(keras), x, y=y, batch_size=8)

    class SleepsAtBatchEnd(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.005)

    # Steps of a few ms: what dispatch being off costs is at most the step.
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512),
                              keras.layers.Dense(512), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((64 * 40, 64), "float32"), np.zeros((64 * 40, 1), "float32")
    blocked = kg.GPUOscillationMonitor(verbose=0)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0,
              callbacks=[SleepsAtBatchEnd(), blocked])
    ours = [kg.GPUOscillationMonitor(verbose=0, log_dir=log_dir), kg.StepTimer(),
            kg.RetracingMonitor(verbose=0),
            kg.ProfilerTrigger(log_dir, trigger=4, steps=3, analyze=False, verbose=0)]
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=ours)
    out["plain_batch_end_callback"] = {k: blocked.report()[k] for k in ("verdict", "fix")}
    out["ours_only"] = {"verdict": ours[0].report()["verdict"],
                        "blockers": ours[0].stream.facts.async_blockers}
    out["traces"] = [t["path"] for t in ours[3].report()["traces"]]

    import jax

    step = jax.jit(lambda w, b: w - 0.01 * (b[0].sum() + w))
    w = jax.numpy.zeros(())
    batches = [(np.ones((4, 8), "float32"),)] * 24
    watch = kg.StepTimer()
    with kg.watch(batches, callbacks=[watch]) as watched:
        for batch in watched:
            w = step(w, batch)
    out["watch_steps"] = watch.report()["step_time"]["count"]

    @jax.jit
    def shaped_step(w, x):
        return w - 0.01 * x.mean()

    counted = kg.RetracingMonitor(functions=[shaped_step], warn=False, verbose=0)
    with kg.watch([np.ones((4, 8 + i), "float32") for i in range(24)],
                  callbacks=[kg.GPUOscillationMonitor(verbose=0), counted]) as watched:
        for x in watched:
            w = shaped_step(w, x)
    report = counted.report()
    out["watch_new_shapes"] = {
        "verdict": report["verdict"], "compiled": report["compiled"],
        "shapes": report["new_shapes"],
        "measured": sum(1 for e in report["shape_events"] if e["compile_s"])}

    # Without TensorFlow the GPUs come from NVML (two fake H100s, the second visible)
    sys.modules["pynvml"] = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: f"Fake H100 {h}".encode(),
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0))
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    from keras_gpufix.compile.hardware import auto_policy

    out["gpus"] = kg.compile.device_info()["gpus"]
    out["auto_policy"] = list(auto_policy())
    del sys.modules["pynvml"]
    out["tensorflow_imported"] = list(finder.imported)  # by the fits, kg.watch, device_info
    try:  # the TensorFlow-only calls: tried, and refused
        kg.compile_model(_dense(keras), "sgd", "mse")
    except RuntimeError as exc:
        out["compile_model_error"] = str(exc)
    try:
        kg.setup_strategy()
    except RuntimeError as exc:
        out["setup_strategy_error"] = str(exc)
    out["global_batch_size"] = kg.global_batch_size(8)  # no keras.distribution: one device
    tried = len(finder.imported)
    out["validate"] = _validate(log_dir, open(EXAMPLE).read())
    out["tensorflow_imported"] += finder.imported[tried:]
    return out


@pytest.fixture(scope="module")
def jax_cases(tmp_path_factory):
    pytest.importorskip("jax")
    log_dir = tmp_path_factory.mktemp("jax_logs")
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=os.getcwd(), TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, __file__, str(log_dir)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), log_dir


def test_jax_variable_length_pydataset_is_recompiling_with_shapes_and_compile_seconds(
        jax_cases):
    case = jax_cases[0]["variable_length"]
    assert case["verdict"] == "recompiling", case
    assert "bucket" in case["fix"]
    assert len(case["shapes"]) == 4 and all(len(s) == 2 and s[1] == [4, 1]
                                            for s in case["shapes"])
    assert all(s is not None and s > 0 for s in case["measured_compile_s"])  # jax.monitoring
    assert case["recompile_ms"] > 0


@pytest.mark.parametrize("source", ["slow_pydataset", "slow_pydataset_workers",
                                    "slow_generator"])
def test_jax_slow_python_source_is_input_bound_without_nvml(jax_cases, source):
    case = jax_cases[0][source]
    assert case["verdict"] == "input_bound", case
    assert case["cost_share"] >= 0.5  # 20 ms of input before ~1 ms steps
    assert ("PyDataset with workers" if source == "slow_generator"
            else "give it workers") in case["fix"]


def test_jax_healthy_fit_and_no_gpufix_warning_without_tensorflow(jax_cases):
    out = jax_cases[0]
    assert out["arrays"]["verdict"] == "healthy", out["arrays"]
    assert out["gpufix_warnings"] == []
    assert out["tensorflow_imported"] == []  # fits, kg.watch, validate: never tried
    assert out["watch_steps"] == 24


def test_jax_without_tensorflow_precision_batch_and_the_tensorflow_only_calls_say_why(
        jax_cases):
    out = jax_cases[0]
    assert out["gpus"] == [{"name": "Fake H100 1", "compute_capability": [9, 0]}]
    assert out["auto_policy"][0] == "mixed_bfloat16" and "9.0" in out["auto_policy"][1]
    error = out.get("compile_model_error", "")
    assert "TensorFlow backend only" in error and "the jax backend" in error
    assert "enable_mixed_precision('auto')" in error
    assert "keras.distribution.DataParallel()" in out.get("setup_strategy_error", "")
    assert out["global_batch_size"] == 8
    code, said = out["validate"]  # no TensorFlow needed (issue 41)
    assert code == 0 and said.endswith("cfg.yaml: valid\n"), said
    code, said = out["validate_corpus"]  # the tf.data builder: one line, not a traceback
    assert code == 2 and said.startswith("keras-gpufix validate: needs TensorFlow"), said
    assert "data.corpus" in said and "pip install tensorflow" in said
    assert "Traceback" not in said


def test_jax_jit_loop_under_watch_with_new_shapes_is_recompiling_not_eager(jax_cases):
    case = jax_cases[0]["watch_new_shapes"]
    assert case["compiled"] is True and case["verdict"] == "recompiling", case
    assert case["shapes"] == 24 and case["measured"] == 24  # every compile timed by jax


def test_jax_plain_batch_end_callback_is_named_ours_alone_are_not(jax_cases):
    out = jax_cases[0]
    found = out["plain_batch_end_callback"]
    assert found["verdict"] == "sync_callbacks", found
    assert found["fix"].startswith("SleepsAtBatchEnd")
    assert "async_safe = True" in found["fix"]
    assert out["ours_only"]["verdict"] != "sync_callbacks"


def test_jax_trace_and_scalars_without_tensorflow_are_listed_by_tensorboard(jax_cases):
    out, log_dir = jax_cases
    assert len(out["traces"]) == 1 and os.listdir(out["traces"][0])
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "keras_gpufix"), size_guidance={"tensors": 0}).Reload()
    tags = events.Tags()["tensors"]
    assert "oscillation/cycle_ms" in tags and "oscillation/verdict" in tags
    plugin = pytest.importorskip("xprof.profile_plugin")
    import argparse

    from tensorboard.plugins import base_plugin

    context = base_plugin.TBContext(logdir=str(log_dir), data_provider=None,
                                    flags=argparse.Namespace(master_tpu_unsecure_channel=""))
    runs = list(plugin.ProfilePlugin(context).generate_runs())
    assert os.path.basename(out["traces"][0]) in runs


# -- validate on the TensorFlow backend, in a subprocess ------------------------

WRONG = """\
data:
  audio: {n_mels: -1}
  text: {unknown: keep}
build: {batch_size: 0}
compile: {jit_compile: maybe, mixed_precision: mixed_bfloat16}
strategy: {mode: sharded}
callbacks:
  GPUOscillationMonitor: {window: 4}
  ProfilerTrigger: {log_dir: logs, steps: 0}
  StepTimer: {warmup: -1}
  RetracingMonitor: {max_new_shapes: 0}
fit: {epochs: 0, epocs: 1}
"""
WRONG_KEYS = ["data.audio.n_mels", "data.text.unknown", "build.batch_size", "compile.jit_compile",
              "compile.mixed_precision", "strategy.mode", "callbacks.GPUOscillationMonitor.window",
              "callbacks.ProfilerTrigger.steps", "callbacks.StepTimer.warmup",
              "callbacks.RetracingMonitor.max_new_shapes", "fit.epochs", "fit.epocs"]


def _validate_cases(folder):
    finder = _Blocked(("tensorflow", "keras", "jax"))
    sys.meta_path.insert(0, finder)
    sys.modules["pynvml"] = types.SimpleNamespace(  # one GPU without fast bfloat16
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: "Fake V100",
        nvmlDeviceGetCudaComputeCapability=lambda h: (7, 0))
    out = {"example": _validate(folder, open(EXAMPLE).read()), "wrong": _validate(folder, WRONG)}
    out["imported"] = finder.imported
    return out


def test_validate_on_tensorflow_imports_neither_tensorflow_nor_keras_and_still_judges(
        tmp_path):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=os.getcwd())
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = subprocess.run([sys.executable, __file__, "--validate", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["imported"] == []
    assert out["example"] == [0, f"{tmp_path / 'cfg.yaml'}: valid\n"]
    code, said = out["wrong"]
    assert code == 1 and f"{len(WRONG_KEYS)} problem(s)" in said, said
    for key in WRONG_KEYS:
        assert f"`{key}`" in said, key
    assert "`window` must be >= 8" in said and "Fake V100, compute capability 7.0" in said


# -- TensorFlow, in this process ------------------------------------------------

def test_a_backend_without_profiler_or_compile_counts_says_so_in_one_line(tmp_path):
    from keras_gpufix.backends import Backend, NotSupported, current

    assert current().name == "tensorflow" and current().tensorflow_step
    torch = Backend("torch")
    assert torch.async_callbacks and not torch.tensorflow_step
    assert torch.compile_log() is None
    with pytest.raises(NotSupported, match="a profiler trace is not supported on the Keras "
                                           "torch backend"):
        torch.start_trace(tmp_path)
    writer = torch.scalar_writer(str(tmp_path))  # scalars need only the tensorboard package
    writer.write("t/x", 1.0, 0, "a description")
    writer.close()
    assert any(f.startswith("events.out.tfevents.") for f in os.listdir(tmp_path))


def test_compile_log_checks_at_start_that_jax_reports_compiles(monkeypatch):
    pytest.importorskip("jax")
    from keras_gpufix.backends import jax_backend

    log = jax_backend.CompileLog()
    assert log.working and log.note is None
    assert any(e[2] for e in log.since(0.0))  # the test compile's XLA compile, timed
    monkeypatch.setattr(jax_backend, "BACKEND_COMPILE", "/jax/core/compile/renamed")
    missing = jax_backend.CompileLog()
    assert not missing.working
    assert "/jax/core/compile/renamed" in missing.note and "not counted" in missing.note


@pytest.mark.parametrize("source", ["pydataset", "generator"])
def test_tensorflow_slow_python_source_is_input_bound_without_nvml(source):
    import keras

    import keras_gpufix as kg

    slow_pydataset, slow_generator = _slow_sources(keras)
    if source == "pydataset":
        case = _verdict(kg, _dense(keras), slow_pydataset())
    else:
        case = _verdict(kg, _dense(keras), slow_generator(), steps_per_epoch=BATCHES)
    assert case["verdict"] == "input_bound", case
    assert case["cost_share"] >= 0.5
    assert ("give it workers" if source == "pydataset" else "PyDataset with workers") in case["fix"]


if __name__ == "__main__":
    print(json.dumps(_validate_cases(sys.argv[2]) if sys.argv[1] == "--validate"
                     else _jax_cases(sys.argv[1])))
