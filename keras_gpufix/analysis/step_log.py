"""Step records and the bounded step log.

One `StepRecord` per hook (a step, or N steps with `steps_per_execution=N`)
holds the three phases of the training cycle the user waits for:

| phase        | what it is                                                   |
|--------------|--------------------------------------------------------------|
| `input_wait` | waiting for the batch (the input pipeline was not ready)     |
| `step`       | the step itself (forward, backward, update, sync)            |
| `between`    | host time from the end of one step to the start of the next: |
|              | other callbacks, logging, checkpoints, evaluation            |

`StepLog` keeps a ring of the last `window` records and running totals of
the whole run (a fixed log-spaced histogram for the percentiles), so its
`summary()` is available at any time and its memory does not grow with the
run's length.
"""

import math
from collections import deque
from typing import NamedTuple, Optional

import numpy as np

__all__ = ["StepRecord", "StepLog", "summarize_step_times"]


class StepRecord(NamedTuple):
    """One step (or `steps` steps of one `steps_per_execution` hook).

    Times are seconds for the whole record. `input_wait` is None when it was
    not measured (it is then inside `step`). `split=False` says the span
    `step` holds the step and the work around it (a custom loop's body,
    where the wrapper cannot see where the step ends).
    """

    index: int
    steps: int
    input_wait: Optional[float]
    step: float
    between: float
    samples: Optional[int] = None
    audio_seconds: Optional[float] = None
    real_frames: Optional[int] = None
    shape: object = None
    new_shape: bool = False
    gpu_util: Optional[float] = None
    epoch: int = 0
    epoch_first: bool = False
    split: bool = True
    traces: int = 0
    compile_s: Optional[float] = None
    awaited: Optional[float] = None

    @property
    def cycle(self) -> float:
        """input_wait + step + between, in seconds."""
        return (self.input_wait or 0.0) + self.step + self.between


# Percentile histogram: 1 us .. 1e4 s per step, bins 1% wide (2316 bins).
_H_MIN, _H_RATIO = 1e-6, 1.01
_H_BINS = int(math.ceil(math.log(1e10) / math.log(_H_RATIO))) + 1
_H_LOG = math.log(_H_RATIO)


def _bin(seconds):
    if seconds <= _H_MIN:
        return 0
    return min(_H_BINS - 1, int(math.log(seconds / _H_MIN) / _H_LOG) + 1)


