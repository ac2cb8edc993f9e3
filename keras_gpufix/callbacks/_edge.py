"""The step stream's markers at the front and back of the running CallbackList.

`StepStream.join` puts them there (`keras_internals.surround_callbacks`):
the front one ends each step before any other callback's end hook runs, the
back one begins it after every other callback's begin hook ran, so the span
holds the step alone.
"""

import keras

from keras_gpufix.callbacks._base import UserError

__all__ = ["Edge"]


class Edge(keras.callbacks.Callback):
    """A stream's marker at the front (`end=True`) or back of a CallbackList.

    The front marker ends each step at `on_train_batch_end` before any
    other callback runs (and, at `on_train_batch_begin`, hands out the
    hooks that ended in Keras's pool); the back marker begins it at
    `on_train_batch_begin` after all of them ran. A failure is reported by
    the stream's leader on the loop's thread, never raised into the user's
    loop.
    """

    async_safe = True

    def __init__(self, stream, end):
        super().__init__()
        self._stream = stream
        self._end = end

    def on_train_batch_begin(self, batch, logs=None):
        if self._end:
            self._guard(self._stream.cycle_begin)
        else:
            self._guard(self._stream.batch_begin, batch)

    def on_train_batch_end(self, batch, logs=None):
        if self._end:
            self._guard(self._stream.end_hook, batch, logs)

    def _guard(self, hook, *args):
        stream = self._stream
        if stream.closed or not stream.framed:
            return
        try:
            hook(*args)
            return
        except UserError as exc:  # the user's own function raised: Keras lets that propagate
            error = exc.__cause__
        except Exception as exc:  # a monitor must never stop training
            if stream.clock.on_loop_thread():
                stream.leader._report_failure(f"step marker {hook.__name__}", exc)
            else:
                stream.fail_off_loop(f"step marker {hook.__name__}", exc)
            return
        raise error  # outside the handler: the user's traceback, not ours
