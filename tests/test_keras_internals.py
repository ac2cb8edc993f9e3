"""Each function of keras_gpufix.keras_internals on the installed Keras/TensorFlow."""

import sys
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
    surround_callbacks,
    step_on_data_cell,
    overrides_train_step,
    plain_variable,
    set_symbolic_build,
    symbolic_build,
    tensorflow_started,
    tf_function_class,
    trace_from_aligned_ids,
    traced_functions,
    worker_server_port,
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


class _Calls(keras.callbacks.Callback):
    def __init__(self, name, log, surround=False):
        super().__init__()
        self.name, self.log, self.surround, self.restore = name, log, surround, None

    def on_train_begin(self, logs=None):
        self.log.append(f"{self.name}.train_begin")
        if self.surround:
            self.restore = surround_callbacks(self, _Marker("first", self.log),
                                              _Marker("last", self.log))

    def on_train_batch_end(self, batch, logs=None):
        self.log.append(self.name)


class _Marker(_Calls):
    pass


@pytest.mark.parametrize("loop", ["fit", "callback_list"])
def test_surround_callbacks_frames_the_running_callback_list(loop):
    log = []
    user, ours = _Calls("user", log), _Calls("ours", log, surround=True)
    if loop == "fit":
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(np.zeros((2, 3)), np.zeros((2, 1)), batch_size=1, verbose=0,
                  callbacks=[user, ours])
    else:
        hooks = keras.callbacks.CallbackList([user, ours])
        hooks.on_train_begin()
        for batch in range(2):
            hooks.on_train_batch_end(batch)
    # the hook being run goes on over the old list (each callback once), then
    # every later hook runs the first callback before, the last after the others
    assert log[:2] == ["user.train_begin", "ours.train_begin"]
    assert log[2:] == ["first", "user", "ours", "last"] * 2
    assert ours.restore is not None and surround_callbacks(user, user, user) is None
    if loop == "callback_list":
        ours.restore()
        assert hooks.callbacks == [user, ours]


def test_surround_callbacks_takes_out_markers_a_failed_run_left():
    log = []
    ours = _Calls("ours", log, surround=True)
    hooks = keras.callbacks.CallbackList([ours])
    hooks.on_train_begin()
    hooks.on_train_begin()  # a second run, without on_train_end
    assert [c.name for c in hooks.callbacks] == ["first", "ours", "last"]


def test_async_train_dispatch_reads_keras_decision(monkeypatch):
    import keras_gpufix as kg
    from keras_gpufix.keras_internals import async_train_dispatch

    class Sync(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    # TensorFlow: Keras never dispatches callbacks off the loop's thread.
    assert async_train_dispatch(keras.callbacks.CallbackList([kg.StepTimer()])) is False
    # A thread-safe backend: our callbacks keep it on, a plain override turns it off
    # (the JAX backend itself: tests/test_async_clock.py).
    from keras.src.callbacks import callback_list

    monkeypatch.setattr(callback_list.backend, "IS_THREAD_SAFE", True)
    ours = [kg.StepTimer(), kg.GPUOscillationMonitor(nvml=False, verbose=0)]
    assert async_train_dispatch(keras.callbacks.CallbackList(ours)) is True
    assert async_train_dispatch(keras.callbacks.CallbackList(ours + [Sync()])) is False
    monkeypatch.setattr(keras_internals, "_WARNED", set())
    with pytest.warns(GpufixWarning, match="_async_train"):
        assert async_train_dispatch(object()) is None


def test_trace_from_aligned_ids_names_the_step_alike_whatever_was_traced_before():
    def step_names(other_functions):
        for i in range(other_functions):  # what another run traced first (a feature cache)
            tf.function(lambda x, i=i: x + i).get_concrete_function(tf.TensorSpec([None]))
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", jit_compile=True)
        trace_from_aligned_ids(model)
        model.fit(np.zeros((8, 3)), np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0)
        step = traced_functions(model.train_function)["one_step_on_data"]
        return [f.name.decode() for f in concrete_functions(step)]

    first, second = step_names(0), step_names(7)
    assert len(first) == len(second) >= 1
    for a, b in zip(first, second):  # __inference_one_step_on_data_<id>: the same id modulo
        a_id, b_id = int(a.rsplit("_", 1)[1]), int(b.rsplit("_", 1)[1])
        assert a_id != b_id and (a_id - b_id) % keras_internals.TRACE_ID_STRIDE == 0, (a, b)


def test_trace_from_aligned_ids_keeps_the_per_replica_step_mark():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    install_per_replica_xla(model)
    trace_from_aligned_ids(model)
    assert step_jit_compile(model) is True
    model.run_eagerly = True  # eager calls pass straight through
    model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, epochs=1, verbose=0)


