"""`compile_model`: `model.compile` with XLA, mixed precision and
`steps_per_execution` that really take effect, and a record of what did.

Keras 3 (TensorFlow backend) has traps that cost speed silently:

- `jit_compile="auto"` resolves to no XLA on CPU-only machines, under any
  `tf.distribute` strategy and when one layer says it does not support jit;
  and `jit_compile=True` under `MirroredStrategy` fails at the first step
  ("Trying to access resource ... located in device ...:1 from device ...:0")
  because Keras wraps the whole replicated step, all devices together, in one
  XLA cluster. `compile_model` compiles each replica's forward and backward
  pass with XLA instead, with the gradient all-reduce and the optimizer update
  outside XLA, and checks on a real batch what the traced train function
  really runs.
- A dtype policy only applies to layers created after it is set.
- Keras 3 has no `steps_per_execution` tuner; `compile_model` measures the
  per-execution overhead on a sample batch and picks the value.

Choices are logged on the `keras_gpufix.compile` logger; problems that were
worked around are one `GpufixWarning` each.
"""

import dataclasses
import inspect
import logging
import math
import re
import statistics
import time
import warnings
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from keras_gpufix.exceptions import GpufixWarning
from keras_gpufix.compile.hardware import auto_policy, device_info
from keras_gpufix.keras_internals import (
    concrete_functions,
    flatten_layers,
    in_multi_worker_mode,
    closure_cell,
    overrides_train_step,
    set_symbolic_build,
    symbolic_build,
    traced_functions,
)

__all__ = ["CompileReport", "compile_model", "device_info", "enable_mixed_precision"]

logger = logging.getLogger(__name__)

_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
_MIXED_ARGS = ("auto", None) + _POLICIES

# steps_per_execution calibration: the value is the smallest power of two
# that brings the measured per-execution overhead under `_TARGET_OVERHEAD` of
# the execution's time, capped so callbacks still fire at least every
# `_MAX_EXECUTION_S` seconds and at `_MAX_STEPS_PER_EXECUTION`.
_TARGET_OVERHEAD = 0.05
_MAX_EXECUTION_S = 1.0
_MAX_STEPS_PER_EXECUTION = 64
_CALIBRATION_CALLS = (9, 3)  # timed calls of 1 step and of K steps


@dataclasses.dataclass
class CompileReport:
    """What `compile_model` set, as really used by the compiled train step.

    Attributes:
        jit_compile: whether the train step runs XLA-compiled. With a
            `sample_batch` this is read from the traced train function (its
            `_XlaMustCompile` calls), not from the argument.
        policy: the dtype policy the model's layers compute in, e.g.
            `"mixed_bfloat16"`.
        loss_scaling: whether the optimizer is a `LossScaleOptimizer`
            (exactly one) because layers compute in float16.
        steps_per_execution: the value set on the model.
        fallback_reason: why XLA was requested but is not used, or None.
        xla_scope: `"step"` (Keras compiles the whole step), `"per_replica"`
            (each replica's forward and backward pass; all-reduce and optimizer
            update outside XLA) or None.
        xla_devices: devices of the XLA-compiled calls in the traced train
            function (`"default"` where the call is not pinned to a device);
            empty when not verified or not compiled.
        verified: whether a train step ran on `sample_batch`.
        num_replicas: replicas in sync of the model's strategy.
        calibration: the `steps_per_execution` measurement (seconds): one
            execution of 1 step, of `k` steps, the derived fixed overhead per
            execution and time per step; None when not measured.
        reason: one line per choice, saying which and why.
    """

    jit_compile: bool
    policy: str
    loss_scaling: bool
    steps_per_execution: int
    fallback_reason: Optional[str] = None
    xla_scope: Optional[str] = None
    xla_devices: tuple = ()
    verified: bool = False
    num_replicas: int = 1
    calibration: Optional[dict] = None
    reason: str = ""

    def __str__(self):
        lines = [
            f"jit_compile={self.jit_compile} ({self.xla_scope or 'off'}"
            f"{', verified' if self.verified else ', not verified'})",
            f"policy={self.policy} loss_scaling={self.loss_scaling}",
            f"steps_per_execution={self.steps_per_execution}",
        ]
        return "\n".join(lines + self.reason.splitlines())


