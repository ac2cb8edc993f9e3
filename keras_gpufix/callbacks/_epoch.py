"""The epoch of the step stream: which epoch a step belongs to, and the epoch's Keras `logs`.

`on_epoch_end` gets the epoch's `step_ms` (mean cycle per step, ms) and the
run's `input_wait` so far (share of the cycle spent waiting for input, the
figure `report()["input_wait"]` gives; absent where not measured); see
`callbacks/_stream.py`. Every value is one a progress bar can show.
"""

__all__ = ["EpochLog"]


class EpochLog:
    """The running epoch's index and sums of its records."""

    def __init__(self):
        self._epoch = -1
        self._first = True
        self._sums = (-1, 0.0, 0)  # epoch, cycle, steps

    def begin(self):
        """At the epoch's begin hook."""
        self._epoch += 1
        self._first = True

    def tag(self) -> tuple:
        """`(epoch, first)` of the step that begins now (`first`: the epoch's first)."""
        tag, self._first = (self._epoch, self._first), False
        return tag

    def add(self, record):
        """Counts a `StepRecord` in its epoch's sums."""
        epoch, cycle, steps = self._sums
        if record.epoch != epoch:
            epoch, cycle, steps = record.epoch, 0.0, 0
        self._sums = (epoch, cycle + record.cycle, steps + record.steps)

    def write(self, logs, input_wait):
        """Writes the epoch's `step_ms` and `input_wait` (the run's so far, as its
        detector's log sums it: None, not measured, writes nothing) into `logs`."""
        epoch, cycle, steps = self._sums
        if epoch == max(0, self._epoch) and steps:
            logs["step_ms"] = cycle / steps * 1e3
        if input_wait is not None:
            logs["input_wait"] = input_wait
