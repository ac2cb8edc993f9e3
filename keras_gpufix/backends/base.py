"""`Backend`: what every Keras backend shares, and the one-line notice of what one lacks.

The adapter of a backend without a measurement of its own (torch, numpy)
is this class itself: compiles are not counted, traces are not taken, and
each says so in one line (`unsupported`), never with untested code.
"""

import contextlib

__all__ = ["Backend", "NotSupported"]


class NotSupported(RuntimeError):
    """A measurement the running Keras backend does not offer (one line for people)."""


class Backend:
    """The adapter of one Keras backend.

    Attributes:
        name: the Keras backend (`keras.backend.backend()`).
        tensorflow_step: whether fit's train step is a `tf.function` (its
            input shapes are probed inside it, its traces counted).
        async_callbacks: whether Keras may run batch-end hooks in a thread
            pool while the loop dispatches the next step (every backend but
            TensorFlow, since Keras 3.6).
    """

    tensorflow_step = False

    def __init__(self, name):
        self.name = name
        self.async_callbacks = name != "tensorflow"

    def unsupported(self, what: str) -> str:
        """The one-line notice that `what` is not measured on this backend."""
        return (f"keras_gpufix: {what} is not supported on the Keras {self.name} backend "
                "(TensorFlow and JAX are); it is skipped, the rest is measured")

    def compile_log(self):
        """The process's `CompileLog` of XLA compiles, or None where they are not counted."""
        return None

    def start_trace(self, log_dir, host_tracer_level=2, python_tracer_level=0,
                    device_tracer_level=1):
        """Starts a profiler trace into `log_dir` (see `profiling.start_trace`).

        Raises:
            NotSupported: no profiler on this backend.
            RuntimeError: another profiler is running (the message says so).
        """
        raise NotSupported(self.unsupported("a profiler trace"))

    def stop_trace(self, save=True):
        """Stops the trace `start_trace` started; False when none was running."""
        raise NotSupported(self.unsupported("a profiler trace"))

    def step_marker(self, step, name="train"):
        """A context manager that marks one step in a running trace."""
        return contextlib.nullcontext()

    def scalar_writer(self, path):
        """A writer of TensorBoard scalars and text into `path` (`EventWriter`).

        Raises:
            NotSupported: the `tensorboard` package is not installed.
        """
        from keras_gpufix.backends.event_writer import EventWriter

        return EventWriter(path)
