"""StepTimer: per-step wall time and throughput of `model.fit`.

Why begin->end is a real step on the TensorFlow backend: Keras converts the
step's logs to Python numbers ("pythonify") before it calls
`on_train_batch_end` whenever a callback overrides that hook, which waits for
the step's results, so `on_train_batch_begin` -> `on_train_batch_end` covers
fetching the batch, the step and its synchronisation. With
`steps_per_execution=N` Keras calls the hooks once per N steps
(`on_train_batch_begin(first)`, `on_train_batch_end(last)`): the timer divides
the hook's time by `last - first + 1`.

Logged TensorBoard scalars (run `keras_gpufix` under `log_dir`):

| tag                          | when       | value                          |
|------------------------------|------------|--------------------------------|
| `step_timer/step_ms`         | each hook  | wall time per step (ms)        |
| `step_timer/epoch_mean_ms`   | epoch end  | mean step time of the epoch    |
| `step_timer/epoch_p95_ms`    | epoch end  | 95th percentile                |
| `step_timer/epoch_cv`        | epoch end  | coefficient of variation       |
| `step_timer/samples_per_s`   | epoch end  | when the batch size is known   |

Nothing is added to the Keras `logs` dict.
"""

import sys
import time

from keras_gpufix.analysis import summarize_step_times
from keras_gpufix.callbacks._base import GuardedCallback, ScalarWriter, guarded

__all__ = ["StepTimer", "TimedCallback"]


class StepTimer(GuardedCallback):
    """Times every training step of `model.fit`.

    Samples/s come from the real batch size: read from the batches of a
    dataset that went through `kg.data.instrument` (the `kg.data` builder
    does it), else from `batch_size` when given. Timing uses
    `time.perf_counter`; the work per step is two clock reads and three
    list appends.

    Args:
        batch_size: samples per step, used when the dataset is not
            instrumented. Defaults to None (samples/s reported as None).
        log_dir: directory for TensorBoard scalars. Defaults to None.
        warmup: steps left out of `summary()` at the start of each `fit`
            (XLA compilation, first batches). Defaults to 0.

    Example:

    >>> timer = kg.StepTimer()
    >>> model.fit(ds, callbacks=[timer])
    >>> timer.summary()["p95_ms"]
    """

    def __init__(self, batch_size=None, log_dir=None, warmup=0):
        super().__init__()
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1. Received: batch_size={batch_size}")
        if warmup < 0:
            raise ValueError(f"`warmup` must be >= 0. Received: warmup={warmup}")
        self.batch_size = batch_size
        self.log_dir = log_dir
        self.warmup = warmup
        self._writer = None
        self._reset()

    def _reset(self):
        self.durations = []   # seconds per hook
        self.counts = []      # steps per hook
        self.begins = []      # wall time (time.time) of each hook's begin
        self.ends = []
        self.steps = []       # global index of each hook's last step
        self.epoch_first = [] # True for the first hook of an epoch
        self.batch_sizes = [] # samples per step, None when unknown
        self.input_waits = [] # seconds each hook waited for input, or None
        self.shapes = []      # each hook's batch shapes, or None
        self.synced = 0       # hooks whose input signals are read
        self._cursor = None
        self._t0 = None
        self._wall0 = None
        self._first = None
        self._new_epoch = True
        self._global = 0

    @guarded
    def on_train_begin(self, logs=None):
        self._reset()
        if "tensorflow" in sys.modules:  # only TF datasets can be instrumented
            from keras_gpufix.data.input_probe import InputCursor

            self._cursor = InputCursor()
            self._cursor.start()
        if self.log_dir is not None and self._writer is None:
            self._writer = ScalarWriter(self.log_dir)

    @guarded
    def on_epoch_begin(self, epoch, logs=None):
        self._new_epoch = True
        if self._cursor is not None:
            self._cursor.epoch_begin()

    @guarded
    def on_train_batch_begin(self, batch, logs=None):
        self._first = batch
        self._wall0 = time.time()
        self._t0 = time.perf_counter()

    @guarded
    def on_train_batch_end(self, batch, logs=None):
        if self._t0 is None:
            return
        elapsed = time.perf_counter() - self._t0
        count = max(1, batch - self._first + 1)
        self._global += count
        self.durations.append(elapsed)
        self.counts.append(count)
        self.begins.append(self._wall0)
        self.ends.append(self._wall0 + elapsed)
        self.steps.append(self._global - 1)
        self.epoch_first.append(self._new_epoch)
        self.batch_sizes.append(self.batch_size)
        self._new_epoch = False
        self._t0 = None
        if self._writer is not None:
            self._writer.add("step_timer/step_ms", elapsed / count * 1e3, self._global - 1)
        pending = len(self.durations) - self.synced
        if pending >= self.SYNC_MAX_HOOKS or (
            pending >= self.SYNC_MIN_HOOKS
            and self.ends[-1] - self.ends[self.synced - 1 if self.synced else 0]
            >= self.SYNC_SECONDS
        ):
            self.sync()

    # Reading the probe costs about half a millisecond while fit runs, so it
    # happens at most every SYNC_SECONDS (<= 0.2 % of the time), after at
    # least SYNC_MIN_HOOKS hooks, and at least every SYNC_MAX_HOOKS (well
    # inside the probe's ring of 4096 batches).
    SYNC_SECONDS = 0.25
    SYNC_MIN_HOOKS = 8
    SYNC_MAX_HOOKS = 1024

    @property
    def input_probe(self):
        """The `InputProbe` of the instrumented dataset being read, or None."""
        return None if self._cursor is None else self._cursor.probe

    def sync(self):
        """Reads input wait and shapes of the hooks not read yet.

        Runs every `SYNC_SECONDS` (see above), before validation and at
        epoch end, rather than per step.
        """
        start, stop = self.synced, len(self.durations)
        self.synced = stop
        if start == stop:
            return
        if self._cursor is None:
            self.input_waits.extend([None] * (stop - start))
            self.shapes.extend([None] * (stop - start))
            return
        waits, rows = self._cursor.take(
            self.begins[start:stop], self.ends[start:stop], self.counts[start:stop]
        )
        probe = self._cursor.probe
        for i, (wait, row) in enumerate(zip(waits, rows), start=start):
            key = None if row is None else probe.shape_key(row)
            self.input_waits.append(wait)
            self.shapes.append(key)
            if key is not None and probe.batch_size(key):
                self.batch_sizes[i] = probe.batch_size(key)

    @guarded
    def on_test_begin(self, logs=None):
        # Validation runs before on_epoch_end: read training's input first,
        # so an instrumented validation set is never taken for it.
        self.sync()

    @guarded
    def on_epoch_end(self, epoch, logs=None):
        self.sync()
        if self._writer is None:
            return
        start = max(i for i, first in enumerate(self.epoch_first) if first) if self.durations else 0
        s = self._summarize(start)
        step = self._global - 1
        for key in ("mean_ms", "p95_ms", "cv", "samples_per_s"):
            name = "samples_per_s" if key == "samples_per_s" else f"epoch_{key}"
            self._writer.add(f"step_timer/{name}", s[key], step)
        self._writer.flush()

    @guarded
    def on_train_end(self, logs=None):
        self.sync()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def per_step(self, start=0):
        """(step times in s, samples per step or None), one entry per step."""
        times, sizes = [], []
        for d, c, b in zip(self.durations[start:], self.counts[start:],
                           self.batch_sizes[start:]):
            times.extend([d / c] * c)
            sizes.extend([b] * c)
        if any(s is None for s in sizes):
            sizes = None
        return times, sizes

    def _summarize(self, start):
        times, sizes = self.per_step(start)
        out = summarize_step_times(times, sizes)
        out["steps_per_hook"] = max(self.counts[start:], default=1)
        return out

    def summary(self):
        """`summarize_step_times` of this fit (after `warmup` steps).

        Returns:
            The dict of `keras_gpufix.analysis.summarize_step_times` plus
            `steps_per_hook` (steps_per_execution as observed).
        """
        skip, hook = 0, 0
        while hook < len(self.counts) and skip < self.warmup:
            skip += self.counts[hook]
            hook += 1
        return self._summarize(hook)


