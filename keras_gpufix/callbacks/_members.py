"""The step stream's members: our callbacks in one run, and what is handed to them.

The first to join leads (its hooks drive the stream where no markers frame
the callback list; failures are reported in its name). Records, judgements
and events reach every member in join order; a member that fails is
reported and skipped, never stopping training, except where the user's own
function raised (`UserError`: Keras lets that propagate).
"""

from keras_gpufix.callbacks._base import UserError

__all__ = ["Members"]


class Members:
    """Our callbacks in one run, in join order (iterable and indexable)."""

    # Failures of end hooks in Keras's pool kept for the loop's thread.
    MAX_KEPT = 16

    def __init__(self):
        self._callbacks = []
        self._kept = []

    def add(self, callback) -> bool:
        """Adds `callback`; returns whether it leads (joined first)."""
        self._callbacks.append(callback)
        return len(self._callbacks) == 1

    @property
    def leader(self):
        """The member that joined first, or None."""
        return self._callbacks[0] if self._callbacks else None

    def __iter__(self):
        return iter(self._callbacks)

    def __getitem__(self, index):
        return self._callbacks[index]

    def __len__(self):
        return len(self._callbacks)

    def __contains__(self, callback):
        return any(callback is c for c in self._callbacks)

    def deliver(self, name, *args):
        """Calls every member's `name(*args)` (`_after_hook`, `_on_judgement`, `_on_event`)."""
        for callback in self._callbacks:
            try:
                getattr(callback, name)(*args)
            except UserError:  # the user's own function raised: Keras lets that propagate
                raise
            except Exception as exc:  # a monitor must never stop training
                callback._report_failure(name, exc)

    def hand(self, records):
        """Hands new `StepRecord`s, in order, to every member (`_take_records`)."""
        for callback in self._callbacks:
            callback._take_records(records)

    def keep_failure(self, where, exc):
        """Keeps a failure off the loop's thread (Keras's pool) for `report_kept`."""
        if len(self._kept) < self.MAX_KEPT:
            self._kept.append((where, exc))

    def report_kept(self):
        """Reports, in the leader's name, the failures kept (on the loop's thread)."""
        kept, self._kept = self._kept, []
        for where, exc in kept:
            self.leader._report_failure(where, exc)
