"""`compile_model`: `model.compile` with XLA, mixed precision and
`steps_per_execution` that really take effect, and a record of what did.

Keras 3 (TensorFlow backend) has traps that cost speed silently:

- `jit_compile="auto"` resolves to no XLA on CPU-only machines, under any
  `tf.distribute` strategy and when one layer says it does not support jit;
  and `jit_compile=True` under `MirroredStrategy` fails at the first step
  ("Trying to access resource ... located in device ...:1 from device ...:0")
  because Keras wraps the whole replicated step, all devices together, in one
  XLA cluster. `compile_model` compiles each replica's forward and backward
  pass with XLA instead (`keras_internals.install_per_replica_xla`), with the
  gradient all-reduce and the optimizer update outside XLA, and checks on a
  real batch what the traced train function really runs.
- A dtype policy only applies to layers created after it is set.
- Keras 3 has no `steps_per_execution` tuner; `compile_model` measures the
  per-execution overhead on a sample batch and picks the value.

Choices are logged on the `keras_gpufix.compile` logger; problems that were
worked around are one `GpufixWarning` each.

`compile_model` is `model.compile` with the arguments it chose, then the
checks that they took. The package holds one concern per module:
`hardware` (device facts and whether a policy is fast here), `arguments`
(`compile_model`'s argument check), `precision`
(the dtype policy and the check of the built layers), `verification`
(whether XLA took, read from the traced step), `calibration` (the sample
runner and `steps_per_execution`), `compile_cache` (XLA compiles kept
across runs) and `entry` (`compile_model` and
`CompileReport`). What needs Keras internals (the per-replica XLA step,
the multi-worker fixes, reading the traced step) is in `keras_internals`.
The names load on first use, so `hardware` and `arguments` (what
`keras-gpufix validate` needs) load without TensorFlow or Keras.
"""

from keras_gpufix._lazy import lazy_getattr

_EXPORTS = {
    "CompileCache": "keras_gpufix.compile.compile_cache",
    "CompileReport": "keras_gpufix.compile.entry",
    "compile_model": "keras_gpufix.compile.entry",
    "device_info": "keras_gpufix.compile.hardware",
    "enable_mixed_precision": "keras_gpufix.compile.precision",
}

__all__ = sorted(_EXPORTS)


_lazy_getattr = lazy_getattr(__name__, _EXPORTS)


def tensorflow_only(name, backend):
    """The error for `name` (TensorFlow-only: `compile_model`) on another backend."""
    what = "" if name == "compile_model" else f"kg.{name} is kg.compile_model's report; "
    return RuntimeError(
        f"{what}kg.compile_model compiles and checks a TensorFlow train step: it runs on "
        f"the Keras TensorFlow backend only (this process: the {backend} backend). There: "
        "kg.enable_mixed_precision('auto') before the model is built, then "
        "model.compile(...) (on JAX Keras compiles every train step with XLA), and "
        "CompileCache.enable() to keep compiles across runs (docs/backends.md)")


def __getattr__(name):
    try:
        return _lazy_getattr(name)
    except ModuleNotFoundError as exc:  # TensorFlow is not installed (JAX, torch)
        from keras_gpufix.backends import name as backend_name
        from keras_gpufix.backends import tensorflow_missing

        if not tensorflow_missing(exc):
            raise

        raise tensorflow_only(name, backend_name()) from None


def __dir__():
    return __all__