def enable_mixed_precision(policy: str = "auto") -> str:
    """Sets the global Keras dtype policy; call it before building the model.

    `"auto"` picks `"mixed_bfloat16"` where the device computes bfloat16 fast
    (NVIDIA compute capability >= 8.0, CPUs with AMX-BF16),
    `"mixed_float16"` on older GPUs with tensor cores (compute capability
    7.x; Keras adds dynamic loss scaling) and `"float32"` where neither helps.
    Layers built before the call keep their policy (`compile_model` warns).

    Args:
        policy: `"auto"`, `"float32"`, `"mixed_float16"` or
            `"mixed_bfloat16"`. Defaults to `"auto"`.

    Returns:
        The policy name set.

    Raises:
        ValueError: for another `policy`.

    Example:
    ```python
    kg.enable_mixed_precision()          # before the model is built
    model = build_model()
    ```
    """
    if policy == "auto":
        policy, why = auto_policy()
    elif policy in _POLICIES:
        why = "requested"
    else:
        raise ValueError(
            "`policy` must be one of 'auto', "
            f"{', '.join(repr(p) for p in _POLICIES)}. Received: policy={policy!r}"
        )
    keras.mixed_precision.set_global_policy(policy)
    logger.info("enable_mixed_precision: %s (%s)", policy, why)
    return policy


