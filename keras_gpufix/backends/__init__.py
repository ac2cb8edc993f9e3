"""One adapter per Keras backend, chosen once per run: what differs between them.

`current()` returns the adapter of the running Keras backend (read once per
process from `keras.backend.backend()`). Everything the rest of the package
does differently per backend goes through it, so TensorFlow-only code runs
only on TensorFlow and nothing warns about a TensorFlow structure elsewhere:

| what                          | TensorFlow                    | JAX                           | torch, numpy        |
|-------------------------------|-------------------------------|-------------------------------|---------------------|
| callbacks dispatched async    | never (Keras syncs each step) | unless a callback blocks it   | as JAX              |
| compiles counted and priced   | shape probe in the train step,| `jax.monitoring` compile      | not supported       |
|                               | tf.function trace counts      | events + the batch's shapes   |                     |
| input wait in `fit`           | `kg.data.instrument`; PyDataset, generator and arrays through the epoch iterator (`backends/batch_clock.py`)        |||
| traces (`ProfilerTrigger`)    | `tf.profiler`, `Trace` markers| `jax.profiler`,               | not supported       |
|                               |                               | `StepTraceAnnotation` markers |                     |
| scalars and verdict text      | the `tensorboard` package's event files (no TensorFlow op) |||

Where something is not supported the adapter says so in one line
(`Backend.unsupported`), never with an untested stand-in.
"""

import functools
import json
import os
import sys

from keras_gpufix.backends.base import Backend, NotSupported

__all__ = ["Backend", "NotSupported", "current", "name", "tensorflow_missing"]


def name() -> str:
    """The Keras backend's name without importing Keras (nor TensorFlow):
    `keras.backend.backend()` once Keras is imported, else `KERAS_BACKEND`,
    else `backend` in Keras's config file (`$KERAS_HOME/keras.json`, else
    `~/.keras/keras.json`), else Keras's default, `tensorflow`."""
    keras = sys.modules.get("keras")
    if keras is not None:
        return keras.backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    folder = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(folder, "keras.json"), encoding="utf-8") as f:
            return json.load(f).get("backend") or "tensorflow"
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def tensorflow_missing(exc: BaseException) -> bool:
    """Whether `exc` is the ModuleNotFoundError of TensorFlow (or one of its
    modules) not being installed, as on a JAX or torch machine."""
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "tensorflow"


@functools.lru_cache(maxsize=None)
def _for(name):
    if name == "tensorflow":
        from keras_gpufix.backends.tensorflow_backend import TensorFlowBackend

        return TensorFlowBackend()
    if name == "jax":
        from keras_gpufix.backends.jax_backend import JaxBackend

        return JaxBackend()
    return Backend(name)


def current() -> Backend:
    """The adapter of the running Keras backend (one per process and backend)."""
    import keras

    return _for(keras.backend.backend())
