"""Every reach into Keras's and TensorFlow's private structures, in one place.

keras_gpufix needs a few things Keras and TensorFlow offer no public way to
get: the `tf.function`s inside `model.train_function`, the graphs they
traced, a train step XLA-compiled per replica under `MirroredStrategy`, and
so on. Each is one small function here, with a test in
`tests/test_keras_internals.py`; `benchmarks/compat.py` runs them on Keras
3.12-3.15 with TensorFlow 2.19-2.21. The rest of
the package calls these functions and never touches a private name itself, so
a Keras release that moves something breaks one function, not many.

A function that finds the structure changed returns its "unknown" value
(`None`, an empty dict) and the caller says "not verified"; it never guesses.
"""

import functools
import types
from collections import deque

from keras_gpufix.exceptions import warn

__all__ = [
    "async_train_dispatch",
    "batch_rows",
    "callback_model",
    "concrete_functions",
    "cross_device_ops_name",
    "data_source",
    "fit_epoch_iterator",
    "flatten_layers",
    "function_jit_compile",
    "in_multi_worker_mode",
    "input_datasets",
    "instrument_fit_dataset",
    "install_multi_worker_fixes",
    "install_per_replica_xla",
    "map_function_stateful",
    "overrides_train_step",
    "plain_variable",
    "remove_per_replica_xla",
    "set_symbolic_build",
    "step_jit_compile",
    "step_on_data_cell",
    "surround_callbacks",
    "time_batches",
    "time_iterator_launches",
    "time_train_function",
    "trace_from_aligned_ids",
    "symbolic_build",
    "tf_function_class",
    "tensorflow_started",
    "traced_functions",
    "worker_server_port",
    "blocks_async_dispatch",
    "running_callback_list",
    "keras_trainer_source",
]

CHECKED_ON = "Keras 3.12-3.15, TensorFlow 2.19-2.21"
_WARNED = set()


def _off(what: str, exc: BaseException) -> None:
    """One GpufixWarning per internal that stopped working (never more)."""
    if what in _WARNED:
        return
    _WARNED.add(what)
    import keras

    try:  # the callbacks also run on Keras backends without TensorFlow
        import tensorflow as tf

        tf_version = tf.__version__
    except ImportError:
        tf_version = "not installed"
    warn(
        f"keras_gpufix: {what} is not where it was on Keras {keras.__version__} / "
        f"TensorFlow {tf_version} (checked on {CHECKED_ON}): "
        f"{type(exc).__name__}: {exc}. The result that needs it says 'not verified'."
    )


def traced_functions(train_function, depth: int = 4) -> dict:
    """The `tf.function`s a Keras train function calls, by name.

    Keras 3 builds `model.train_function` as a Python closure around
    `tf.function`s (`multi_step_on_iterator`, `one_step_on_data`, the
    latter wrapped by `functools.wraps`); older Keras and `tf.keras` make
    it a `tf.function` itself. Closure cells, `__wrapped__`, `func` and
    `python_function` are followed up to `depth` levels; other objects
    (the model) are not entered. Checked on Keras 3.15.1, TensorFlow 2.21.0.

    Args:
        train_function: `model.train_function` (or any callable), or `None`.
        depth: how many links to follow from `train_function`. Defaults to 4.

    Returns:
        A dict name -> object with `experimental_get_tracing_count()`, in
        breadth-first order (empty when none is reachable).
    """
    found, seen = {}, set()
    queue = deque([(train_function, 0)])
    while queue:  # breadth first: each object is reached by its shortest path
        obj, level = queue.popleft()
        if obj is None or level > depth or id(obj) in seen:
            continue
        seen.add(id(obj))
        if callable(getattr(obj, "experimental_get_tracing_count", None)):
            name = getattr(obj, "__name__", None) or type(obj).__name__
            while name in found:
                name += "_"
            found[name] = obj
            queue.append((getattr(obj, "python_function", None), level + 1))
        elif isinstance(obj, functools.partial):
            queue.append((obj.func, level + 1))
        elif isinstance(obj, types.MethodType):
            queue.append((obj.__func__, level + 1))
        elif isinstance(obj, types.FunctionType):
            queue.append((getattr(obj, "__wrapped__", None), level + 1))
            for cell in obj.__closure__ or ():
                try:
                    queue.append((cell.cell_contents, level + 1))
                except ValueError:  # empty cell
                    pass
    return found


