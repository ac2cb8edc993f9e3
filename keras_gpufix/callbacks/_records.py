"""The step stream's records: finished hooks, in step order, made `StepRecord`s when due.

The step clock (`_clock.py`) hands out finished hooks in the order they
began; `RecordMaker.add` numbers them (the global step index) on the loop's
thread. Reading the input probe costs about half a millisecond while fit
runs, so records are made in batches (`make`): at most every
`SYNC_SECONDS` (<= 0.2 % of the time), after at least `SYNC_MIN_HOOKS`
hooks and at least every `SYNC_MAX_HOOKS` (well inside the probe's ring of
4096 batches), and whenever the stream syncs (before validation, at epoch
end, at the end of training). Each record's phases come from
`analysis.phases.split_cycle`, its input facts from `CycleInputs.read`.
"""

from typing import NamedTuple

from keras_gpufix.analysis import StepRecord
from keras_gpufix.analysis.phases import split_cycle

__all__ = ["RecordMaker"]


class _Done(NamedTuple):
    """One finished hook waiting to become a record (step-clock seconds)."""

    index: int
    steps: int
    start: float
    span: float
    gap: float
    epoch: int
    first: bool
    supplied: object
    traces: int


class RecordMaker:
    """Finished hooks of one run, numbered in order, and the records made of them.

    Args:
        offset: wall time of a step-clock reading minus the reading
            (`StepClock.offset`).

    Attributes:
        hooks: end hooks recorded so far.
        last: `(index, steps, span_s, gap_s)` of the latest end hook, read
            right at that hook (for callbacks that act on the next step).
    """

    SYNC_SECONDS = 0.25
    SYNC_MIN_HOOKS = 8
    SYNC_MAX_HOOKS = 1024

    def __init__(self, offset):
        self._offset = offset
        self.hooks = 0
        self.last = None
        self._next = 0
        self._done = []
        self._last_sync = None
        self._sampler = None

    def sample_utilisation(self, sampler):
        """Reads each record's GPU utilisation from `sampler` (an `NvmlSampler`, or None)."""
        self._sampler = sampler

    def add(self, hook, start, span, gap, traces) -> bool:
        """Numbers a finished hook (`StepClock.take`'s); returns whether records are due."""
        epoch, first, supplied = hook.facts
        self._done.append(_Done(self._next, hook.steps, start, span, gap, epoch, first,
                                supplied, traces))
        self.last = (self._next, hook.steps, span, gap)
        self._next += hook.steps
        self.hooks += 1
        if self._last_sync is None:
            self._last_sync = start
        waiting = len(self._done)
        return waiting >= self.SYNC_MAX_HOOKS or (
            waiting >= self.SYNC_MIN_HOOKS
            and start + span - self._last_sync >= self.SYNC_SECONDS)

    def upcoming_index(self, open_hooks) -> int:
        """The global index of the step about to begin, with `open_hooks` begun
        and not finished (each counts as many steps as the latest finished one)."""
        per = 1 if self.last is None else self.last[1]
        return self._next + per * open_hooks

    def waiting(self) -> int:
        """Finished hooks not made records yet."""
        return len(self._done)

    def waiting_cycles(self) -> list:
        """`(cycle per step, epoch_first)` of the hooks not made records yet, oldest first."""
        return [((d.span + d.gap) / d.steps, d.first) for d in self._done]

    def make(self, inputs, dispatch) -> list:
        """The `StepRecord`s of the hooks waiting, in order (the loop's thread).

        Args:
            inputs: the stream's `CycleInputs` (what fed each cycle).
            dispatch: the stream's `SyncCallbacks` (the host's waits for the device).
        """
        done, self._done = self._done, []
        if not done:
            return []
        self._last_sync = done[-1].start + done[-1].span
        fed = inputs.read([(d.start, d.span, d.gap, d.steps, d.supplied) for d in done])
        awaited = dispatch.awaited([(d.start, d.start + d.span) for d in done])
        records = []
        for d, got, device in zip(done, fed, awaited):
            held = min(got.collective, d.gap)  # next()'s wait for the other workers
            input_wait, step, between = split_cycle(
                d.span + held, d.gap - held, got.wait, supplied=got.supplied,
                unsynced=got.wait is None and got.supplied)
            util = None
            if self._sampler is not None:
                util = self._sampler.mean_between(d.start + self._offset,
                                                  d.start + d.span + self._offset)
            records.append(StepRecord(
                index=d.index, steps=d.steps, input_wait=input_wait, step=step,
                between=between, samples=got.samples, audio_seconds=got.audio,
                real_frames=got.frames, shape=got.shape, new_shape=got.new_shape,
                gpu_util=util, epoch=max(0, d.epoch), epoch_first=d.first, split=got.split,
                traces=d.traces, compile_s=got.compile_s, awaited=device))
        return records