def test_step_on_data_cell_is_the_step_every_batch_goes_through():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=2)
    model.make_train_function()
    cell = step_on_data_cell(model.train_function)
    step, seen = cell.cell_contents, []

    def counting(data):
        seen.append(data)
        return step(data)

    cell.cell_contents = counting  # before Keras first traces the train function
    model.fit(np.zeros((8, 3)), np.zeros((8, 1)), batch_size=2, epochs=1, verbose=0)
    assert len(seen) == 1  # traced once, inside multi_step_on_iterator's while loop
    assert traced_functions(model.train_function)["multi_step_on_iterator"] \
        .experimental_get_tracing_count() == 1


def test_step_on_data_cell_of_other_functions():
    assert step_on_data_cell(None) is None
    assert step_on_data_cell(tf.function(lambda it: it)) is None  # tf.keras style
    assert step_on_data_cell(lambda it: it) is None  # no closure

    def outer():
        one_step_on_data = 1

        def function(iterator):
            return one_step_on_data

        return function

    (first, second), warned = _twice(lambda: step_on_data_cell(outer()))
    assert first is None and second is None and len(warned) == 1
    assert "one_step_on_data" in warned[0]


def test_plain_variable_under_a_strategy_is_not_mirrored():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        mirrored = tf.Variable(0)
        plain = plain_variable(tf.constant(0))
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    assert not isinstance(plain, tf.distribute.DistributedValues)
    assert not plain.trainable
    plain.assign_add(2)
    assert int(plain.numpy()) == 2
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


def test_worker_server_port_is_the_port_the_worker_listens_on(monkeypatch):
    import socket

    service = tf.data.experimental.service
    dispatcher = service.DispatchServer()
    worker = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1]))
    try:
        port = worker_server_port(worker)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the worker listens there
    finally:
        worker.stop()
        dispatcher.stop()

    class Moved:  # a TensorFlow that keeps the pybind server elsewhere
        pass

    monkeypatch.setattr(keras_internals, "_WARNED", set())
    results, messages = _twice(lambda: worker_server_port(Moved()))
    assert results == [None, None]
    assert len(messages) == 1 and "WorkerServer._server.bound_port" in messages[0]


def test_tensorflow_started_once_it_made_its_devices(monkeypatch):
    tf.constant(0)
    assert tensorflow_started() is True
    monkeypatch.delitem(sys.modules, "tensorflow")
    assert tensorflow_started() is False  # not imported


class _Seen(keras.callbacks.Callback):
    """Records what the internals find from inside fit's on_train_begin."""

    def __init__(self, call):
        super().__init__()
        self.call = call
        self.found = None

    def on_train_begin(self, logs=None):
        self.found = self.call(self)


def _small_fit(callback, data, **fit):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, epochs=1, verbose=0, callbacks=[callback], **fit)


def test_fit_epoch_iterator_and_running_callback_list_from_on_train_begin():
    from keras.src.trainers.epoch_iterator import EpochIterator

    from keras_gpufix.keras_internals import fit_epoch_iterator, running_callback_list

    seen = _Seen(lambda cb: (fit_epoch_iterator(), running_callback_list(cb)))
    _small_fit(seen, np.zeros((8, 4)), y=np.zeros((8, 1)), batch_size=4)
    iterator, hooks = seen.found
    assert isinstance(iterator, EpochIterator)
    assert isinstance(hooks, keras.callbacks.CallbackList) and seen in hooks.callbacks
    assert fit_epoch_iterator() is None and running_callback_list(seen) is None  # no fit