def tf_function_class() -> type:
    """The class of the objects `tf.function` returns (their `__call__` is
    every call of a traced function).

    TensorFlow 2.19-2.21: `tensorflow.python.eager.polymorphic_function.
    polymorphic_function.Function`, not exported; it is taken from an object
    `tf.function` makes, so it follows TensorFlow where it moves.
    """
    import tensorflow as tf

    return type(tf.function(lambda: None))


def cross_device_ops_name(strategy) -> str:
    """The all-reduce a `MirroredStrategy` chose, e.g. `"NcclAllReduce"`.

    TensorFlow picks it when the strategy is created (NCCL on GPUs where it
    has it, else hierarchical copy; `CollectiveAllReduce` on CPU devices) and
    only keeps it in `strategy.extended._cross_device_ops`. Checked on
    TensorFlow 2.21.0.

    Returns:
        The class name, or `"unknown"` when the attribute is gone.
    """
    ops = getattr(getattr(strategy, "extended", None), "_cross_device_ops", None)
    return type(ops).__name__ if ops is not None else "unknown"


def callback_model(callback):
    """The model given to a Keras callback by `set_model`, or None before that.

    Keras 3.15.1 keeps it in `Callback._model`. The public `callback.model`
    property is not a plain read: on the JAX backend it syncs the model's
    state from the device (at every call, so per batch in a hook), and on
    torch it unwraps `DistributedDataParallel`. When `_model` is gone the
    property is used.
    """
    try:
        return callback._model
    except AttributeError as exc:
        _off("keras.callbacks.Callback._model", exc)
        return getattr(callback, "model", None)


def input_datasets(dataset) -> list:
    """The datasets a `tf.data.Dataset` was made from (empty for a source).

    TensorFlow 2.21.0's `DatasetV2._inputs()`: one input for `map`,
    `batch`, `prefetch` ..., several for `zip` and `concatenate`, none for
    `from_tensor_slices` and other sources. tf.data has no public way to
    walk a pipeline. An empty list, with one `GpufixWarning`, when the
    method is gone.
    """
    try:
        return list(dataset._inputs())
    except Exception as exc:  # any change in TF's private method
        _off("tf.data.Dataset._inputs", exc)
        return []


def concrete_functions(function) -> "list | None":
    """The concrete functions a `tf.function` traced so far.

    Reads `function._list_all_concrete_functions()` (TensorFlow 2.21.0's
    `Function`; the public `get_concrete_function` would trace again).

    Returns:
        A list, or None (with one `GpufixWarning`) when the method is gone.
    """
    try:
        return list(function._list_all_concrete_functions())
    except Exception as exc:  # any change in TF's private method
        _off("tf.function._list_all_concrete_functions", exc)
        return None


def function_jit_compile(function) -> "bool | None":
    """The `jit_compile` a `tf.function` was created with.

    TensorFlow 2.21.0 keeps it in `function.function_spec.jit_compile` (no
    underscore, but not in the documented API; `tf.function` has no public
    getter). `None` from `tf.function(...)` without the argument means
    "no XLA unless called inside an XLA context", so it is read as False.

    Returns:
        True or False, or None (with one `GpufixWarning`) when the
        attribute is gone.
    """
    try:
        return bool(function.function_spec.jit_compile)
    except Exception as exc:  # TF moved it
        _off("tf.function.function_spec.jit_compile", exc)
        return None


def flatten_layers(model, recursive: bool = True) -> list:
    """Every sublayer of `model` (not the model itself), depth first.

    Keras 3.15.1's `Layer._flatten_layers(include_self=False,
    recursive=...)`; Keras has no public recursive walk (`model.layers` is
    one level).
    """
    try:
        return list(model._flatten_layers(include_self=False, recursive=recursive))
    except Exception as exc:
        _off("Layer._flatten_layers", exc)
        return list(getattr(model, "layers", []))


