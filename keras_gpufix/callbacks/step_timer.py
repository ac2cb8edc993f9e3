"""StepTimer: per-step wall time, phases and throughput of `model.fit`.

Why begin->end is a real step: Keras converts the step's logs to Python
numbers ("pythonify") before it calls `on_train_batch_end` whenever a
callback overrides that hook, which waits for the step's results, so
`on_train_batch_begin` -> `on_train_batch_end` covers fetching the batch,
the step and its synchronisation. On the JAX, torch and NumPy backends Keras
does that in its thread pool (the timer is `async_safe`), while the loop
dispatches the next step: the step is then timed from its begin, or from the
previous step's end when it was dispatched before that, to its end
(`analysis/phases.py`). With
`steps_per_execution=N` Keras calls the hooks once per N steps
(`on_train_batch_begin(first)`, `on_train_batch_end(last)`): one record
covers the N steps and says so.

The timer reads no clock itself: it is a member of the shared step stream
(`keras_gpufix.callbacks._stream`), which times each hook once for all our
callbacks in the `fit` and splits the cycle into `input_wait`, `step` and
`between`. It keeps a bounded `StepLog` (the last `window` records and
running totals), so its memory does not grow with the run.

Logged TensorBoard scalars (run `keras_gpufix` under `log_dir`):

| tag                          | when       | value                                  |
|------------------------------|------------|----------------------------------------|
| `step_timer/step_ms`         | each hook  | cycle time per step (ms): input wait + |
|                              |            | step + between                         |
| `step_timer/epoch_mean_ms`   | epoch end  | mean cycle time per step of the epoch  |
| `step_timer/epoch_p95_ms`    | epoch end  | 95th percentile                        |
| `step_timer/epoch_cv`        | epoch end  | coefficient of variation               |
| `step_timer/samples_per_s`   | epoch end  | when the batch size is known           |

Keras `logs`: `step_ms` (each step), `step_ms` and `input_wait` (each
epoch; `input_wait` the run's so far, the figure `report()` gives), written
by the first of our callbacks in the list (see `callbacks/_stream.py`).
"""

from keras_gpufix.analysis import StepLog
from keras_gpufix.callbacks import _arguments
from keras_gpufix.callbacks._base import ScalarWriter
from keras_gpufix.callbacks._timed import TimedCallback

__all__ = ["StepTimer"]


class StepTimer(TimedCallback):
    """Times every training step of `model.fit` (or a watched loop).

    Samples/s come from the real batch size: read from the batches of a
    dataset that went through `kg.data.instrument` (the `kg.data` builder
    does it), else from `batch_size` when given. Its summary covers the
    whole run in bounded memory.

    Args:
        batch_size: samples per step, used when the dataset is not
            instrumented. Defaults to None (samples/s reported as None).
        log_dir: directory for TensorBoard scalars. Defaults to None.
        warmup: steps left out of `summary()` at the start of each `fit`
            (XLA compilation, first batches). Defaults to 0.
        window: records kept for `records()`. Defaults to 1024.

    Example:

    >>> timer = kg.StepTimer()
    >>> model.fit(ds, callbacks=[timer])
    >>> timer.summary()["p95_ms"]
    """

    def __init__(self, batch_size=None, log_dir=None, warmup=0, window=1024):
        super().__init__()
        self.log = _arguments.step_timer(batch_size, warmup, window)
        self.batch_size = batch_size
        self.log_dir = log_dir
        self.warmup = warmup
        self.window = window
        self._epoch_log = StepLog(256)
        self._writer = None
        self._steps = 0

    @property
    def input_probe(self):
        """The `InputProbe` of the instrumented dataset being read, or None."""
        return None if self.stream is None else self.stream.input_probe

    def _begin(self):
        self.log.reset()
        self._epoch_log.reset()
        self._steps = 0
        if self.log_dir is not None and self._writer is None:
            self._writer = ScalarWriter(self.log_dir)

    def _on_records(self, records):
        for record in records:
            self._steps += record.steps
            if self._writer is not None:  # the epoch's figures are for TensorBoard only
                if record.epoch_first:
                    self._epoch_log.reset()
                self._epoch_log.add(record)
            if self._steps <= self.warmup:
                continue
            self.log.add(record)
            if self._writer is not None:
                self._writer.add("step_timer/step_ms", record.cycle / record.steps * 1e3,
                                 record.index + record.steps - 1)

    def _epoch_done(self):
        if self._writer is None:
            return
        s = self._epoch_log.summary()
        step = self._steps - 1
        for key in ("mean_ms", "p95_ms", "cv", "samples_per_s"):
            name = "samples_per_s" if key == "samples_per_s" else f"epoch_{key}"
            self._writer.add(f"step_timer/{name}", s[key], step)
        self._writer.flush()

    def _end(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def records(self) -> list:
        """The last `window` `analysis.StepRecord`s (after warmup), oldest first."""
        return self.log.records()

    def summary(self) -> dict:
        """`StepLog.summary()` of this fit after `warmup` steps: `count`,
        `mean_ms`, `p50_ms`, `p95_ms`, `p99_ms`, `samples_per_s`, `phases`,
        `input_wait`, `audio_seconds_per_s`, `real_frames_per_s`,
        `steps_per_record`, ..."""
        return self.log.summary()

    def report(self) -> dict:
        """The run's verdict and this timer's summary.

        Returns:
            A dict: the run's verdict, as every keras_gpufix callback's
            `report()` starts (`verdict`, `fix`, `phase`, `cost_share`,
            `because`, `changed`, `errors`), then `step_time` (`summary()`).
        """
        return {**self._verdict_report(), "step_time": self.summary()}