class StepLog:
    """The last `window` step records and running totals of the whole run.

    Args:
        window: records kept in the ring. Defaults to 96.

    Example:

    >>> log = StepLog(window=4)
    >>> for i in range(10):
    ...     log.add(StepRecord(i, 1, 0.001, 0.010, 0.0, samples=32))
    >>> round(log.summary()["samples_per_s"])
    2909
    """

    _SUMS = ("input_wait", "step", "between", "samples", "audio_seconds", "real_frames")

    def __init__(self, window: int = 96):
        if not isinstance(window, (int, np.integer)) or window < 2:
            raise ValueError(f"`window` must be an integer >= 2. Received: window={window!r}")
        self.window = int(window)
        self.reset()

    def reset(self):
        """Forgets every record."""
        self._ring = deque(maxlen=self.window)
        self.records_added = 0
        self.steps = 0
        self._sums = dict.fromkeys(self._SUMS, 0.0)
        self._known = dict.fromkeys(("samples", "audio_seconds", "real_frames"), True)
        self._waited_cycle = 0.0  # cycle time of the records whose wait was measured
        self._sum_sq = 0.0
        self._max = 0.0
        self._max_steps = 0
        self._hist = [0] * _H_BINS  # a list: cheaper to bump per record than an array

    def add(self, record: StepRecord):
        """Adds one record."""
        self._ring.append(record)
        self.records_added += 1
        n = max(1, int(record.steps))
        self.steps += n
        for name in self._SUMS:
            value = getattr(record, name)
            if value is None:
                self._known[name] = False
            else:
                self._sums[name] += value
        cycle = record.cycle
        if record.input_wait is not None:
            self._waited_cycle += cycle
        per = cycle / n
        self._sum_sq += n * per * per
        self._max = max(self._max, per)
        self._max_steps = max(self._max_steps, n)
        self._hist[_bin(per)] += n

    def records(self) -> list:
        """The last `window` records, oldest first."""
        return list(self._ring)

    def __len__(self):
        return len(self._ring)

    def _percentiles(self, qs):
        if self.records_added == len(self._ring):  # the whole run is in the ring: exact
            per = np.concatenate([np.full(max(1, r.steps), r.cycle / max(1, r.steps))
                                  for r in self._ring])
            return [float(np.percentile(per, q)) for q in qs]
        cum = np.cumsum(self._hist)
        out = []
        for q in qs:
            b = int(np.searchsorted(cum, q / 100.0 * cum[-1]))
            out.append(_H_MIN * _H_RATIO ** (b - 0.5) if b else _H_MIN)
        return out

    def summary(self) -> dict:
        """Figures of the whole run (per step, of the cycle).

        Returns:
            A dict: `count` (steps), `records`, `total_s`, `mean_ms`,
            `p50_ms`, `p95_ms`, `p99_ms`, `max_ms`, `std_ms`, `cv`,
            `steps_per_s`, `samples_per_s`, `audio_seconds_per_s`,
            `real_frames_per_s` (None when a record lacked them),
            `phases` (`step`, `between`, `input_wait` -> share of the cycle
            time; `input_wait` over the records where it was measured, None
            when none was), `input_wait` (its share) and `steps_per_record`
            (steps_per_execution as seen).
            With no records every figure but `count` is None. Percentiles
            are exact while the whole run fits in the ring, else from a
            histogram with 1 % wide bins.
        """
        keys = ("total_s", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms", "std_ms",
                "cv", "steps_per_s", "samples_per_s", "audio_seconds_per_s",
                "real_frames_per_s", "phases", "input_wait", "steps_per_record")
        if not self.steps:
            return {"count": 0, "records": 0, **dict.fromkeys(keys)}
        s = self._sums
        total = s["input_wait"] + s["step"] + s["between"]
        mean = total / self.steps
        var = max(0.0, self._sum_sq / self.steps - mean * mean)
        p50, p95, p99 = self._percentiles((50, 95, 99))

        def rate(name):
            return s[name] / total if self._known[name] and total > 0 else None

        phases = {p: (s[p] / total if total > 0 else 0.0) for p in ("step", "between")}
        # Over the records whose wait was measured (a record the probe could
        # not map, e.g. overwritten in its ring, has none); None if none was.
        phases["input_wait"] = (s["input_wait"] / self._waited_cycle
                                if self._waited_cycle > 0 else None)
        return {
            "count": self.steps,
            "records": self.records_added,
            "total_s": total,
            "mean_ms": mean * 1e3,
            "p50_ms": p50 * 1e3,
            "p95_ms": p95 * 1e3,
            "p99_ms": p99 * 1e3,
            "max_ms": self._max * 1e3,
            "std_ms": math.sqrt(var) * 1e3,
            "cv": math.sqrt(var) / mean if mean > 0 else 0.0,
            "steps_per_s": self.steps / total if total > 0 else None,
            "samples_per_s": rate("samples"),
            "audio_seconds_per_s": rate("audio_seconds"),
            "real_frames_per_s": rate("real_frames"),
            "phases": phases,
            "input_wait": phases["input_wait"],
            "steps_per_record": self._max_steps,
        }


def summarize_step_times(times, batch_sizes=None) -> dict:
    """Summarises an array of step wall times (all of them in memory).

    For a running log use `StepLog.summary()`.

    Args:
        times: step durations in seconds.
        batch_sizes: samples per step (one number, or one per step).
            Defaults to None (no samples/s).

    Returns:
        A dict with `count`, `total_s`, `mean_ms`, `p50_ms`, `p95_ms`,
        `p99_ms`, `max_ms`, `std_ms`, `cv` (std / mean), `steps_per_s` and
        `samples_per_s` (None without batch sizes). With no steps every
        figure but `count` is None.
    """
    t = np.asarray(list(times), dtype=np.float64)
    if t.ndim != 1:
        raise ValueError(f"`times` must be one-dimensional. Received shape {t.shape}")
    if t.size and (not np.all(np.isfinite(t)) or np.any(t < 0)):
        raise ValueError("`times` must be finite and non-negative.")
    keys = ("total_s", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms",
            "std_ms", "cv", "steps_per_s", "samples_per_s")
    if t.size == 0:
        return {"count": 0, **{k: None for k in keys}}
    total = float(t.sum())
    mean = float(t.mean())
    samples_per_s = None
    if batch_sizes is not None:
        b = np.broadcast_to(np.asarray(batch_sizes, dtype=np.float64), t.shape)
        samples_per_s = float(b.sum() / total) if total > 0 else None
    return {
        "count": int(t.size),
        "total_s": total,
        "mean_ms": mean * 1e3,
        "p50_ms": float(np.percentile(t, 50) * 1e3),
        "p95_ms": float(np.percentile(t, 95) * 1e3),
        "p99_ms": float(np.percentile(t, 99) * 1e3),
        "max_ms": float(t.max() * 1e3),
        "std_ms": float(t.std() * 1e3),
        "cv": float(t.std() / mean) if mean > 0 else 0.0,
        "steps_per_s": float(t.size / total) if total > 0 else None,
        "samples_per_s": samples_per_s,
    }
