"""`compile_model` and its `CompileReport`: the entry that runs the concerns in order.

`compile_model` is `model.compile` with the arguments it chose, then the
checks that they took: the precision check (`precision`), the XLA decision
and what the traced step really compiles (`verification`), the sample steps
that verify the step and measure `steps_per_execution` (`calibration`), then
one report. The per-replica XLA step and the multi-worker fixes need Keras
internals: they are `keras_internals` functions.
"""

import dataclasses
import logging
import time
from typing import Optional

import keras
import tensorflow as tf

from keras_gpufix.backends import name as backend_name
from keras_gpufix.compile import tensorflow_only
from keras_gpufix.compile.arguments import check_args
from keras_gpufix.compile.calibration import (
    MAX_STEPS_PER_EXECUTION,
    choose_steps,
    first_working,
)
from keras_gpufix.compile.compile_cache import CompileCache
from keras_gpufix.compile.precision import check_precision
from keras_gpufix.compile.verification import (
    describe_xla_error,
    first_line,
    jit_reason,
    static_jit_blocker,
    warn_fallback,
    xla_calls,
)
from keras_gpufix.exceptions import warn
from keras_gpufix.keras_internals import (
    in_multi_worker_mode,
    install_multi_worker_fixes,
    install_per_replica_xla,
    remove_per_replica_xla,
    symbolic_build,
    trace_from_aligned_ids,
)

__all__ = ["CompileReport", "compile_model"]

