"""compile_model / enable_mixed_precision / CompileReport on one CPU device.

Multi-replica behaviour is in tests/test_distribute.py (subprocesses).
"""

import math
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.compile import calibration, hardware
from keras_gpufix.keras_internals import traced_functions
from keras_gpufix.exceptions import GpufixWarning


@pytest.fixture(autouse=True)
def float32_policy():
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


def small_model(extra=()):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,)), *extra, keras.layers.Dense(16, activation="relu"),
         keras.layers.Dense(1)]
    )


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


class NumpyLayer(keras.layers.Layer):
    """Runs NumPy through tf.numpy_function: an op XLA cannot compile."""

    def call(self, x):
        y = tf.numpy_function(lambda a: (a * 2.0).astype("float32"), [x], tf.float32)
        return tf.ensure_shape(y, x.shape)


class CountBatchEnds(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.calls = 0

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1


# -- XLA ------------------------------------------------------------------------


def test_xla_is_read_from_the_traced_train_function():
    x, y = data()
    model = small_model()
    report = kg.compile_model(model, "adam", "mse", mixed_precision=None,
                              steps_per_execution=1, sample_batch=(x[:16], y[:16]))
    assert report.jit_compile is True and report.verified
    assert report.xla_scope == "step"
    assert report.xla_devices == ("default",)  # one _XlaMustCompile call
    assert report.fallback_reason is None
    assert model.jit_compile is True  # Keras's "auto" would say False on CPU
    assert "XLA calls" in report.reason


def test_jit_compile_false_has_no_xla_call():
    x, y = data()
    report = kg.compile_model(small_model(), "adam", "mse", jit_compile=False,
                              mixed_precision=None, steps_per_execution=1,
                              sample_batch=(x[:16], y[:16]))
    assert report.jit_compile is False and report.xla_devices == ()
    assert report.fallback_reason is None


def test_op_xla_cannot_compile_falls_back_to_graph_and_names_it():
    x, y = data()
    model = small_model([NumpyLayer(name="numpy_features")])
    with pytest.warns(GpufixWarning, match="PyFunc") as caught:
        report = kg.compile_model(model, "adam", "mse", mixed_precision=None,
                                  steps_per_execution=1, sample_batch=(x[:16], y[:16]))
    assert "numpy_features" in str(caught[0].message)
    assert caught[0].filename == __file__  # the user's line, not ours
    assert report.jit_compile is False and report.verified
    assert "PyFunc" in report.fallback_reason
    assert report.xla_devices == ()
    assert model.jit_compile is False
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_run_eagerly_cannot_use_xla_and_says_so():
    with pytest.warns(GpufixWarning, match="run_eagerly") as caught:
        report = kg.compile_model(small_model(), "adam", "mse", mixed_precision=None,
                                  steps_per_execution=1, run_eagerly=True)
    assert caught[0].filename == __file__
    assert report.jit_compile is False and "run_eagerly" in report.fallback_reason


def test_a_failing_batch_is_the_users_error_not_an_xla_fallback():
    x, y = data()
    with pytest.raises(ValueError, match="expected axis -1 of input shape to have value 8"):
        kg.compile_model(small_model(), "adam", "mse", mixed_precision=None,
                         steps_per_execution=1,
                         sample_batch=(x[:16, :5], y[:16]))  # wrong feature size


# -- sample steps and steps_per_execution -----------------------------------------


def test_sample_steps_leave_weights_optimizer_and_metrics_untouched():
    x, y = data()
    model = small_model()
    before = model.get_weights()
    kg.compile_model(model, "adam", "mse", metrics=["mae"], mixed_precision=None,
                     steps_per_execution=1, sample_batch=(x[:16], y[:16]))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(float(np.max(np.abs(v.numpy()))) == 0 for v in model.metrics_variables)


def test_steps_per_execution_auto_is_measured_and_callbacks_fire_per_execution():
    x, y = data(512)
    model = small_model()
    report = kg.compile_model(model, "adam", "mse", mixed_precision=None,
                              sample_batch=tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    cal = report.calibration
    assert {"t_1", "t_k", "k", "overhead_s", "step_s", "chosen"} <= set(cal)
    assert cal["t_k"] > 0 and cal["t_1"] > 0
    k = report.steps_per_execution
    assert k == cal["chosen"] == model.steps_per_execution
    assert k == calibration.choose_steps(cal, tf.distribute.get_strategy(), 64)
    assert cal["epoch_steps"] == 64  # the dataset's length caps it at 64 // 8
    assert 1 <= k <= 8 and k & (k - 1) == 0  # a power of two
    counter = CountBatchEnds()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[counter])
    assert counter.calls == math.ceil(64 / k)  # 64 steps, one hook per execution


def _step_traces(model):
    """Traces of Keras's one_step_on_data, the XLA-compiled train step."""
    return traced_functions(model.train_function)[
        "one_step_on_data"].experimental_get_tracing_count()


def test_fit_runs_the_measured_steps_per_execution():
    x, y = data(512)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # (None, 8) batches
    model = small_model()
    report = kg.compile_model(model, "adam", "mse", mixed_precision=None,
                              sample_batch=dataset)
    assert report.calibration["k"] == 16 != report.steps_per_execution
    assert model.steps_per_execution == report.steps_per_execution
    assert _step_traces(model) == 0  # made again for the measured value, not traced yet
    counter = CountBatchEnds()
    model.fit(dataset, epochs=2, verbose=0, callbacks=[counter])
    assert counter.calls == 2 * 64 // report.steps_per_execution  # the final k, not 16
    assert _step_traces(model) == 1
    assert int(model.optimizer.iterations.numpy()) == 128


def test_the_sample_steps_train_function_is_kept_when_its_value_is_chosen():
    x, y = data(64)
    model = small_model()
    kg.compile_model(model, "adam", "mse", mixed_precision=None,
                     steps_per_execution=4, sample_batch=(x[:8], y[:8]))
    assert _step_traces(model) == 1  # traced (and XLA-compiled) by the sample step
    counter = CountBatchEnds()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[counter])
    assert counter.calls == 2  # 8 steps, 4 per execution
    assert int(model.optimizer.iterations.numpy()) == 8
    assert _step_traces(model) == 1  # fit traced nothing more for this shape