def compile_model(
    model,
    optimizer,
    loss,
    metrics=None,
    *,
    jit_compile: bool = True,
    mixed_precision: Optional[str] = "auto",
    steps_per_execution="auto",
    sample_batch=None,
    **compile_kwargs,
) -> CompileReport:
    """Calls `model.compile` with every speed setting explicit and checked.

    - `jit_compile=True` is set explicitly (Keras's `"auto"` turns XLA off on
      CPU and under strategies). Under `MirroredStrategy` /
      `MultiWorkerMirroredStrategy` each replica's forward and backward pass
      is XLA-compiled and the all-reduce and optimizer update run outside XLA
      (Keras's own `jit_compile=True` fails there). With `sample_batch`, one
      train step runs: if XLA fails, the model falls back to graph mode with
      a `GpufixWarning` naming the op and layer, and the report says what the
      traced train function really uses.
    - The layers' compute dtype is checked against the policy
      (`mixed_precision`); a mismatch warns with the fix. Float16 layers get
      exactly one `LossScaleOptimizer`.
    - `steps_per_execution="auto"` times executions of 1 and of 16 steps on
      `sample_batch` and picks the smallest power of two that keeps the
      per-execution overhead under 5 % (at most 64, at most about one
      second per execution, and, when `sample_batch` is a dataset of known
      length, at most an eighth of an epoch). Callbacks (`on_train_batch_*`, the progress
      bar) then fire once per execution.

    Weights, optimizer state and metrics are restored after the sample steps
    (by assignment), and the train function they traced and XLA-compiled is
    kept: `fit` on batches of the sample batch's spec and shape (a dataset
    `sample_batch`: its element spec) traces and compiles nothing more.
    Setting `model.steps_per_execution` afterwards is honoured (the loop is
    rebuilt around the same compiled step).
    Under `MultiWorkerMirroredStrategy` every worker must call
    `compile_model` with the same arguments (the steps are collective); the
    workers agree on the largest calibrated value.

    Args:
        model: a Keras model, built under the strategy's scope if any.
        optimizer, loss, metrics: as for `model.compile`.
        jit_compile: bool. Defaults to True.
        mixed_precision: the policy the built layers are checked against
            (the check never changes them: weights keep the dtype they were
            built in; call `enable_mixed_precision` before building).
            `"auto"` (the global policy where one was set, else what
            `enable_mixed_precision("auto")` would pick), a policy name,
            or None to skip the check. Defaults to `"auto"`.
        steps_per_execution: `"auto"` or a positive int. `"auto"` without
            `sample_batch` uses 1 and warns. Defaults to `"auto"`.
        sample_batch: `(x, y)` or `(x, y, sample_weight)` of the size used in
            training, or a `tf.data.Dataset` (its first batch). Defaults to
            None (nothing is run).
        **compile_kwargs: passed to `model.compile`.

    Returns:
        A `CompileReport`.

    Raises:
        ValueError: for an invalid argument value.

    Example:
    ```python
    report = kg.compile_model(model, "adam", "mse", sample_batch=(x[:32], y[:32]))
    print(report)
    ```
    """
    _check_args(jit_compile, mixed_precision, steps_per_execution, sample_batch,
                compile_kwargs)
    batch = _first_batch(sample_batch)
    strategy = model.distribute_strategy
    replicas = int(strategy.num_replicas_in_sync)
    reasons = []

    policy, loss_scaling, optimizer = _resolve_precision(
        model, optimizer, mixed_precision, compile_kwargs, reasons
    )
    scope = "per_replica" if _is_mirrored(strategy) else "step"
    fallback = None
    if jit_compile:
        fallback = _static_jit_blocker(model, scope, strategy, compile_kwargs)
        if fallback:
            _warn_fallback(fallback, stacklevel=3)
    use_jit = bool(jit_compile) and fallback is None

    compile_kwargs.setdefault("auto_scale_loss", False)
    with strategy.scope():
        model.compile(
            optimizer=optimizer,
            loss=loss,
            metrics=metrics,
            jit_compile=use_jit and scope == "step",
            steps_per_execution=(
                1 if steps_per_execution == "auto" else steps_per_execution
            ),
            **compile_kwargs,
        )
    if use_jit and scope == "per_replica":
        _install_per_replica_xla(model)
    if _is_multi_worker(strategy):
        _install_multi_worker_fixes(model)

    report = CompileReport(
        jit_compile=use_jit,
        policy=policy,
        loss_scaling=loss_scaling,
        steps_per_execution=model.steps_per_execution,
        fallback_reason=fallback,
        xla_scope=scope if use_jit else None,
        num_replicas=replicas,
    )
    if batch is not None:
        _run_sample_steps(model, batch, strategy, report, steps_per_execution,
                          _epoch_steps(sample_batch), _element_spec(sample_batch))
    elif model.steps_per_execution > 1 and _is_mirrored(strategy) and replicas > 1:
        model.steps_per_execution = report.steps_per_execution = 1
        _warn_steps(
            f"steps_per_execution={steps_per_execution} was not verified (no "
            "sample_batch) and fails under this strategy in Keras "
            f"{keras.__version__}; pass sample_batch= to verify it",
            strategy, stacklevel=3,
        )
    elif steps_per_execution == "auto":
        warnings.warn(
            "compile_model: steps_per_execution='auto' measures on a batch; "
            "none was given, so steps_per_execution=1. Pass "
            "sample_batch=(x, y) (a batch of the training size) to calibrate "
            "it, or pass an int.",
            GpufixWarning,
            stacklevel=2,
        )
        reasons.append("steps_per_execution=1: not measured (no sample_batch)")

    reasons.insert(0, _jit_reason(report, jit_compile, strategy, sample_batch is not None))
    report.reason = "\n".join(reasons)
    logger.info("compile_model: %s", str(report).replace("\n", "; "))
    return report


# -- arguments -----------------------------------------------------------------


