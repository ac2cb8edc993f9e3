"""TimedCallback: the base of our callbacks that observe steps through the step stream."""

from keras_gpufix.analysis import not_run_verdict
from keras_gpufix.callbacks._base import GuardedCallback, guarded
from keras_gpufix.callbacks._stream import StepStream

__all__ = ["TimedCallback"]


class TimedCallback(GuardedCallback):
    """Base of our callbacks that observe steps through the shared stream.

    Subclasses implement the parts they need:

    - `_begin()` / `_end()`: at the start / end of each run (after joining
      the stream; after the stream's last records were handed out);
    - `_after_hook()`: after each end hook (a step, or N steps), on the
      loop's thread (`stream.last` holds it): at the end hook where Keras
      runs it there, else at the next step's begin;
    - `_on_records(records)`: new `StepRecord`s, in order (every quarter
      second, before validation, at epoch end and at the end of training);
    - `_epoch_done()`: at epoch end, after `_on_records`;
    - `_on_judgement(judgement, step)`, `_on_event(event)`: the run's one
      detector judged a window / reported an event.

    `report()` of every subclass starts with the run's verdict
    (`_verdict_report()`: `verdict`, `fix`, `phase`, `cost_share`,
    `because`, `changed`, `errors`), then what the callback itself measured.

    Every subclass is `async_safe`: its end hook only stamps the step clock
    (`callbacks/_clock.py`), so Keras keeps dispatching end hooks to its
    thread pool and the loop never waits for the device on our account.
    Everything else runs on the loop's thread.
    """

    async_safe = True

    def __init__(self):
        super().__init__()
        self.stream = None

    def _begin(self):
        pass

    def _end(self):
        pass

    def _after_hook(self):
        pass

    def _on_records(self, records):
        pass

    def _epoch_done(self):
        pass

    def _on_judgement(self, judgement, step):
        pass

    def _on_event(self, event):
        pass

    def _take_records(self, records):
        try:
            self._on_records(records)
        except Exception as exc:  # a monitor must never stop training
            self._report_failure("_on_records", exc)

    def _verdict_report(self):
        """The head of every `report()`: the run's one verdict (unknown before a run)."""
        if self.stream is None:
            verdict = not_run_verdict()
        else:
            verdict = self.stream.detector.verdict()
        return {**verdict, "errors": list(self.errors)}

    @guarded
    def on_train_begin(self, logs=None):
        self.stream = None
        self.stream = StepStream.join(self)
        self._begin()

    # After a failed on_train_begin (warned once) the hooks do nothing.

    # Each stream hook is called by one member: the leader (the first), but a
    # step's begin by the last member, so that the last member's begin and
    # the leader's end frame the step tightly: our own hooks fall in
    # `between`, not in the step. Where the stream's markers frame the step
    # around the whole callback list (`StepStream.framed`), they do instead.

    @guarded
    def on_epoch_begin(self, epoch, logs=None):
        if self.stream is not None and self.stream.leader is self:
            self.stream.epoch_begin()

    @guarded
    def on_train_batch_begin(self, batch, logs=None):
        stream = self.stream
        if stream is not None and not stream.framed:
            if stream.leader is self:
                stream.cycle_begin()
            if stream.members[-1] is self:
                stream.batch_begin(batch)

    @guarded
    def on_train_batch_end(self, batch, logs=None):
        stream = self.stream
        if stream is not None and stream.leader is self and not stream.framed:
            stream.end_hook(batch, logs)

    @guarded
    def on_test_begin(self, logs=None):
        # Validation runs before on_epoch_end: read training's input first,
        # so an instrumented validation set is never taken for it.
        if self.stream is not None and self.stream.leader is self:
            self.stream.settle()
            self.stream.sync()

    @guarded
    def on_epoch_end(self, epoch, logs=None):
        if self.stream is not None:
            if self.stream.leader is self:
                self.stream.settle()
                self.stream.sync()
                if isinstance(logs, dict):
                    self.stream.epoch_logs(logs)
            self._epoch_done()

    @guarded
    def on_train_end(self, logs=None):
        if self.stream is not None:
            if self.stream.leader is self:
                self.stream.train_end()
            self._end()
