"""The epoch of the step stream: which epoch a step belongs to, and the epoch's Keras `logs`.

`on_epoch_end` gets the epoch's `step_ms` (mean cycle per step, ms),
`input_wait` (share of the cycle spent waiting for input; absent where not
measured) and `verdict` (the run's verdict so far, as its index in
`analysis.VERDICTS`); see `callbacks/_stream.py`.
"""

from keras_gpufix.analysis import VERDICTS

__all__ = ["EpochLog"]


class EpochLog:
    """The running epoch's index and sums of its records."""

    def __init__(self):
        self._epoch = -1
        self._first = True
        self._sums = (-1, 0.0, 0.0, 0.0, 0)  # epoch, cycle, wait, waited cycle, steps

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
        epoch, cycle, wait, waited, steps = self._sums
        if record.epoch != epoch:
            epoch, cycle, wait, waited, steps = record.epoch, 0.0, 0.0, 0.0, 0
        if record.input_wait is not None:
            wait, waited = wait + record.input_wait, waited + record.cycle
        self._sums = (epoch, cycle + record.cycle, wait, waited, steps + record.steps)

    def write(self, logs, verdict):
        """Writes the epoch's `step_ms`, `input_wait` and `verdict` (a name in `VERDICTS`) into `logs`."""
        epoch, cycle, wait, waited, steps = self._sums
        if epoch == max(0, self._epoch) and steps:
            logs["step_ms"] = cycle / steps * 1e3
            if waited > 0:
                logs["input_wait"] = wait / waited
        logs["verdict"] = VERDICTS.index(verdict)