def _check_args(jit_compile, mixed_precision, steps_per_execution,
                sample_batch, compile_kwargs):
    if not isinstance(jit_compile, bool):
        raise ValueError(
            f"`jit_compile` must be True or False. Received: jit_compile={jit_compile!r}"
        )
    if mixed_precision not in _MIXED_ARGS:
        raise ValueError(
            "`mixed_precision` must be 'auto', None or one of "
            f"{', '.join(repr(p) for p in _POLICIES)}. "
            f"Received: mixed_precision={mixed_precision!r}"
        )
    if steps_per_execution != "auto" and not (
        isinstance(steps_per_execution, int)
        and not isinstance(steps_per_execution, bool)
        and steps_per_execution >= 1
    ):
        raise ValueError(
            "`steps_per_execution` must be 'auto' or an int >= 1. "
            f"Received: steps_per_execution={steps_per_execution!r}"
        )
    if sample_batch is not None and not (
        isinstance(sample_batch, tf.data.Dataset)
        or (isinstance(sample_batch, (tuple, list)) and len(sample_batch) in (2, 3))
    ):
        raise ValueError(
            "`sample_batch` must be (x, y), (x, y, sample_weight) or a "
            f"tf.data.Dataset. Received: sample_batch of type {type(sample_batch).__name__}"
        )
    for name in ("jit_compile", "steps_per_execution"):
        if name in compile_kwargs:
            raise ValueError(f"Pass `{name}` once. Received it in compile_kwargs.")


def _first_batch(sample_batch):
    if sample_batch is None:
        return None
    if isinstance(sample_batch, tf.data.Dataset):
        for element in sample_batch.take(1):
            sample_batch = element
            break
        else:
            raise ValueError("`sample_batch` is an empty tf.data.Dataset.")
        if not isinstance(sample_batch, (tuple, list)) or len(sample_batch) not in (2, 3):
            raise ValueError(
                "`sample_batch` must yield (x, y) or (x, y, sample_weight). "
                f"Received an element of type {type(sample_batch).__name__}"
            )
    return tuple(sample_batch)


# -- mixed precision -------------------------------------------------------------


def _weighted_leaf_layers(model):
    layers = []
    for layer in flatten_layers(model):
        leaf = not flatten_layers(layer, recursive=False)
        if leaf and layer.weights:
            layers.append(layer)
    return layers


def _majority(values):
    values = list(values)
    return max(dict.fromkeys(values), key=values.count)


def _resolve_precision(model, optimizer, mixed_precision, compile_kwargs, reasons):
    """Checks the layers' compute dtype; returns (policy, loss_scaling, optimizer)."""
    layers = _weighted_leaf_layers(model)
    if layers:
        policy = _majority(layer.dtype_policy.name for layer in layers)
        compute = _majority(layer.compute_dtype for layer in layers)
    else:
        policy, compute = model.dtype_policy.name, model.compute_dtype

    if mixed_precision is not None:
        global_policy = keras.mixed_precision.global_policy().name
        if mixed_precision != "auto":
            target, why = mixed_precision, "requested"
        elif global_policy != "float32":
            target, why = global_policy, "the global policy"
        else:
            target, why = auto_policy()
        wanted = keras.DTypePolicy(target).compute_dtype
        off = [layer.name for layer in layers if layer.compute_dtype != wanted]
        if compute != wanted:
            warnings.warn(
                f"compile_model: mixed_precision={mixed_precision!r} wants "
                f"{target} ({why}), but {len(off)} of {len(layers)} layers with "
                f"weights compute in another dtype (e.g. {off[:3]}): a dtype "
                "policy only applies to layers built after it is set. Call "
                f"kg.enable_mixed_precision({target!r}) before building the "
                "model, or pass mixed_precision=None to keep it as it is.",
                GpufixWarning,
                stacklevel=3,
            )
        reasons.append(f"policy={policy}: model layers; wanted {target} ({why})")
    else:
        reasons.append(f"policy={policy}: model layers (not checked)")

    with model.distribute_strategy.scope():
        optimizer = keras.optimizers.get(optimizer)
    is_lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    float16 = any(layer.compute_dtype == "float16" for layer in layers)
    if is_lso:
        reasons.append("loss scaling: the LossScaleOptimizer passed in")
    elif float16 and optimizer.loss_scale_factor is not None:
        reasons.append(
            f"loss scaling: static, loss_scale_factor={optimizer.loss_scale_factor}"
        )
    elif float16 and compile_kwargs.get("auto_scale_loss", True):
        with model.distribute_strategy.scope():
            optimizer = keras.optimizers.LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer"
            )
        is_lso = True
        reasons.append("loss scaling: dynamic (LossScaleOptimizer), float16 layers")
    elif float16:
        reasons.append("loss scaling: none (auto_scale_loss=False) with float16 layers")
    return policy, is_lso, optimizer