def overrides_train_step(model) -> bool:
    """Whether `model`'s class replaces Keras's TensorFlow `train_step`.

    Compares with `keras.src.backend.tensorflow.trainer.TensorFlowTrainer`
    (Keras 3.15.1); when that class cannot be imported, True (the safe
    answer: the caller then leaves the step alone).
    """
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        return type(model).train_step is not TensorFlowTrainer.train_step
    except Exception as exc:
        _off("keras.src.backend.tensorflow.trainer.TensorFlowTrainer", exc)
        return True


def in_multi_worker_mode(strategy) -> bool:
    """Whether a `MultiWorkerMirroredStrategy` spans several workers.

    TensorFlow 2.21.0 keeps it in `strategy.extended._in_multi_worker_mode()`;
    when that is gone, the cluster resolver's worker count is used.
    """
    try:
        return bool(strategy.extended._in_multi_worker_mode())
    except Exception as exc:
        _off("strategy.extended._in_multi_worker_mode", exc)
        resolver = getattr(strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        return sum(len(tasks) for tasks in spec.values()) > 1


def symbolic_build(model, data_batch) -> None:
    """Builds `model`'s metrics and optimizer variables from one batch.

    Keras 3.15.1's `Trainer._symbolic_build(data_batch=...)`, what `fit`
    calls first; Keras has no public equivalent short of running a step.
    """
    model._symbolic_build(data_batch=data_batch)


def set_symbolic_build(model, build) -> None:
    """Makes `fit` call `build(iterator=None, data_batch=None)` to build `model`.

    Keras 3.15.1's `fit` starts with `self._maybe_symbolic_build(iterator=...)`;
    the multi-worker fix replaces it on the instance.
    """
    model._maybe_symbolic_build = build


def install_per_replica_xla(model) -> None:
    """Replaces `model.train_step` by one whose forward/backward is XLA-compiled.

    Keras 3's own `jit_compile=True` under `MirroredStrategy` wraps the whole
    replicated step, all devices together, in one XLA cluster and fails at
    the first step. This step runs inside `strategy.run`, so each replica
    compiles its own cluster on its own device; the all-reduce (a
    cross-replica `merge_call`) and the optimizer update stay outside XLA,
    where `tf.distribute` needs them. Keras has no public way to compile only
    part of its step, so this is Keras's `TensorFlowTrainer.train_step`
    (3.12-3.15) written with public names (`model.compute_loss`,
    `model.compute_metrics`, `optimizer.scale_loss`);
    `tests/test_keras_internals.py` checks it against Keras's own step.
    """
    import inspect

    import keras
    import tensorflow as tf

    takes_training = "training" in inspect.signature(model.compute_loss).parameters

    @tf.function(jit_compile=True, reduce_retracing=True)
    def forward_backward(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            extra = {"training": True} if takes_training else {}
            loss = model.compute_loss(x, y, y_pred, sample_weight, **extra)
            scaled = model.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_weights)
        return loss, y_pred, grads

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, y_pred, grads = forward_backward(x, y, sample_weight)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        loss_metric = next(m for m in model.metrics if m.name == "loss")
        loss_metric.update_state(
            loss * tf.cast(replicas, loss.dtype),  # the replica's share, unscaled
            sample_weight=batch_rows(x),
        )
        model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return _with_replica_axis(logs) if multi_worker else logs

    multi_worker = _multi_worker(model.distribute_strategy)
    train_step.per_replica_xla = True  # step_jit_compile reads it
    model.train_step = train_step


def step_jit_compile(model):
    """Whether `fit`'s step is XLA-compiled: True under the per-replica XLA
    step (`model.jit_compile` is False there: Keras's own XLA is off),
    else `model.jit_compile`; None when it is not a bool (no model)."""
    if getattr(getattr(model, "train_step", None), "per_replica_xla", False):
        return True
    jit = getattr(model, "jit_compile", None)
    return jit if isinstance(jit, bool) else None


def remove_per_replica_xla(model) -> None:
    """Gives the model Keras's own train step back (the XLA fallback)."""
    model.__dict__.pop("train_step", None)
    if _multi_worker(model.distribute_strategy):
        install_multi_worker_fixes(model)


TRACE_ID_STRIDE = 2**16


def trace_from_aligned_ids(model) -> None:
    """Makes each trace of `model`'s train step start at the same trace id in
    every process, so its XLA compiles keep their names across runs.

    TensorFlow names a traced function `__inference_<name>_<id>`, the id
    from a process-wide counter (`ops.uid()`, TensorFlow 2.21.0:
    `pywrap_tfe.TFE_Py_UID`) that every trace, variable and dataset function
    of the process advances. The persistent XLA compile cache keys an entry
    on that name (the cluster signature) and on the HLO module, which bears
    it too; so a run that traced more before its step (one that built a
    feature cache the next run only opens) looked up other entries. The
    counter only counts up and has no setter: when the step is traced, it
    is advanced to the next multiple of `TRACE_ID_STRIDE` (at most 65,536
    calls, about 20 ms), and the trace, deterministic from there, names its
    functions alike in every process that reaches the step below the same
    multiple. Wraps `model.train_step` (Keras's or the per-replica XLA
    step) as an instance attribute; eager calls pass straight through.
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops

    step = model.train_step

    @functools.wraps(step)
    def aligned_step(*args, **kwargs):
        if tf.inside_function():
            for _ in range(-(ops.uid() + 1) % TRACE_ID_STRIDE):
                ops.uid()
        return step(*args, **kwargs)

    model.train_step = aligned_step


def batch_rows(x):
    """Rows in the batch, from its first input that is not None (keras-team/keras#21630)."""
    import tensorflow as tf

    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _multi_worker(strategy) -> bool:
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        in_multi_worker_mode(strategy))


def _with_replica_axis(logs):
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda t: tf.reshape(t, [1]) if t.shape.rank == 0 else t, logs
    )