logger = logging.getLogger("keras_gpufix.compile")


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
        steps_per_execution: the value set on the model (an int; with
            `"auto"` and a `sample_batch`, the measured one).
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
        compile_cache: the persistent XLA compile cache (`CompileCache`):
            `directory` (None when off), `active`, `note` (why it is off, with
            how to turn it on) and `entries` (in the folder after the sample
            steps); None when XLA was not asked.
        compiles: the sample steps' XLA compiles, one dict per input shape:
            `shape` (of each input tensor), `seconds` (the first step's time
            over a steady step's: tracing and compiling, or tracing and
            loading from the cache), `from_cache` (True: loaded from the
            compile cache, no entry written; False: compiled afresh) and
            `kept` (whether the cache keeps it for later runs).
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
    compile_cache: Optional[dict] = None
    compiles: list = dataclasses.field(default_factory=list)
    reason: str = ""

    def __str__(self):
        lines = [
            f"jit_compile={self.jit_compile} ({self.xla_scope or 'off'}"
            f"{', verified' if self.verified else ', not verified'})",
            f"policy={self.policy} loss_scaling={self.loss_scaling}",
            f"steps_per_execution={self.steps_per_execution}",
        ] + [f"compile {c['shape']}: {c['seconds']:.2f} s, "
             + ("from the compile cache" if c["from_cache"] else "fresh")
             + ("" if c["kept"] else " (not kept across runs)") for c in self.compiles]
        return "\n".join(lines + self.reason.splitlines())


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
    compile_cache="auto",
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
      (`mixed_precision`); a mismatch warns with the fix, except with
      `"auto"` and no global policy set (a model built first, the defaults):
      the report then says what `"auto"` would pick here, and the note is
      printed once per process. Float16 layers get exactly one
      `LossScaleOptimizer`.
    - With XLA, compiles are kept across runs (`compile_cache`, see
      `CompileCache`): a restarted run loads each shape's executable
      instead of compiling it. On TensorFlow this takes effect only when it
      was turned on before TensorFlow started (`kg.from_config` does); the
      report's `compile_cache` note says how otherwise. With `sample_batch`
      the report gives the seconds of each compile, fresh or from the cache.
    - `steps_per_execution="auto"` times executions of 1 and of 16 steps on
      `sample_batch` and picks the smallest power of two that keeps the
      per-execution overhead under 5 % (at most 64, at most about one
      second per execution, and, when `sample_batch` is a dataset of known
      length, at most an eighth of an epoch). Callbacks (`on_train_batch_*`, the progress
      bar) then fire once per execution.

    Weights, optimizer state and metrics are restored after the sample steps
    (by assignment). When the measured `steps_per_execution` differs from the
    one the sample steps ran (16 with `"auto"`), the train function is made
    again for it (`model.make_train_function(force=True)`), so `fit` traces
    and XLA-compiles its step once more: Keras bakes `steps_per_execution`
    into the traced loop and has no public way to reuse a traced step in a
    new loop. To change `steps_per_execution` later, set it and call
    `model.make_train_function(force=True)`, as for any Keras model.
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
        compile_cache: where XLA compiles are kept across runs: `"auto"`
            (the process's cache where one is on, else
            `~/.cache/keras_gpufix/xla`), a folder, or None (off). Used
            only with XLA. Defaults to `"auto"`.
        **compile_kwargs: passed to `model.compile`.

    Returns:
        A `CompileReport`.

    Raises:
        ValueError: for an invalid argument value.
        RuntimeError: on a Keras backend other than TensorFlow.

    Example:
    ```python
    report = kg.compile_model(model, "adam", "mse", sample_batch=(x[:32], y[:32]))
    print(report)
    ```
    """
    if backend_name() != "tensorflow":
        raise tensorflow_only("compile_model", backend_name())
    check_args(jit_compile, mixed_precision, steps_per_execution, sample_batch)
    batch = _first_batch(sample_batch)
    cache = CompileCache.enable(compile_cache) if jit_compile else None
    strategy = model.distribute_strategy
    replicas = int(strategy.num_replicas_in_sync)
    reasons = []

    policy, loss_scaling, optimizer = check_precision(
        model, optimizer, mixed_precision, compile_kwargs, reasons
    )
    scope = "per_replica" if _is_mirrored(strategy) else "step"
    fallback = None
    if jit_compile:
        fallback = static_jit_blocker(model, scope, strategy, compile_kwargs)
        if fallback:
            warn_fallback(fallback)
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
    if use_jit and scope == "step" and not model.jit_compile:
        fallback = f"Keras {keras.__version__} set jit_compile=False after compile"
        warn_fallback(fallback)
        use_jit = False
    if use_jit and scope == "per_replica":
        install_per_replica_xla(model)
    if use_jit and cache.active:  # its compiles keep their names in the next run
        trace_from_aligned_ids(model)
    if _is_multi_worker(strategy):
        install_multi_worker_fixes(model)

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
                          _epoch_steps(sample_batch), _element_spec(sample_batch),
                          cache or CompileCache(None))
    elif model.steps_per_execution > 1 and _is_mirrored(strategy) and replicas > 1:
        model.steps_per_execution = report.steps_per_execution = 1
        _warn_steps(
            f"steps_per_execution={steps_per_execution} was not verified (no "
            "sample_batch) and fails under this strategy in Keras "
            f"{keras.__version__}; pass sample_batch= to verify it",
            strategy,
        )
    elif steps_per_execution == "auto":
        warn(
            "compile_model: steps_per_execution='auto' measures on a batch; "
            "none was given, so steps_per_execution=1. Pass "
            "sample_batch=(x, y) (a batch of the training size) to calibrate "
            "it, or pass an int."
        )
        reasons.append("steps_per_execution=1: not measured (no sample_batch)")

    reasons.insert(0, jit_reason(report, jit_compile, strategy, sample_batch is not None))
    if cache is not None:
        report.compile_cache = {"directory": cache.directory, "active": cache.active,
                                "note": cache.note, "entries": len(cache.entries())}
        reasons.insert(1, f"compile cache: {cache.directory}" if cache.active
                       else f"compile cache: off: {cache.note}")
    report.reason = "\n".join(reasons)
    logger.info("compile_model: %s", str(report).replace("\n", "; "))
    return report


def _is_mirrored(strategy) -> bool:
    return isinstance(
        strategy,
        (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy),
    )


def _is_multi_worker(strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and in_multi_worker_mode(strategy)


def _warn_steps(why: str, strategy) -> None:
    """The one warning that `steps_per_execution` fell back to 1, and why."""
    known = (
        " Keras 3 puts strategy.run inside a tf.cond in its multi-step loop, "
        f"which {type(strategy).__name__} cannot run (keras-team/keras#19246)."
        if _is_mirrored(strategy) and strategy.num_replicas_in_sync > 1
        else ""
    )
    warn(f"compile_model: steps_per_execution=1 because {why}.{known}")


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
                      epoch_steps, element_spec, cache):
    with strategy.scope():
        symbolic_build(model, batch)
    variables = list(model.variables) + list(model.optimizer.variables)
    saved = [v.numpy() for v in variables]
    try:
        target = (
            MAX_STEPS_PER_EXECUTION if steps_per_execution == "auto"
            else model.steps_per_execution
        )
        with cache.watch() as seen:
            start = time.perf_counter()
            run, loop_error, error = first_working(model, batch, strategy, target,
                                                    element_spec)
            first_s = time.perf_counter() - start
        if run is not None and report.jit_compile:
            start = time.perf_counter()
            run.step()
            report.compiles.append({
                "shape": [list(t.shape) for t in tf.nest.flatten(batch)],
                "seconds": max(0.0, first_s - (time.perf_counter() - start)),
                "from_cache": cache.active and seen["written"] == 0,
                "kept": cache.active,
            })
        if run is None:
            if not report.jit_compile:
                raise error
            reason = describe_xla_error(model, error)
            remove_per_replica_xla(model)
            model.jit_compile = False
            report.jit_compile, report.xla_scope = False, None
            run, loop_error, error = first_working(model, batch, strategy, target,
                                                    element_spec)
            if run is None:
                raise error  # fails without XLA too: not an XLA problem
            report.fallback_reason = reason
            warn_fallback(reason)
        calls = xla_calls(model)
        report.verified = calls is not None
        report.xla_devices = tuple(device for device, _ in calls or ())
        if report.jit_compile and report.verified and not report.xla_devices:
            report.jit_compile, report.xla_scope = False, None
            report.fallback_reason = "the traced train function has no XLA call"
        if loop_error is not None:
            report.steps_per_execution = 1
            _warn_steps(
                f"a train function with steps_per_execution={target} failed on "
                f"the sample batch ({first_line(loop_error)})",
                strategy,
            )
        elif steps_per_execution == "auto":
            report.calibration = run.calibrate()
            report.steps_per_execution = choose_steps(report.calibration, strategy,
                                                       epoch_steps)
            report.calibration["chosen"] = report.steps_per_execution
    except BaseException:
        _restore(model, variables, saved)
        model.steps_per_execution = report.steps_per_execution
        model.train_function = None
        raise
    _restore(model, variables, saved)
    if report.steps_per_execution != run.k:
        model.steps_per_execution = report.steps_per_execution
        model.make_train_function(force=True)


def _restore(model, variables, saved):
    for variable, value in zip(variables, saved):
        variable.assign(value)  # assignment keeps the traced functions valid
    model.reset_metrics()