class TimedCallback(GuardedCallback):
    """Base of our callbacks that observe steps through an inner `StepTimer`.

    Every Keras hook is forwarded to `self.timer`; subclasses implement the
    parts they need:

    - `_begin()` / `_end()`: at the start / end of each `fit` (after the
      timer's own `on_train_begin`, before its `on_train_end` has been read);
    - `_after_hook()`: after each timed hook (a step, or N steps with
      `steps_per_execution=N`);
    - `_read_hooks(start, stop)`: the timer has read the input signals of
      hooks `start..stop-1` (every quarter second, before validation, at
      epoch end and at the end of `fit`);
    - `_epoch_done()`: at epoch end, after `_read_hooks`.
    """

    def __init__(self, warmup=0):
        super().__init__()
        self.timer = StepTimer(warmup=warmup)
        self._read = 0

    def set_model(self, model):
        super().set_model(model)
        self.timer.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.timer.set_params(params)

    def _begin(self):
        pass

    def _end(self):
        pass

    def _after_hook(self):
        pass

    def _read_hooks(self, start, stop):
        pass

    def _epoch_done(self):
        pass

    def _take(self):
        if self.timer.synced > self._read:
            start, self._read = self._read, self.timer.synced
            self._read_hooks(start, self._read)

    @guarded
    def on_train_begin(self, logs=None):
        self._activate()
        self._read = 0
        self.timer.on_train_begin(logs)
        self._begin()

    @guarded
    def on_epoch_begin(self, epoch, logs=None):
        self.timer.on_epoch_begin(epoch, logs)

    @guarded
    def on_train_batch_begin(self, batch, logs=None):
        self.timer.on_train_batch_begin(batch, logs)

    @guarded
    def on_train_batch_end(self, batch, logs=None):
        hooks = len(self.timer.durations)
        self.timer.on_train_batch_end(batch, logs)
        if len(self.timer.durations) != hooks:
            self._after_hook()
        self._take()

    @guarded
    def on_test_begin(self, logs=None):
        self.timer.on_test_begin(logs)
        self._take()

    @guarded
    def on_epoch_end(self, epoch, logs=None):
        self.timer.on_epoch_end(epoch, logs)
        self._take()
        self._epoch_done()

    @guarded
    def on_train_end(self, logs=None):
        self.timer.on_train_end(logs)
        self._take()
        self._deactivate()
        self._end()
