"""What every keras_gpufix callback shares: it never breaks `fit`.

- `guarded` wraps a hook so an internal error becomes one `GpufixWarning`
  (per callback and error type, at the user's line) and training goes on. Keras lets an exception
  raised in a callback propagate out of `fit`, which skips `on_train_end` of
  every callback (a profiler another callback started is then left running).
  An exception raised by the user's own function (`on_detect`) is not ours:
  it travels as a `UserError` and leaves the hook as itself, as Keras lets
  any callback's exception leave `fit`.
- `ScalarWriter` buffers TensorBoard scalars (and the verdict as text) in
  memory and writes them at epoch end, so logging costs nothing on the step
  path; every summary carries its description (TensorBoard shows it beside
  the chart).
"""

import functools
import os

import keras

from keras_gpufix.backends import NotSupported, current
from keras_gpufix.exceptions import warn

__all__ = ["guarded", "GuardedCallback", "ScalarWriter", "UserError"]


class UserError(Exception):
    """Carries an exception of the user's own function (its `__cause__`) through our guards."""


def guarded(hook):
    """Decorates a callback hook: errors become one warning, never a crash."""

    @functools.wraps(hook)
    def wrapper(self, *args, **kwargs):
        try:
            return hook(self, *args, **kwargs)
        except UserError as exc:
            error = exc.__cause__
        except Exception as exc:  # a monitor must never stop training
            self._report_failure(hook.__name__, exc)
            return None
        raise error  # outside the handler: the user's traceback, not ours

    return wrapper


class GuardedCallback(keras.callbacks.Callback):
    """Base class: failure-safe hooks.

    `errors` keeps the first `MAX_ERRORS` failures (hook, type, message);
    each error type is warned once.
    """

    MAX_ERRORS = 100

    def __init__(self):
        super().__init__()
        self._failures = set()
        self.errors = []

    def _report_failure(self, where, exc):
        if len(self.errors) < self.MAX_ERRORS:
            self.errors.append(f"{where}: {type(exc).__name__}: {exc}")
        if type(exc) in self._failures:
            return
        self._failures.add(type(exc))
        warn(f"{type(self).__name__}.{where} failed and was skipped "
             f"({type(exc).__name__}: {exc}); training continues.")


class ScalarWriter:
    """Buffered TensorBoard scalars under `log_dir/<run>`.

    Writes the `tensorboard` package's event files on every backend (no
    TensorFlow op: `backends.current().scalar_writer`). Where it is not
    installed it warns once and drops the scalars.
    At most `MAX_PENDING` scalars wait in memory (a long epoch flushes
    early). Each scalar is written with its description from
    `DESCRIPTIONS` (the tables of `StepTimer` and `GPUOscillationMonitor`);
    a tag not listed there says which callback wrote it.
    """

    MAX_PENDING = 8192
    DESCRIPTIONS = {
        "step_timer/step_ms": "StepTimer, each step: cycle time per step in ms (input wait + "
                              "step + time between steps)",
        "step_timer/epoch_mean_ms": "StepTimer, epoch end: mean cycle time per step of the "
                                    "epoch, ms",
        "step_timer/epoch_p95_ms": "StepTimer, epoch end: 95th percentile of the epoch's cycle "
                                   "times per step, ms",
        "step_timer/epoch_cv": "StepTimer, epoch end: coefficient of variation (std / mean) of "
                               "the epoch's cycle times",
        "step_timer/samples_per_s": "StepTimer, epoch end: samples per second over the epoch",
        "oscillation/cycle_ms": "GPUOscillationMonitor, each step: cycle time per step, ms",
        "oscillation/input_wait_ms": "GPUOscillationMonitor, each step: time waiting for the "
                                     "batch, per step, ms (measured by kg.data.instrument)",
        "oscillation/between_ms": "GPUOscillationMonitor, each step: host time between steps "
                                  "(callbacks, logging, checkpoints), per step, ms",
        "oscillation/cv": "GPUOscillationMonitor, each judgement: coefficient of variation of "
                          "the window's cycle times",
        "oscillation/median_ms": "GPUOscillationMonitor, each judgement: median cycle time of "
                                 "the window, ms",
        "oscillation/slow_time_share": "GPUOscillationMonitor, each judgement: share of the "
                                       "window's time lost to slow steps",
        "oscillation/input_wait": "GPUOscillationMonitor, each judgement: share of the cycle "
                                  "spent waiting for input",
        "oscillation/gpu_util": "GPUOscillationMonitor, each judgement: mean GPU utilisation "
                                "(NVML), percent",
        "oscillation/verdict": "GPUOscillationMonitor, text, each event ('<verdict>: "
                               "<message>. Fix: ...') and at the end of fit ('final: "
                               "<verdict>. Fix: ...', the verdict of report())",
    }

    def __init__(self, log_dir, run="keras_gpufix"):
        self.path = os.path.join(os.fspath(log_dir), run)
        self._pending = []
        self._writer = None
        self._disabled = False

    def add(self, tag, value, step):
        if not self._disabled and value is not None:
            self._pending.append((tag, float(value), int(step)))
            if len(self._pending) >= self.MAX_PENDING:
                self.flush()

    def text(self, tag, value, step):
        """A text summary (the TensorBoard Text tab), written with the scalars."""
        if not self._disabled:
            self._pending.append((tag, str(value), int(step)))

    def flush(self):
        if self._disabled or not self._pending:
            self._pending = []
            return
        if self._writer is None:
            try:
                self._writer = current().scalar_writer(self.path)
            except NotSupported as exc:
                self._disabled = True
                self._pending = []
                warn(str(exc))
                return
        pending, self._pending = self._pending, []
        for tag, value, step in pending:
            description = self.DESCRIPTIONS.get(
                tag, f"written by keras_gpufix's {tag.split('/')[0]} callback")
            self._writer.write(tag, value, step, description)
        self._writer.flush()

    def close(self):
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
