"""DispatchClock: when each step of `fit` was handed to the device.

Where callbacks turned Keras's asynchronous dispatch off (`sync_callbacks`),
the loop's thread does everything of a step in turn: the hooks, fetching the
batch, dispatching the step (`model.train_function` returns once the work is
queued), then waiting for the device when Keras makes the logs numbers. The
clock stamps the return of `model.train_function` (`keras_internals
.time_train_function`), so each step splits into the host's part and the
part it `awaited` the device: with dispatch on, the host's part would have
overlapped the device's (`analysis`: the price of `sync_callbacks`).
"""

import threading
import time
from collections import deque

from keras_gpufix.keras_internals import time_train_function

__all__ = ["DispatchClock"]


class DispatchClock:
    """Return times of `model.train_function` during one `fit`.

    Use `DispatchClock.attach(model)` at `on_train_begin`, `awaited(spans)`
    per group of hooks, `detach()` at the end of training.
    """

    # Dispatches kept between two reads (the stream reads at least every 1024 hooks).
    CAPACITY = 4096

    def __init__(self):
        self._returns = deque(maxlen=self.CAPACITY)
        self._lock = threading.Lock()
        self._restore = None

    @classmethod
    def attach(cls, model):
        """The clock of `model`'s train function, or None where it cannot be wrapped."""
        clock = cls()
        clock._restore = time_train_function(model, clock._stamp)
        return clock if clock._restore is not None else None

    def _stamp(self):
        now = time.perf_counter()
        with self._lock:
            self._returns.append(now)

    def detach(self):
        """Gives `model.train_function` back (end of training)."""
        if self._restore is not None:
            self._restore()
            self._restore = None

    def awaited(self, spans):
        """Per hook `(start, end)` (`time.perf_counter()`): seconds from its last
        dispatch to its end, the host waiting for the device; None where no
        dispatch returned inside the span."""
        with self._lock:
            returns = list(self._returns)
        out = []
        for start, end in spans:
            inside = [t for t in returns if start < t <= end]
            out.append(end - inside[-1] if inside else None)
        return out