def test_a_failed_sample_step_leaves_no_train_function():
    x, y = data()
    model = small_model()
    with pytest.raises(ValueError, match="expected axis -1 of input shape to have value 8"):
        kg.compile_model(model, "adam", "mse", mixed_precision=None,
                         steps_per_execution=1, sample_batch=(x[:16, :5], y[:16]))
    assert model.train_function is None


@pytest.mark.parametrize("overhead, step, expected", [
    (0.002, 0.0001, 64),  # dispatch-bound: needs 380 steps, capped at 64
    (0.0001, 0.001, 2),   # needs 1.9 steps -> 2
    (0.0, 0.001, 1),      # no overhead
    (0.05, 0.4, 2),       # long steps: at most ~1 s per execution
])
def test_choose_steps_rule(overhead, step, expected):
    measured = {"overhead_s": overhead, "step_s": step}
    assert calibration.choose_steps(measured, tf.distribute.get_strategy()) == expected


@pytest.mark.parametrize("epoch_steps, expected", [(8, 1), (100, 8), (1000, 64), (None, 64)])
def test_choose_steps_keeps_eight_executions_per_epoch(epoch_steps, expected):
    measured = {"overhead_s": 0.002, "step_s": 0.0001}  # wants 64
    assert calibration.choose_steps(measured, tf.distribute.get_strategy(),
                                    epoch_steps) == expected


def test_steps_per_execution_auto_without_sample_batch_warns():
    model = small_model()
    with pytest.warns(GpufixWarning, match="none was given, so steps_per_execution=1") as caught:
        report = kg.compile_model(model, "adam", "mse", mixed_precision=None)
    assert caught[0].filename == __file__
    assert report.steps_per_execution == 1 == model.steps_per_execution
    assert report.calibration is None and not report.verified


def test_explicit_steps_per_execution_is_kept():
    x, y = data()
    model = small_model()
    report = kg.compile_model(model, "adam", "mse", mixed_precision=None,
                              steps_per_execution=4, sample_batch=(x[:8], y[:8]))
    assert report.steps_per_execution == 4 == model.steps_per_execution
    assert report.calibration is None