# -- XLA ---------------------------------------------------------------------------


def _is_mirrored(strategy):
    return isinstance(
        strategy,
        (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy),
    )


def _static_jit_blocker(model, scope, strategy, compile_kwargs):
    """Why XLA cannot be used before anything runs, or None."""
    if compile_kwargs.get("run_eagerly"):
        return "run_eagerly=True (eager steps are never XLA-compiled)"
    no_jit = [
        layer.name
        for layer in flatten_layers(model)
        if not getattr(layer, "supports_jit", True)
    ]
    if no_jit:
        return f"layers declare supports_jit=False: {no_jit}"
    if scope == "per_replica":
        if overrides_train_step(model):
            return (
                f"{type(model).__name__} overrides train_step; under "
                f"{type(strategy).__name__} only Keras's own train_step can be "
                "XLA-compiled per replica"
            )
    return None


def _install_per_replica_xla(model):
    """Replaces `model.train_step` by one whose forward/backward is XLA-compiled.

    Runs inside `strategy.run`, so each replica compiles its own cluster on its
    own device; the all-reduce (a cross-replica `merge_call`) and the
    optimizer update stay outside XLA, where `tf.distribute` needs them.
    Keras has no public way to compile only part of its step, so this is a
    copy of Keras 3.15.1's `TensorFlowTrainer.train_step` through public
    names (`model.compute_loss`, `model.metrics`, `optimizer.scale_loss`);
    `tests/test_compile.py` checks it against Keras's own step.
    """
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
        _loss_metric(model).update_state(
            loss * tf.cast(replicas, loss.dtype),  # the replica's share, unscaled
            sample_weight=_batch_size(x),
        )
        model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return _with_replica_axis(logs) if multi_worker else logs

    multi_worker = _is_multi_worker(model.distribute_strategy)
    model.train_step = train_step


def _loss_metric(model):
    """The compiled model's loss tracker: the metric `fit` logs as "loss"."""
    return next(m for m in model.metrics if m.name == "loss")


def _batch_size(x):
    """Rows in the batch, from its first input that is not None (keras-team/keras#21630)."""
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _is_multi_worker(strategy):
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and in_multi_worker_mode(strategy)


def _with_replica_axis(logs):
    return tf.nest.map_structure(
        lambda t: tf.reshape(t, [1]) if t.shape.rank == 0 else t, logs
    )


def _install_multi_worker_fixes(model):
    """Makes Keras 3 `fit`/`evaluate` run under a multi-worker
    MultiWorkerMirroredStrategy (tensorflow/tensorflow#72388).

    Keras reduces each scalar log with `strategy.reduce("MEAN", v, axis=0)`
    there, which fails on 0-d values, so the steps give scalars a length-1
    axis; and `fit` starts by reducing a distributed input batch in eager
    mode, which fails too, so the symbolic build reads the local batch.
    """
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


def _remove_per_replica_xla(model):
    model.__dict__.pop("train_step", None)
    if _is_multi_worker(model.distribute_strategy):
        _install_multi_worker_fixes(model)


def _xla_calls(model):
    """(device, callee) of every `_XlaMustCompile` call in the traced train function.

    None when the traced functions cannot be read (not verified).
    """
    calls = set()
    functions = traced_functions(model.train_function)
    if not functions:
        return None
    for fn in functions.values():
        concretes = concrete_functions(fn)
        if concretes is None:
            return None
        for concrete in concretes:
            graph_def = concrete.graph.as_graph_def()
            nodes = list(graph_def.node)
            for func in graph_def.library.function:
                nodes.extend(func.node_def)
            for node in nodes:
                attr = node.attr.get("_XlaMustCompile")
                if attr is not None and attr.b:
                    device = _short_device(node.device) or "default"
                    calls.add((device, node.attr["f"].func.name))
    return sorted(calls)


