"""Keras callbacks: thin adapters over `keras_gpufix.analysis`."""

from keras_gpufix._lazy import lazy_getattr

_EXPORTS = {
    "StepTimer": "keras_gpufix.callbacks.step_timer",
    "GPUOscillationMonitor": "keras_gpufix.callbacks.gpu_oscillation_monitor",
    "ProfilerTrigger": "keras_gpufix.callbacks.profiler_trigger",
    "RetracingMonitor": "keras_gpufix.callbacks.retracing_monitor",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