def install_multi_worker_fixes(model) -> None:
    """Makes Keras 3 `fit`/`evaluate` run under a multi-worker
    MultiWorkerMirroredStrategy (tensorflow/tensorflow#72388).

    Keras reduces each scalar log with `strategy.reduce("MEAN", v, axis=0)`
    there, which fails on 0-d values, so the steps give scalars a length-1
    axis; and `fit` starts by reducing a distributed input batch in eager
    mode, which fails too, so the symbolic build (`set_symbolic_build`)
    reads the local batch.
    """
    import tensorflow as tf

    strategy = model.distribute_strategy
    cls = type(model)
    if "train_step" not in model.__dict__:
        model.train_step = lambda data: _with_replica_axis(cls.train_step(model, data))
    model.test_step = lambda data: _with_replica_axis(cls.test_step(model, data))

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None and data_batch is None:
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(local, next(it))
                break
        with strategy.scope():
            symbolic_build(model, data_batch)

    set_symbolic_build(model, maybe_symbolic_build)


def running_callback_list(callback, depth: int = 16):
    """The `keras.callbacks.CallbackList` running `callback`'s hook, or None.

    Keras keeps no reference to the CallbackList of a `fit` (or of a user's
    loop, or `kg.watch`'s), so it is found on the call stack, as the `self`
    of the frame running the hook (within `depth` frames of the caller).
    """
    import keras

    return _on_stack("self", lambda hooks: isinstance(hooks, keras.callbacks.CallbackList)
                     and any(c is callback for c in hooks.callbacks), depth)


def _on_stack(name, wanted, depth):
    """The first local `name` for which `wanted(value)` holds, from the caller's
    caller up `depth` frames of the call stack, or None."""
    import sys

    frame = sys._getframe(2)
    try:
        for _ in range(depth):
            if frame is None:
                return None
            value = frame.f_locals.get(name)
            if wanted(value):
                return value
            frame = frame.f_back
        return None
    finally:
        frame = None  # no reference cycle through the stack


def blocks_async_dispatch(callback) -> bool:
    """Whether `callback` turns Keras's asynchronous batch-end dispatch off.

    Keras 3.6-3.15.1 (`CallbackList._configure_async_dispatch`): a callback
    without `async_safe = True` that overrides `on_batch_end` or
    `on_train_batch_end`; Keras marks the base class's own hooks with
    `_is_default`.
    """
    if getattr(callback, "async_safe", False):
        return False
    return any(not getattr(getattr(callback, name, None), "_is_default", False)
               for name in ("on_batch_end", "on_train_batch_end"))


