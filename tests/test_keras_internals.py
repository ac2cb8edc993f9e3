"""Each function of keras_gpufix.keras_internals on the installed Keras/TensorFlow."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix import keras_internals
from keras_gpufix.exceptions import GpufixWarning
from keras_gpufix.keras_internals import (
    callback_model,
    concrete_functions,
    cross_device_ops_name,
    flatten_layers,
    function_jit_compile,
    in_multi_worker_mode,
    input_datasets,
    map_function_stateful,
    batch_rows,
    install_per_replica_xla,
    step_jit_compile,
    overrides_train_step,
    set_symbolic_build,
    symbolic_build,
    tf_function_class,
    traced_functions,
)


def _twice(call):
    """`call()` twice: its two results and the GpufixWarning messages (a broken
    internal warns once, not per call)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [call(), call()]
    return results, [str(w.message) for w in caught if issubclass(w.category, GpufixWarning)]


def test_traced_functions_finds_keras_steps():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), epochs=1, verbose=0)
    found = traced_functions(model.train_function)
    assert "one_step_on_data" in found
    assert found["one_step_on_data"].experimental_get_tracing_count() >= 1


def test_traced_functions_covers_old_and_odd_train_functions():
    fn = tf.function(lambda x: x + 1)
    fn(tf.constant(1.0))
    assert list(traced_functions(fn).values()) == [fn]  # tf.keras style
    assert traced_functions(lambda it: None) == {}
    assert traced_functions(None) == {}


def test_cross_device_ops_name_of_a_mirrored_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert cross_device_ops_name(strategy).endswith("AllReduce")
    assert cross_device_ops_name(tf.distribute.get_strategy()) == "unknown"


def test_concrete_functions_lists_the_traces():
    fn = tf.function(lambda x: x * 2)
    fn(tf.constant(1.0))
    fn(tf.constant([1.0, 2.0]))
    assert len(concrete_functions(fn)) == 2


def test_function_jit_compile_reads_the_argument(monkeypatch):
    assert function_jit_compile(tf.function(lambda x: x, jit_compile=True)) is True
    assert function_jit_compile(tf.function(lambda x: x, jit_compile=False)) is False
    assert function_jit_compile(tf.function(lambda x: x)) is False  # no XLA by default
    monkeypatch.setattr(keras_internals, "_WARNED", set())
    fn = tf.function(lambda x: x)
    monkeypatch.setattr(type(fn), "function_spec", property(lambda self: None))
    results, messages = _twice(lambda: function_jit_compile(fn))
    assert results == [None, None]
    assert len(messages) == 1 and "function_spec.jit_compile" in messages[0]


def test_callback_model_is_the_model_fit_set():
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(callback_model(self))

    probe = Probe()
    assert callback_model(probe) is None  # before fit
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), batch_size=2, epochs=1, verbose=0,
              callbacks=[probe])
    assert seen == [model, model]


def test_callback_model_falls_back_to_the_property_with_one_warning(monkeypatch):
    monkeypatch.setattr(keras_internals, "_WARNED", set())

    class Moved:  # a Keras whose Callback keeps the model elsewhere
        model = "the model"

    results, messages = _twice(lambda: callback_model(Moved()))
    assert results == ["the model", "the model"]
    assert len(messages) == 1 and "Callback._model" in messages[0]


def test_input_datasets_walks_a_pipeline():
    source = tf.data.Dataset.range(8)
    mapped = source.map(lambda x: x + 1)
    pipeline = mapped.batch(2).prefetch(1)
    assert input_datasets(source) == []
    assert input_datasets(mapped) == [source]
    (batched,) = input_datasets(pipeline)
    assert input_datasets(batched) == [mapped]
    assert input_datasets(tf.data.Dataset.zip((source, mapped))) == [source, mapped]


def test_input_datasets_of_an_unknown_object_warns_once(monkeypatch):
    monkeypatch.setattr(keras_internals, "_WARNED", set())
    results, messages = _twice(lambda: input_datasets(object()))
    assert results == [[], []]
    assert len(messages) == 1 and "tf.data.Dataset._inputs" in messages[0]


def test_flatten_layers_walks_nested_models():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="deep")])
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1, name="top")])
    names = [layer.name for layer in flatten_layers(outer)]
    assert "deep" in names and "top" in names and outer.name not in names
    assert "deep" not in [layer.name for layer in flatten_layers(outer, recursive=False)]


def test_overrides_train_step():
    class Custom(keras.Model):
        def train_step(self, data):
            return {}

    assert not overrides_train_step(keras.Sequential([keras.layers.Dense(1)]))
    assert overrides_train_step(Custom())


def test_in_multi_worker_mode_is_false_on_one_machine():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert in_multi_worker_mode(strategy) is False


