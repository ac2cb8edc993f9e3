"""Speech corpus -> `tf.data` input path (TensorFlow only, loaded lazily)."""

import importlib

_EXPORTS = {
    "instrument": "keras_gpufix.data.instrument",
    "InputProbe": "keras_gpufix.data.instrument",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