def surround_callbacks(callback, first, last, depth: int = 16):
    """Puts `first` before and `last` after every callback of the running
    `keras.callbacks.CallbackList` that holds `callback`.

    Called from `callback.on_train_begin`: Keras keeps no reference to the
    CallbackList of a `fit` (or of a user's loop, or `kg.watch`'s), so it
    is found on the call stack, as the `self` of the frame running that
    hook. Its `callbacks` list is replaced, not changed in place: the loop
    over the old list (the hook being run) goes on unchanged, and every
    later hook runs `first`, the callbacks, then `last`. Callbacks of the
    class of `first` or `last` already there (left by a run that ended by
    an exception) are taken out.

    Returns:
        A function that takes `first` and `last` out again, or None where
        no CallbackList holding `callback` runs the hook (the caller then
        keeps its own timing).
    """
    hooks = running_callback_list(callback, depth)
    if hooks is None:
        return None
    try:
        stale = (type(first), type(last))
        hooks.callbacks = [first] + [c for c in hooks.callbacks
                                     if not isinstance(c, stale)] + [last]
    except Exception as exc:
        _off("the running keras.callbacks.CallbackList (its `callbacks` list)", exc)
        return None

    def restore():
        hooks.callbacks = [c for c in hooks.callbacks if c is not first and c is not last]

    return restore


def async_train_dispatch(callback_list) -> "bool | None":
    """Whether a `keras.callbacks.CallbackList` runs batch-end hooks in its thread pool.

    Keras 3.6+ (`CallbackList._configure_async_dispatch`) decides it once,
    when the list is made: on a backend whose `IS_THREAD_SAFE` is True
    (JAX, torch, NumPy; never TensorFlow) unless a callback overrides a
    batch-end hook without `async_safe = True`; it keeps the answer in
    `_async_train`. Checked on Keras 3.15.1.

    Returns:
        True or False; False on a Keras without asynchronous dispatch
        (before 3.6); None (with one `GpufixWarning`) where the answer is
        not where it was.
    """
    import keras

    try:
        return bool(callback_list._async_train)
    except AttributeError as exc:
        if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 6):
            return False
        _off("CallbackList._async_train (asynchronous callback dispatch)", exc)
        return None


def step_on_data_cell(train_function):
    """The closure cell holding the per-batch step Keras's train function calls.

    Keras 3.15.1's `TensorFlowTrainer._make_function` keeps
    `one_step_on_data` (the `tf.function` of one step, wrapped to turn
    `tf.experimental.Optional` inputs into None) in a closure cell shared by
    `model.train_function` and the `multi_step_on_iterator` it calls (inside
    that `tf.function`'s `tf.while_loop` when `steps_per_execution > 1`).
    Setting the cell's `cell_contents` before `multi_step_on_iterator` is
    first traced puts another callable on every step's path; Keras has no
    public hook there. Checked on Keras 3.15.1, TensorFlow 2.21.0.

    Returns:
        The cell, or None (with one `GpufixWarning` when `train_function`
        is a plain function without it: Keras moved it) for anything else.
    """
    code = getattr(train_function, "__code__", None)
    if code is None or not train_function.__closure__:
        return None
    try:
        cell = train_function.__closure__[code.co_freevars.index("one_step_on_data")]
        if not callable(cell.cell_contents):
            raise TypeError(f"one_step_on_data is a {type(cell.cell_contents).__name__}")
        return cell
    except (ValueError, TypeError) as exc:
        _off("the one_step_on_data closure cell of model.train_function", exc)
        return None