def _short_device(device):
    match = re.search(r"device:([A-Z]+:\d+)", device or "")
    if match is None:
        return device or ""
    task = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", device)
    if task and task.group(1) != "localhost":
        return f"{task.group(1)}:{task.group(2)}/{match.group(1)}"
    return match.group(1)


def _describe_xla_error(model, exc):
    """One line naming the op (and layer) XLA could not compile."""
    text = str(exc)
    ops = re.search(
        r"Detected unsupported operations when trying to compile graph \S+ on "
        r"(\S+): (.+?)(?:\n|$)",
        text,
    )
    node = re.search(r"\{\{node ([^}]+)\}\}", text)
    layer = None
    if node:
        parts = node.group(1).split("/")
        for candidate in flatten_layers(model):
            pattern = re.escape(candidate.name) + r"(_\d+)?"
            if any(re.fullmatch(pattern, part) for part in parts):
                layer = candidate.name
    if ops:
        op_names = sorted(set(re.findall(r"(\w+) \(No registered", ops.group(2))))
        where = f" in layer '{layer}'" if layer else ""
        at = f" (node {node.group(1)})" if node else ""
        return (
            f"XLA ({ops.group(1)}) cannot compile op {', '.join(op_names) or ops.group(2)[:80]}"
            f"{where}{at}"
        )
    where = f" (layer '{layer}')" if layer else ""
    return f"the XLA-compiled step failed: {_first_line(exc)}{where}"


def _warn_fallback(reason, stacklevel):
    warnings.warn(
        f"compile_model: XLA is off, training runs in graph mode: {reason}.",
        GpufixWarning,
        stacklevel=stacklevel,
    )


def _jit_reason(report, requested, strategy, sampled):
    name = type(strategy).__name__
    if report.jit_compile:
        where = (
            f"each of {report.num_replicas} replicas ({name}); all-reduce and "
            "optimizer update outside XLA"
            if report.xla_scope == "per_replica"
            else "the whole train step"
        )
        seen = (
            f"verified on the sample batch: XLA calls on {list(report.xla_devices)}"
            if report.verified
            else "not verified (" + ("the traced step could not be read on this Keras"
                                     if sampled else "no sample_batch") + ")"
        )
        return f"jit_compile=True: XLA compiles {where}; {seen}"
    if not requested:
        return "jit_compile=False: requested"
    return f"jit_compile=False: {report.fallback_reason}"


# -- sample steps: verification and steps_per_execution ------------------------------


def _epoch_steps(sample_batch):
    """Batches per epoch of a dataset `sample_batch` when known, else None."""
    if isinstance(sample_batch, tf.data.Dataset):
        n = int(sample_batch.cardinality())
        return n if n > 0 else None
    return None


def _element_spec(sample_batch):
    """The element spec `fit` will see for a dataset `sample_batch`, else None.

    The sample steps feed batches with this spec, so the traced step is the
    one `fit` on that dataset calls (same concrete function, same XLA
    executable for the sample batch's shape).
    """
    if not isinstance(sample_batch, tf.data.Dataset):
        return None
    spec = sample_batch.element_spec
    if all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        return spec
    return None


