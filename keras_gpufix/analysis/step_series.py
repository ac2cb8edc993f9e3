"""The run's timeline: every step record, downsampled to a bounded number of points.

`StepLog` keeps the last window and running totals; a kept run also needs
the shape of the whole run (where the input waited, where it compiled,
where it stalled) in a size that does not grow with its length. `StepSeries`
keeps at most `max_points` points: while there is room each point is one
record; when full, neighbouring points are merged in pairs and each new
point takes twice as many records. A 100,000-step run is at most
`max_points` points, each the mean of its records per step.

| column          | per point                                                 |
|-----------------|-----------------------------------------------------------|
| `first_step`    | the global index of its first step                        |
| `steps`         | steps it covers (`steps_per_execution` counted)           |
| `input_wait_ms` | mean input wait per step (None: not measured)             |
| `step_ms`       | mean step per step                                        |
| `between_ms`    | mean time between steps per step                          |
| `max_ms`        | its slowest record's cycle per step                       |
| `compiles`      | records that compiled (`step_compiled`: a new trace, a    |
|                 | new shape under XLA, compile time counted)                |
| `gpu_util`      | mean GPU utilisation, 0..1 (None: not sampled)            |
| `epoch`         | epoch of its first record                                 |
| `epoch_first`   | holds the first record of an epoch                        |
| `judged`        | every record in it was judged (after warmup, no epoch     |
|                 | start): the run's steady steps                            |
| `stall`         | a judged point whose slowest record is slow by THE        |
|                 | slow-step rule (`slow_limit` over the judged points)      |
"""

import numpy as np

from keras_gpufix.analysis.verdicts import slow_limit, step_compiled

__all__ = ["StepSeries"]

# Per point, while it is being filled and after: the sums of its records.
_FIRST, _STEPS, _WAIT, _WAITED, _STEP, _BETWEEN, _MAX, _COMPILES, _UTIL, _UTILS, \
    _EPOCH, _EPOCH_FIRST, _JUDGED, _RECORDS = range(14)


class StepSeries:
    """Every record of a run in at most `max_points` points (see the module's table).

    Args:
        max_points: points kept, even. Defaults to 1024.
        warmup: records at the start that are not judged (as the
            detector's `warmup`). Defaults to 0.

    Example:

    >>> series = StepSeries(max_points=8)
    >>> for i in range(100):
    ...     series.add(StepRecord(i, 1, 0.001, 0.010, 0.0))
    >>> d = series.as_dict()
    >>> len(d["step_ms"]) <= 8, sum(d["steps"])
    (True, 100)
    """

    def __init__(self, max_points: int = 1024, warmup: int = 0):
        if not isinstance(max_points, int) or max_points < 2 or max_points % 2:
            raise ValueError("`max_points` must be an even integer >= 2. "
                             f"Received: max_points={max_points!r}")
        self.max_points = max_points
        self.warmup = warmup
        self.reset()

    def reset(self):
        """Forgets every record."""
        self._points = []
        self._open = None
        self.stride = 1  # records per point
        self.records = 0

    def add(self, record, jit=None):
        """Adds one `StepRecord` (a few microseconds: it runs for every record of a run);
        `jit`: whether the step is XLA-compiled (a new shape compiles only then), None
        when not known."""
        self.records += 1
        p = self._open
        if p is None:
            self._open = p = [record.index, 0, 0.0, False, 0.0, 0.0, 0.0, 0, 0.0, 0,
                              record.epoch, False, True, 0]
        n = record.steps if record.steps > 1 else 1
        wait = record.input_wait
        cycle = record.step + record.between
        if wait is not None:
            p[_WAIT] += wait
            p[_WAITED] = True
            cycle += wait
        p[_STEPS] += n
        p[_STEP] += record.step
        p[_BETWEEN] += record.between
        if cycle / n > p[_MAX]:
            p[_MAX] = cycle / n
        if step_compiled(traces=record.traces, new_shape=record.new_shape, jit=jit,
                         compile_s=record.compile_s):
            p[_COMPILES] += 1
        if record.gpu_util is not None:
            p[_UTIL] += record.gpu_util
            p[_UTILS] += 1
        if record.epoch_first:
            p[_EPOCH_FIRST] = True
            p[_JUDGED] = False
        elif self.records <= self.warmup:
            p[_JUDGED] = False
        p[_RECORDS] += 1
        if p[_RECORDS] >= self.stride:
            self._points.append(p)
            self._open = None
            if len(self._points) >= self.max_points:
                self._points = [_merge(a, b) for a, b in
                                zip(self._points[::2], self._points[1::2])]
                self.stride *= 2

    def as_dict(self) -> dict:
        """The points as columns (lists; the module's table), with `stride`
        (records per point) and `records` (records added)."""
        points = self._points + ([self._open] if self._open is not None else [])
        out = {"stride": self.stride, "records": self.records}

        def per_step(i, p, digits=4):
            return round(p[i] / p[_STEPS] * 1e3, digits)

        out["first_step"] = [p[_FIRST] for p in points]
        out["steps"] = [p[_STEPS] for p in points]
        out["input_wait_ms"] = [per_step(_WAIT, p) if p[_WAITED] else None for p in points]
        out["step_ms"] = [per_step(_STEP, p) for p in points]
        out["between_ms"] = [per_step(_BETWEEN, p) for p in points]
        out["max_ms"] = [round(p[_MAX] * 1e3, 4) for p in points]
        out["compiles"] = [p[_COMPILES] for p in points]
        out["gpu_util"] = [round(p[_UTIL] / p[_UTILS], 3) if p[_UTILS] else None
                           for p in points]
        out["epoch"] = [p[_EPOCH] for p in points]
        out["epoch_first"] = [p[_EPOCH_FIRST] for p in points]
        out["judged"] = [p[_JUDGED] for p in points]
        cycles = np.array([(p[_WAIT] + p[_STEP] + p[_BETWEEN]) / p[_STEPS]
                           for p in points if p[_JUDGED]])
        limit = slow_limit(cycles) if cycles.size else None
        out["stall"] = [limit is not None and p[_JUDGED] and bool(p[_MAX] > limit)
                        for p in points]
        return out


def _merge(a, b):
    """One point of two neighbours (`a` first)."""
    return [a[_FIRST], a[_STEPS] + b[_STEPS], a[_WAIT] + b[_WAIT], a[_WAITED] or b[_WAITED],
            a[_STEP] + b[_STEP], a[_BETWEEN] + b[_BETWEEN], max(a[_MAX], b[_MAX]),
            a[_COMPILES] + b[_COMPILES], a[_UTIL] + b[_UTIL], a[_UTILS] + b[_UTILS],
            a[_EPOCH], a[_EPOCH_FIRST] or b[_EPOCH_FIRST], a[_JUDGED] and b[_JUDGED],
            a[_RECORDS] + b[_RECORDS]]