def plain_variable(initial_value):
    """A `tf.Variable` on this device, outside any distribution strategy.

    Under `strategy.scope()` a `tf.Variable` becomes a `MirroredVariable`
    (one copy per replica, kept in sync); a probe's bookkeeping needs one
    plain variable. TensorFlow 2.21.0 applies the strategy's variable
    creator only to `tf.Variable(...)` itself: constructing
    `resource_variable_ops.ResourceVariable` directly skips it.
    """
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.ResourceVariable(initial_value, trainable=False)
def tensorflow_started() -> "bool | None":
    """Whether TensorFlow has listed or created its devices in this process.

    TensorFlow reads `TF_XLA_FLAGS` once, when it first lists or creates its
    devices (the first `tf.constant`, dataset, Keras layer or
    `tf.config.list_physical_devices()`), not at `import tensorflow`.
    TensorFlow 2.21.0: the eager context's `_physical_devices` (listed) and
    `_context_handle` (created) are None until then.

    Returns:
        False when TensorFlow is not imported or has not started; True when
        it has; None (with one `GpufixWarning`) when the structure changed.
    """
    import sys

    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context

        ctx = context.context()
        return ctx._physical_devices is not None or ctx._context_handle is not None
    except Exception as exc:  # an unknown TensorFlow: say "not verified"
        _off("TensorFlow's eager context (_physical_devices)", exc)
        return None


def map_function_stateful(dataset) -> "bool | None":
    """Whether the function of a `map` (or `filter`) dataset holds a stateful op.

    tf.data parallelizes a stateless `map` given no `num_parallel_calls` by
    itself (`map_parallelization`, on by default), never a stateful one (a
    `numpy_function`, a random op). TensorFlow 2.21.0: the dataset's
    `_map_func` (`_predicate` for `filter`) is a `StructuredFunctionWrapper`
    whose `function` is the traced concrete function; each op of its graph
    has `_is_stateful`.

    Returns:
        True or False; None for a dataset without such a function, or (with
        one `GpufixWarning`) when the structure changed.
    """
    wrapper = getattr(dataset, "_map_func", None) or getattr(dataset, "_predicate", None)
    if wrapper is None:
        return None
    try:
        return any(op._is_stateful for op in wrapper.function.graph.get_operations())
    except Exception as exc:  # any change in TF's private structure
        _off("a tf.data map function's graph (StructuredFunctionWrapper.function)", exc)
        return None


def worker_server_port(server) -> "int | None":
    """The port a started `tf.data.experimental.service.WorkerServer` listens on.

    `DispatchServer.target` names its port; a worker has no public
    equivalent, so with `port=0` the port TensorFlow picked is otherwise
    unknown. TensorFlow 2.21.0: the server's `_server` (the pybind
    `WorkerGrpcDataServer`) has `bound_port()`.

    Returns:
        The port; None (with one `GpufixWarning`) when the structure changed.
    """
    try:
        return int(server._server.bound_port())
    except Exception as exc:  # any change in TF's private structure
        _off("a tf.data service WorkerServer's port (WorkerServer._server.bound_port)", exc)
        return None


def fit_epoch_iterator(depth: int = 16):
    """The `EpochIterator` of the running `fit`, from a callback's `on_train_begin`.

    Keras 3.15.1's `fit` (every backend) keeps it in the local
    `epoch_iterator` of its frame, the caller of
    `CallbackList.on_train_begin`; Keras offers no public way to it. Found
    on the call stack, as `surround_callbacks` finds the CallbackList.

    Returns:
        The iterator, or None (no `fit` on the stack: a custom loop).
    """
    try:
        from keras.src.trainers.epoch_iterator import EpochIterator
    except ImportError as exc:
        _off("keras.src.trainers.epoch_iterator.EpochIterator", exc)
        return None
    return _on_stack("epoch_iterator", lambda found: isinstance(found, EpochIterator), depth)