def _run_sample_steps(model, batch, strategy, report, steps_per_execution,
                      epoch_steps, element_spec):
    with strategy.scope():
        symbolic_build(model, batch)
    variables = list(model.variables) + list(model.optimizer.variables)
    saved = [v.numpy() for v in variables]
    try:
        target = (
            _MAX_STEPS_PER_EXECUTION if steps_per_execution == "auto"
            else model.steps_per_execution
        )
        run, loop_error, error = _first_working(model, batch, strategy, target,
                                                element_spec)
        if run is None:
            if not report.jit_compile:
                raise error
            reason = _describe_xla_error(model, error)
            _remove_per_replica_xla(model)
            model.jit_compile = False
            report.jit_compile, report.xla_scope = False, None
            run, loop_error, error = _first_working(model, batch, strategy, target,
                                                    element_spec)
            if run is None:
                raise error  # fails without XLA too: not an XLA problem
            report.fallback_reason = reason
            _warn_fallback(reason, stacklevel=4)
        calls = _xla_calls(model)
        report.verified = calls is not None
        report.xla_devices = tuple(device for device, _ in calls or ())
        if report.jit_compile and report.verified and not report.xla_devices:
            report.jit_compile, report.xla_scope = False, None
            report.fallback_reason = "the traced train function has no XLA call"
        if loop_error is not None:
            report.steps_per_execution = 1
            _warn_steps(
                f"a train function with steps_per_execution={target} failed on "
                f"the sample batch ({_first_line(loop_error)})",
                strategy, stacklevel=4,
            )
        elif steps_per_execution == "auto":
            report.calibration = run.calibrate()
            report.steps_per_execution = _choose_steps(report.calibration, strategy,
                                                       epoch_steps)
            report.calibration["chosen"] = report.steps_per_execution
    except BaseException:
        _restore(model, variables, saved)
        model.steps_per_execution = report.steps_per_execution
        model.train_function = None
        raise
    _restore(model, variables, saved)
    _keep_train_function(model, model.train_function, run.k, report.steps_per_execution)


def _restore(model, variables, saved):
    for variable, value in zip(variables, saved):
        variable.assign(value)  # assignment keeps the traced functions valid
    model.reset_metrics()


# -- the train function fit reuses ----------------------------------------------------


def _keep_train_function(model, function, built_for, k):
    """Leaves `model.train_function` ready for `fit` with `steps_per_execution=k`.

    `function` is the train function the sample steps traced (and
    XLA-compiled) for `built_for` steps per execution. Keras bakes
    `steps_per_execution` into the traced loop, so for another `k` the loop
    is built again around the same `one_step_on_data` `tf.function`: its
    traces, and the XLA executable compiled per function and shape, are
    reused, so `fit` on batches of the sample batch's spec and shape compiles
    nothing. The kept function rebuilds itself the same way when
    `model.steps_per_execution` is changed later.
    """
    model.steps_per_execution = k
    if k != built_for:
        function = _rebuild_sharing_step(model, function)

    def train_function(iterator):
        if model.steps_per_execution != k:
            _keep_train_function(model, function, k, model.steps_per_execution)
            return model.train_function(iterator)
        return function(iterator)

    train_function.__wrapped__ = function
    model.train_function = train_function


def _rebuild_sharing_step(model, old):
    """A new Keras train function whose loop calls `old`'s traced step."""
    model.make_train_function(force=True)
    new = model.train_function
    step = closure_cell(old, "one_step_on_data")
    multi = closure_cell(new, "multi_step_on_iterator")
    loop = getattr(multi.cell_contents, "python_function", None) if multi else None
    cells = [
        closure_cell(new, "one_step_on_data"),
        closure_cell(inspect.unwrap(loop), "one_step_on_data") if loop else None,
    ]
    if step is None or None in cells:  # closure_cell warned: fit traces its step again
        return new
    for cell in cells:  # not traced yet: the loop will call the old step
        cell.cell_contents = step.cell_contents
    return new


def _first_working(model, batch, strategy, k, element_spec=None):
    """(runner, loop_error, error): a runner whose step ran, trying `k` then 1.

    `loop_error` is the failure of the `k`-step loop when only 1 worked;
    `error` the failure of the last attempt when none did (runner None).
    """
    loop_error = None
    for attempt in dict.fromkeys((k, 1)):
        try:
            run = _SampleRunner(model, batch, strategy, attempt, element_spec)
            run.step()
            return run, loop_error, None
        except Exception as exc:  # classified by the caller
            if attempt != 1:
                loop_error = exc
            error = exc
    return None, None, error


