"""keras_gpufix: a fast input path and a measured diagnosis for `model.fit`.

Public names load lazily so that `import keras_gpufix` imports neither
TensorFlow nor Keras; the callbacks that only need Keras's callback API
(`StepTimer`, `GPUOscillationMonitor`) then work on every Keras 3 backend.
"""

from keras_gpufix._lazy import lazy_getattr

__version__ = "0.2.0"

_EXPORTS = {
    "StepTimer": "keras_gpufix.callbacks.step_timer",
    "GPUOscillationMonitor": "keras_gpufix.callbacks.gpu_oscillation_monitor",
    "ProfilerTrigger": "keras_gpufix.callbacks.profiler_trigger",
    "RetracingMonitor": "keras_gpufix.callbacks.retracing_monitor",
    "compile_model": "keras_gpufix.compile",
    "enable_mixed_precision": "keras_gpufix.compile",
    "CompileReport": "keras_gpufix.compile",
    "setup_strategy": "keras_gpufix.distribute",
    "global_batch_size": "keras_gpufix.distribute",
    "load_config": "keras_gpufix.config",
    "from_config": "keras_gpufix.config",
    "GpufixWarning": "keras_gpufix.exceptions",
    "watch": "keras_gpufix.watched",
}
_SUBMODULES = ("analysis", "callbacks", "data", "cli", "config", "profiling")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


__getattr__ = lazy_getattr(__name__, _EXPORTS, _SUBMODULES)


def __dir__():
    return __all__