# -- mixed precision ---------------------------------------------------------------


def test_bfloat16_policy_takes_effect_and_trains_on_cpu():
    assert kg.enable_mixed_precision("mixed_bfloat16") == "mixed_bfloat16"
    x, y = data()
    model = small_model()
    assert all(layer.compute_dtype == "bfloat16" for layer in model.layers)
    assert all(w.dtype == "float32" for w in model.weights)
    report = kg.compile_model(model, "adam", "mse", steps_per_execution=1,
                              sample_batch=(x[:16], y[:16]))
    assert report.policy == "mixed_bfloat16"
    assert report.loss_scaling is False
    assert report.jit_compile is True
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_policy_set_after_building_warns_with_the_fix():
    model = small_model()  # built in float32
    kg.enable_mixed_precision("mixed_bfloat16")
    with pytest.warns(GpufixWarning, match=r"enable_mixed_precision\('mixed_bfloat16'\)"):
        report = kg.compile_model(model, "adam", "mse", steps_per_execution=1)
    assert report.policy == "float32"  # what really computes
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}  # checked, not applied


@pytest.mark.parametrize("built", ["float32", "mixed_bfloat16"])
def test_built_then_compiled_with_defaults_keeps_its_dtype_and_notes_auto(auto_hardware,
                                                                          capsys, built):
    # The order most users write: build, then compile_model with its defaults.
    keras.mixed_precision.set_global_policy(built)
    model, other = small_model(), small_model()
    keras.mixed_precision.set_global_policy("float32")
    report = kg.compile_model(model, "adam", "mse", steps_per_execution=1)  # no warning
    kg.compile_model(other, "adam", "mse", steps_per_execution=1)
    assert report.policy == built  # kept, not applied
    assert {layer.compute_dtype for layer in model.layers} == {
        keras.DTypePolicy(built).compute_dtype}
    out = capsys.readouterr().out
    if auto_hardware == built:
        assert f"wanted {built}" in report.reason and out == ""
        return
    note = (f"mixed_precision='auto' would choose {auto_hardware} here (CPU only, "
            f"{'with AMX-BF16' if auto_hardware != 'float32' else 'AVX512-BF16 without AMX'}")
    assert note in str(report)
    assert "call kg.enable_mixed_precision() before building the model" in report.reason
    assert out.count(note) == 1  # printed once per process, in the report each time
    assert out.startswith("compile_model: ")


def test_explicit_mismatch_warns():
    with pytest.warns(GpufixWarning, match="built after") as caught:
        kg.compile_model(small_model(), "adam", "mse", mixed_precision="mixed_float16",
                         steps_per_execution=1)
    assert caught[0].filename == __file__


def test_float16_gets_loss_scaling_exactly_once():
    kg.enable_mixed_precision("mixed_float16")
    model = small_model()
    report = kg.compile_model(model, keras.optimizers.SGD(0.01), "mse", steps_per_execution=1)
    assert report.loss_scaling is True and report.policy == "mixed_float16"
    lso = keras.optimizers.LossScaleOptimizer
    assert isinstance(model.optimizer, lso)
    assert not isinstance(model.optimizer.inner_optimizer, lso)
    scale = float(model.optimizer.initial_scale)
    assert float(model.optimizer.scale_loss(tf.constant(1.0))) == scale  # not scale**2
    x, y = data()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_float16_with_a_loss_scale_optimizer_passed_in_is_not_wrapped_again():
    kg.enable_mixed_precision("mixed_float16")
    model = small_model()
    passed = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    report = kg.compile_model(model, passed, "mse", steps_per_execution=1)
    assert model.optimizer is passed and report.loss_scaling is True


def test_float32_gets_no_loss_scaling():
    report = kg.compile_model(small_model(), "sgd", "mse", mixed_precision="float32",
                              steps_per_execution=1)
    assert report.loss_scaling is False
    assert report.policy == "float32"


def _fake_gpu(monkeypatch, capability):
    gpu = type("PhysicalDevice", (), {"name": "/physical_device:GPU:0"})()
    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: [gpu] if kind == "GPU" else real(kind))
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda device: {"compute_capability": capability,
                                        "device_name": "Fake GPU"})