def time_batches(epoch_iterator, record, consumer: bool):
    """Calls `record(batch)` as each batch of `fit`'s data source becomes ready.

    Keras 3.15.1 fetches the batch inside `train_function`, between the
    begin and end hooks, with no hook of its own. Two places see it:

    - `consumer=True` (JAX, torch, numpy: the loop's thread takes each batch
      with `next()`): the iterators that `epoch_iterator._get_iterator()`
      returns (any data source) are wrapped, `record` runs when `next()`
      returns;
    - `consumer=False` (TensorFlow: a `tf.data` thread runs the Python
      source through `from_generator`): the data adapter's producer is
      wrapped, a `PyDatasetAdapter`'s `_standardize_batch` (with or without
      workers: it sees each batch once the queue handed it over) or a
      `GeneratorDataAdapter`'s `generator`. Arrays and `tf.data` datasets
      have no Python producer: None.

    Instance attributes shadow the methods, so nothing of Keras is changed
    for other iterators. Call before the first epoch's iterator is made
    (`on_train_begin`).

    Returns:
        A function that takes the wrappers out again, or None where no
        Python producer exists.
    """
    try:
        if consumer:
            return _wrap(epoch_iterator, "_get_iterator",
                         lambda get: lambda: _TimedIterator(get(), record))
        adapter = epoch_iterator.data_adapter
        if hasattr(adapter, "py_dataset") and callable(adapter._standardize_batch):
            def standardize(original):
                def timed(batch):
                    out = original(batch)
                    record(out)
                    return out
                return timed
            return _wrap(adapter, "_standardize_batch", standardize)
        if type(adapter).__name__ == "GeneratorDataAdapter" and callable(adapter.generator):
            return _wrap(adapter, "generator",
                         lambda make: lambda: _TimedIterator(make(), record))
        return None
    except AttributeError as exc:
        _off("the data adapter of fit's EpochIterator (_get_iterator, data_adapter)", exc)
        return None


def instrument_fit_dataset(epoch_iterator, instrument):
    """Makes the `tf.data` dataset TensorFlow's `fit` iterates pass through `instrument`.

    Keras 3.15.1's `TFEpochIterator` (TensorFlow backend) makes, in its
    `__init__`, `_distributed_dataset` from `data_adapter.get_tf_dataset()`
    (a `tf.data.Dataset` or `PyDataset` run through `from_generator`, arrays
    sliced by `tf.data`) with its strategy's `experimental_distribute_dataset`
    (the dataset itself under the default strategy), and `_get_iterator()`
    returns it at each epoch; the train function then takes each batch in its
    graph, where no Python sees it. Called before the first epoch's iterator
    (`on_train_begin`), this puts `instrument(dataset)` in its place, made
    the same way. A `tf.distribute.DistributedDataset` the user passed
    (nothing undistributed to instrument) is left alone.

    Args:
        epoch_iterator: `fit`'s epoch iterator (`fit_epoch_iterator()`).
        instrument: a function of the `tf.data.Dataset` returning the
            dataset to iterate, or None to leave it.

    Returns:
        A function that puts the user's dataset back, or None (nothing was
        changed: not TensorFlow's iterator, a distributed dataset, or
        `instrument` declined).
    """
    try:
        import tensorflow as tf

        current = epoch_iterator._distributed_dataset
        strategy = epoch_iterator._distribute_strategy
        if isinstance(current, tf.data.Dataset):
            dataset = current  # the default strategy keeps the dataset itself
        else:
            dataset = epoch_iterator.data_adapter.get_tf_dataset()
            if not isinstance(dataset, tf.data.Dataset):
                return None
        replaced = instrument(dataset)
        if replaced is None:
            return None
        if dataset is not current:
            replaced = strategy.experimental_distribute_dataset(replaced)
        epoch_iterator._distributed_dataset = replaced
    except (ImportError, AttributeError) as exc:
        _off("the dataset of fit's TFEpochIterator (_distributed_dataset, "
             "_distribute_strategy)", exc)
        return None

    def restore():
        if getattr(epoch_iterator, "_distributed_dataset", None) is replaced:
            epoch_iterator._distributed_dataset = current

    return restore


