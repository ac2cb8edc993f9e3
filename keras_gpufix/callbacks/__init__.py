"""Keras callbacks: thin adapters over `keras_gpufix.analysis`."""

import importlib

_EXPORTS = {
    "StepTimer": "keras_gpufix.callbacks.step_timer",
    "GPUOscillationMonitor": "keras_gpufix.callbacks.gpu_oscillation_monitor",
    "ProfilerTrigger": "keras_gpufix.callbacks.profiler_trigger",
    "RetracingMonitor": "keras_gpufix.callbacks.retracing_monitor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