def test_hardware_verdicts_import_no_tensorflow():
    """`kg.validate` asks hardware.precision_support with a device dict: no TF needed."""
    code = (
        "import sys; from keras_gpufix.compile import hardware; "
        "info = {'gpus': [{'name': 'A100', 'compute_capability': [8, 0]}], "
        "'cpu_bf16': False, 'cpu_bf16_flags': []}; "
        "print(hardware.precision_support('mixed_bfloat16', info)[0], "
        "sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True []"


@pytest.mark.parametrize("capability, expected", [
    ((9, 0), "mixed_bfloat16"), ((8, 0), "mixed_bfloat16"),
    ((7, 5), "mixed_float16"), ((7, 0), "mixed_float16"), ((6, 1), "float32"),
])
def test_auto_policy_by_gpu_generation(monkeypatch, capability, expected):
    _fake_gpu(monkeypatch, capability)
    assert kg.enable_mixed_precision() == expected
    assert keras.mixed_precision.global_policy().name == expected


@pytest.mark.parametrize("flags, expected", [
    ({"avx2"}, "float32"), ({"avx512f", "avx512_bf16"}, "float32"),
    ({"amx_bf16"}, "mixed_bfloat16"), (set(), "float32"),
])
def test_auto_policy_on_cpu_by_bfloat16_support(monkeypatch, flags, expected):
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: [] if kind == "GPU" else ["cpu"])
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: flags)
    policy, why = hardware.auto_policy()
    assert policy == expected and why


def _gpus(*caps):
    return {"gpus": [{"name": f"GPU {i}", "compute_capability": list(c) if c else None}
                     for i, c in enumerate(caps)],
            "cpu_bf16": False, "cpu_bf16_flags": []}


@pytest.mark.parametrize("policy, info, fast", [
    ("bfloat16", _gpus((8, 0), (7, 5)), False),  # the weakest GPU decides
    ("mixed_bfloat16", _gpus((8, 6), (9, 0)), True),
    ("float16", _gpus((7, 0), (8, 0)), True),
    ("mixed_float16", _gpus((6, 1), (8, 0)), False),
    ("mixed_float16", _gpus(), False),  # CPU only: emulated
    ("mixed_bfloat16", _gpus(None), False),  # capability unknown
    ("float32", _gpus((6, 1)), True),
])
def test_precision_support_weakest_gpu_decides(policy, info, fast):
    answer, reason = hardware.precision_support(policy, info)
    assert answer is fast and reason


def test_precision_support_names_a_bad_policy():
    with pytest.raises(ValueError, match="Received: policy='fp16'"):
        hardware.precision_support("fp16", _gpus())


def test_auto_policy_follows_the_weakest_gpu():
    assert hardware.auto_policy(_gpus((9, 0), (7, 5)))[0] == "mixed_float16"
    assert hardware.auto_policy(_gpus((6, 0), (9, 0)))[0] == "float32"


# -- arguments and report -------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"jit_compile": "auto"},
     "`jit_compile` must be True or False. Received: jit_compile='auto'"),
    ({"mixed_precision": "fp16"}, "Received: mixed_precision='fp16'"),
    ({"steps_per_execution": 0},
     "`steps_per_execution` must be 'auto' or an int >= 1. Received: steps_per_execution=0"),
    ({"steps_per_execution": "fast"}, "Received: steps_per_execution='fast'"),
    ({"sample_batch": np.zeros((4, 8))}, "Received: sample_batch of type ndarray"),
])
def test_invalid_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kg.compile_model(small_model(), "adam", "mse", **kwargs)


def test_enable_mixed_precision_rejects_unknown_policy():
    with pytest.raises(ValueError, match="policy='fp8'"):
        kg.enable_mixed_precision("fp8")


def test_report_prints_every_choice():
    report = kg.compile_model(small_model(), "adam", "mse", mixed_precision="float32",
                              steps_per_execution=2)
    text = str(report)
    assert "jit_compile=True" in text and "not verified" in text
    assert "policy=float32" in text and "steps_per_execution=2" in text
    assert isinstance(report, kg.CompileReport)