def data_source(epoch_iterator) -> tuple:
    """`(kind, workers)` of the data source `fit` reads through `epoch_iterator`.

    Keras 3.15.1: the kind is the class of `epoch_iterator.data_adapter`
    without `DataAdapter` / `Adapter` (`PyDataset`, `Generator`, `Array`,
    `TFDataset`, ...); `workers` is a `PyDataset`'s `workers` when Keras
    runs it through its queue of workers (`PyDatasetAdapter.enqueuer`),
    else None. `("unknown", None)` when the adapter is not where it was.
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None:
        _off("the data adapter of fit's EpochIterator (data_adapter)",
             AttributeError("no data_adapter"))
        return "unknown", None
    kind = type(adapter).__name__.replace("DataAdapter", "").replace("Adapter", "") or "unknown"
    workers = None
    if getattr(adapter, "enqueuer", None) is not None:
        workers = getattr(getattr(adapter, "py_dataset", None), "workers", None)
    return kind, workers


def time_train_function(model, stamp):
    """Calls `stamp()` each time `model.train_function` returns, in `fit`.

    Keras 3.15.1's `fit` on JAX, torch and NumPy looks `self.train_function`
    up at every step (`logs, state = self.train_function(state, iterator)`
    on JAX); `make_train_function` sets it before `on_train_begin`. On JAX it
    returns once the step is dispatched. The wrapper is an instance
    attribute of the same name and calls the original unchanged.

    Returns:
        A function that puts the original back, or None (no train function).
    """
    original = getattr(model, "train_function", None)
    if not callable(original):
        return None

    def timed(*args, **kwargs):
        out = original(*args, **kwargs)
        stamp()
        return out

    timed.__wrapped__ = original
    model.train_function = timed

    def restore():
        if getattr(model, "train_function", None) is timed:
            model.train_function = original

    return restore


def time_iterator_launches(stamp):
    """Calls `stamp()` as each TensorFlow step that reads an iterator in its graph starts.

    Keras 3.15.1's TensorFlow `fit` takes each batch inside the train
    function: `multi_step_on_iterator`, a `tf.function` of the iterator,
    runs `iterator.get_next()` in its graph, so no Python runs when a step
    asks for its batch. The last Python before it is the call that hands
    the function's graph to the runtime, `Context.call_function` (after
    Keras's and the `tf.function`'s own dispatch: 0.4-0.5 ms of each step on
    a 2-core AMD EPYC host, more on a slower or busier CPU), with the
    function's generated name, `__inference_multi_step_on_iterator_<n>`
    (evaluation's too). Checked on Keras 3.15.1, TensorFlow 2.21.0.
    The context's `call_function` is shadowed by an instance attribute
    that calls `stamp()` before it for those functions only (a name test
    per `tf.function` call, on any thread); nothing of TensorFlow changes
    otherwise. Where Keras takes its batches in Python (`run_eagerly`,
    `train_on_batch`, a Python iterator) no such function runs.

    Returns:
        A function that takes the wrapper out again, or None (TensorFlow
        not imported, or its eager context is not where it was).
    """
    try:
        from tensorflow.python.eager import context

        ctx = context.context()
        original = ctx.call_function
    except (ImportError, AttributeError) as exc:
        _off("tensorflow.python.eager.context.Context.call_function", exc)
        return None
    # One wrapper at a time: a run that ended by an exception left its own.
    original = getattr(original, "launches_of", original)

    def call_function(name, tensor_inputs, num_outputs):
        if b"multi_step_on_iterator" in (name if isinstance(name, bytes) else b""):
            try:
                stamp()
            except Exception:  # a monitor must never stop training
                pass
        return original(name, tensor_inputs, num_outputs)

    call_function.launches_of = original
    ctx.call_function = call_function

    def restore():
        if vars(ctx).get("call_function") is call_function:
            del ctx.call_function

    return restore


def _wrap(owner, name, wrapper):
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))

    def restore():
        if name in vars(owner):
            delattr(owner, name)

    return restore


def keras_trainer_source() -> "str | None":
    """The source file of Keras's `Trainer` (`keras/src/trainers/trainer.py`),
    whose `fit` and `compile` are `keras.Model`'s on every backend, found
    without importing Keras (importing Keras imports its backend). None
    where Keras is not installed or the file is not there."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("keras")
    for folder in (spec and spec.submodule_search_locations) or ():
        path = os.path.join(folder, "src", "trainers", "trainer.py")
        if os.path.isfile(path):
            return path
    return None


class _TimedIterator:
    """An iterator that calls `record(batch)` when each `next()` returns."""

    def __init__(self, iterable, record):
        self._it = iter(iterable)
        self._record = record

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        self._record(batch)
        return batch