def _first_line(exc):
    """The line of a TensorFlow error that says what went wrong."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if line.startswith("[[") and i > 0 and not lines[i - 1].startswith("[["):
            message = lines[i - 1]
            break
    else:
        message = lines[0] if lines else ""
    message = re.sub(r"^\(\d+\) ", "", message)
    return f"{type(exc).__name__}: {message[:200]}"


def _warn_steps(why, strategy, stacklevel):
    known = (
        " Keras 3 puts strategy.run inside a tf.cond in its multi-step loop, "
        f"which {type(strategy).__name__} cannot run (keras-team/keras#19246)."
        if _is_mirrored(strategy) and strategy.num_replicas_in_sync > 1
        else ""
    )
    warnings.warn(
        f"compile_model: steps_per_execution=1 because {why}.{known}",
        GpufixWarning,
        stacklevel=stacklevel,
    )


class _SampleRunner:
    """Runs Keras's train function built with `steps_per_execution=k` on
    iterators of n copies of the batch (Keras's loop stops when the iterator
    ends, so one build, one trace and one XLA compile time both 1 and k
    steps per execution).

    The batches carry `element_spec` (the training dataset's, with its
    unknown dimensions) when given, and go through the strategy's
    `experimental_distribute_dataset` as in `fit`, so `fit` calls the step
    traced here."""

    def __init__(self, model, batch, strategy, k, element_spec=None):
        self.model, self.batch, self.strategy, self.k = model, batch, strategy, k
        self.element_spec = element_spec
        try:
            tf.nest.assert_same_structure(tuple(batch), tuple(element_spec or batch))
        except (TypeError, ValueError):
            self.element_spec = None  # the batch's own static shapes then
        model.steps_per_execution = k
        model.make_train_function(force=True)

    def _iterator(self, n):
        ds = tf.data.Dataset.from_tensors(self.batch)
        if self.element_spec is not None:
            ds = ds.map(self._relax)
        ds = ds.repeat(n)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF
        )
        ds = self.strategy.experimental_distribute_dataset(ds.with_options(options))
        return iter(ds)

    def _relax(self, *element):
        return tf.nest.map_structure(
            lambda t, spec: tf.raw_ops.PlaceholderWithDefault(input=t, shape=spec.shape),
            element, tuple(self.element_spec),
        )

    def step(self, n=1, iterator=None):
        logs = self.model.train_function(iterator or self._iterator(n))
        for value in tf.nest.flatten(logs):
            np.asarray(value)  # waits for the device
        return logs

    def _time(self, n, calls):
        iterators = [self._iterator(n) for _ in range(calls)]
        times = []
        for iterator in iterators:
            start = time.perf_counter()
            self.step(iterator=iterator)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def calibrate(self):
        k = min(self.k, 16)
        self.step(k)  # warm: the loop with k steps
        t1 = self._time(1, _CALIBRATION_CALLS[0])
        tk = self._time(k, _CALIBRATION_CALLS[1])
        step = max((tk - t1) / (k - 1), 1e-7)
        overhead = max(t1 - step, 0.0)
        return {"t_1": t1, "k": k, "t_k": tk, "overhead_s": overhead, "step_s": step}


def _choose_steps(calibration, strategy, epoch_steps=None):
    overhead, step = calibration["overhead_s"], calibration["step_s"]
    f = _TARGET_OVERHEAD
    needed = overhead * (1 - f) / (f * step)
    k = 1 if needed <= 1 else 2 ** math.ceil(math.log2(needed))
    cap = max(1, min(_MAX_STEPS_PER_EXECUTION, int(_MAX_EXECUTION_S / step)))
    k = min(k, cap)
    if epoch_steps is not None:
        # Callbacks fire once per execution: keep at least 8 per epoch.
        k = max(1, min(k, 2 ** int(math.log2(max(1, epoch_steps // 8)))))
        calibration["epoch_steps"] = epoch_steps
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        k = int(strategy.reduce(
            "MAX", strategy.run(lambda: tf.constant(k, tf.int64)), axis=None
        ))
    return k
