"""Callbacks that turned Keras's asynchronous dispatch off: who, and what it cost.

On the JAX, torch and NumPy backends Keras runs batch-end hooks in a thread
pool unless a callback overrides one without `async_safe = True`; then the
loop waits for the device at every step. `SyncCallbacks.open` names those
callbacks (`RunFacts.async_blockers`) and stamps each step's dispatch
(`DispatchClock`, `backends/dispatch_clock.py`), so each record tells how
long the host waited for the device (`StepRecord.awaited`).
"""

from keras_gpufix.backends.dispatch_clock import DispatchClock
from keras_gpufix.keras_internals import (
    async_train_dispatch,
    blocks_async_dispatch,
    running_callback_list,
)

__all__ = ["SyncCallbacks"]


class SyncCallbacks:
    """The step stream's watch on callbacks that stopped asynchronous dispatch."""

    def __init__(self):
        self._dispatch = None

    def open(self, backend, callback, model) -> dict:
        """When the leader `callback` joins: `{"async_blockers": names or None}`.

        Names are None where the backend never dispatches callbacks
        asynchronously (TensorFlow), where dispatch is on, or where it
        cannot be told. Where there are some, each dispatch of `model`'s
        train function is stamped.
        """
        names = None
        hooks = running_callback_list(callback) if backend.async_callbacks else None
        if hooks is not None and async_train_dispatch(hooks) is False:
            names = tuple(type(c).__name__ for c in hooks.callbacks
                          if blocks_async_dispatch(c)) or None
        self._dispatch = None
        if names and model is not None:
            self._dispatch = DispatchClock.attach(model)
        return {"async_blockers": names}

    def awaited(self, spans) -> list:
        """Per `(begin, end)` span, the seconds the host waited for the device (None: not stamped)."""
        if self._dispatch is None:
            return [None] * len(spans)
        return self._dispatch.awaited(spans)

    def close(self):
        if self._dispatch is not None:
            self._dispatch.detach()