@pytest.mark.parametrize("source", ["pydataset", "generator", "arrays"])
def test_time_batches_records_each_batch_fit_takes(source):
    from keras_gpufix.keras_internals import fit_epoch_iterator, time_batches

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.zeros((2, 4), "float32"), np.zeros((2, 1), "float32")

    def generator():
        while True:
            yield np.zeros((2, 4), "float32"), np.zeros((2, 1), "float32")

    recorded = []
    data = {"pydataset": (Batches(), {}),
            "generator": (generator(), {"steps_per_epoch": 3}),
            "arrays": (np.zeros((6, 4), "float32"), {"y": np.zeros((6, 1)), "batch_size": 2})}
    seen = _Seen(lambda cb: time_batches(fit_epoch_iterator(), recorded.append, consumer=False))
    _small_fit(seen, data[source][0], **data[source][1])
    if source == "arrays":  # TensorFlow makes a tf.data dataset of arrays: no Python producer
        assert seen.found is None and recorded == []
    else:
        # tf.data prefetches the generator's batches: maybe one beyond the 3 taken
        assert len(recorded) >= 3 and all(b[0].shape == (2, 4) for b in recorded)
        seen.found()  # takes the wrapper out
    consumer = []
    iterator = _Seen(lambda cb: fit_epoch_iterator())
    _small_fit(iterator, np.zeros((6, 4), "float32"), y=np.zeros((6, 1)), batch_size=2)
    restore = time_batches(iterator.found, consumer.append, consumer=True)
    batches = list(iterator.found._get_iterator())
    assert len(consumer) == len(batches) == 3
    restore()
    assert "_get_iterator" not in vars(iterator.found)


@pytest.mark.parametrize("source", ["tf_data", "arrays"])
def test_instrument_fit_dataset_puts_fits_dataset_through_the_function(source):
    from keras_gpufix.keras_internals import fit_epoch_iterator, instrument_fit_dataset

    passed, steps = [], []

    def through(dataset):  # one batch of three: fit then runs one step an epoch
        passed.append(dataset)
        return dataset.take(1)

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    x, y = np.ones((6, 4), "float32"), np.zeros((6, 1), "float32")
    data = ((tf.data.Dataset.from_tensor_slices((x, y)).batch(2), {}) if source == "tf_data"
            else (x, {"y": y, "batch_size": 2}))
    seen = _Seen(lambda cb: instrument_fit_dataset(fit_epoch_iterator(), through))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data[0], epochs=1, verbose=0, callbacks=[seen, Steps()], **data[1])
    assert len(passed) == 1 and isinstance(passed[0], tf.data.Dataset)
    assert steps == [0]  # fit iterated the replacement
    assert callable(seen.found)
    declined = _Seen(lambda cb: instrument_fit_dataset(fit_epoch_iterator(), lambda d: None))
    _small_fit(declined, data[0], **data[1])
    assert declined.found is None


def test_blocks_async_dispatch_follows_keras_rule():
    from keras_gpufix.keras_internals import blocks_async_dispatch

    class AtBatchEnd(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    class Safe(AtBatchEnd):
        async_safe = True

    assert blocks_async_dispatch(AtBatchEnd())
    assert not blocks_async_dispatch(Safe())
    assert not blocks_async_dispatch(keras.callbacks.History())
    assert blocks_async_dispatch(keras.callbacks.TerminateOnNaN())


def test_time_train_function_stamps_each_step_and_gives_it_back():
    from keras_gpufix.keras_internals import time_train_function

    stamps = []
    seen = _Seen(lambda cb: time_train_function(cb.model, lambda: stamps.append(1)))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((12, 4)), np.zeros((12, 1)), batch_size=4, epochs=1, verbose=0,
              callbacks=[seen])
    assert len(stamps) == 3
    wrapped = model.train_function
    seen.found()
    assert model.train_function is wrapped.__wrapped__
    assert time_train_function(keras.Sequential(), stamps.append) is None  # not compiled


def test_time_iterator_launches_stamps_each_graph_that_takes_its_batch():
    from keras_gpufix.keras_internals import time_iterator_launches

    launches, seen = [], []

    class Begins(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(len(launches))

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices((np.zeros((12, 4)), np.zeros((12, 1)))).batch(4)
    restore = time_iterator_launches(lambda: launches.append(1))
    try:
        model.fit(data, epochs=1, verbose=0, callbacks=[Begins()])
        assert seen == [0, 1, 2] and len(launches) == 3  # each step, after its begin hook
        model.evaluate(data.take(2), verbose=0)
        assert len(launches) == 5  # evaluation's graph takes its batches too
        model.train_on_batch(np.zeros((4, 4)), np.zeros((4, 1)))  # its batch: in Python
        assert len(launches) == 5
        # A second wrapper replaces the first (one left by a run that failed).
        again = time_iterator_launches(lambda: launches.append(2))
        model.fit(data, epochs=1, verbose=0)
        assert launches[5:] == [2, 2, 2]
    finally:
        restore()
    again()
    model.fit(data, epochs=1, verbose=0)
    assert len(launches) == 8  # given back: TensorFlow's own call again