def test_a_broken_internal_gives_one_warning_naming_the_keras_version(monkeypatch):
    monkeypatch.setattr(keras_internals, "_WARNED", set())
    fn = tf.function(lambda x: x)
    fn(tf.constant(1.0))
    monkeypatch.setattr(type(fn), "_list_all_concrete_functions",
                        property(lambda self: (_ for _ in ()).throw(AttributeError("gone"))))
    results, messages = _twice(lambda: concrete_functions(fn))
    assert results == [None, None] and len(messages) == 1
    assert f"Keras {keras.__version__}" in messages[0]
    assert "_list_all_concrete_functions" in messages[0]


def test_compile_report_says_not_verified_when_the_step_cannot_be_read(monkeypatch):
    import keras_gpufix as kg

    monkeypatch.setattr(keras_internals, "_WARNED", set())
    monkeypatch.setattr(type(tf.function(lambda: 0)), "_list_all_concrete_functions",
                        lambda self: (_ for _ in ()).throw(AttributeError("gone")))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.warns(GpufixWarning, match="not where it was on Keras") as caught:
        report = kg.compile_model(model, "sgd", "mse", mixed_precision=None,
                                  steps_per_execution=1,
                                  sample_batch=(np.zeros((4, 3)), np.zeros((4, 1))))
    assert caught[0].filename == __file__  # the user's compile_model line
    assert report.verified is False and report.jit_compile is True
    assert "not verified (the traced step could not be read" in report.reason


def test_per_replica_step_matches_keras_own_train_step():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    models = []
    for _ in range(2):  # same seed, same weights
        keras.utils.set_random_seed(0)
        models.append(keras.Sequential([keras.Input((8,)),
                                        keras.layers.Dense(16, activation="relu"),
                                        keras.layers.Dense(1)]))
    ours, theirs = models
    for model in models:
        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"], jit_compile=False)
    install_per_replica_xla(ours)
    # the per-replica step is XLA though Keras's own flag says False
    assert (step_jit_compile(ours), step_jit_compile(theirs), step_jit_compile(None)) == (
        True, False, None)
    logs = [m.train_on_batch(x, y, return_dict=True) for m in (ours, theirs)]
    assert logs[0].keys() == logs[1].keys() == {"loss", "mae"}
    for key in logs[0]:
        np.testing.assert_allclose(logs[0][key], logs[1][key], rtol=1e-5)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batch_rows_skips_a_first_input_that_is_none():  # keras-team/keras#21630
    assert int(batch_rows({"a": None, "b": tf.zeros((3, 2))})) == 3


def test_symbolic_build_creates_optimizer_and_metric_variables():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("adam", "mse", metrics=["mae"])
    assert not model.optimizer.built
    symbolic_build(model, (np.zeros((2, 3), "float32"), np.zeros((2, 1), "float32")))
    assert model.optimizer.built and model.optimizer.variables


def test_set_symbolic_build_is_what_fit_calls():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    calls = []

    def build(iterator=None, data_batch=None):
        calls.append(iterator)
        symbolic_build(model, (np.zeros((2, 3), "float32"), np.zeros((2, 1), "float32")))

    set_symbolic_build(model, build)
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), epochs=1, verbose=0)
    assert len(calls) == 1


def test_tf_function_class_is_what_tf_function_makes():
    calls = []
    cls = tf_function_class()
    original = cls.__call__

    def counting(fn, *args, **kwargs):
        calls.append(fn)
        return original(fn, *args, **kwargs)

    add_one = tf.function(lambda x: x + 1)
    assert isinstance(add_one, cls)
    cls.__call__ = counting
    try:
        assert int(add_one(tf.constant(1))) == 2
    finally:
        cls.__call__ = original
    assert calls == [add_one]


def test_map_function_stateful_tells_what_tf_data_parallelizes_itself(monkeypatch):
    source = tf.data.Dataset.range(8)
    assert map_function_stateful(source.map(lambda x: x * 2)) is False
    assert map_function_stateful(source.map(
        lambda x: x + tf.random.uniform([], 0, 5, tf.int64))) is True
    assert map_function_stateful(source.map(
        lambda x: tf.numpy_function(lambda v: v, [x], tf.int64))) is True
    assert map_function_stateful(source.filter(lambda x: x > 2)) is False
    assert map_function_stateful(source.batch(2)) is None

    class Moved:  # a TensorFlow whose wrapper keeps the function elsewhere
        _map_func = object()

    monkeypatch.setattr(keras_internals, "_WARNED", set())
    results, messages = _twice(lambda: map_function_stateful(Moved()))
    assert results == [None, None]
    assert len(messages) == 1 and "StructuredFunctionWrapper.function" in messages[0]
