"""Unsynced asynchronous steps: the signature, and the records to judge instead.

On a GPU (and with JAX, or TensorFlow's asynchronous eager execution) a step
call returns when its work is queued; the host waits only where it reads a
value back. A loop that reads its loss every k-th step and is timed without
a sync (a `CallbackList` loop, `kg.watch(..., sync=False)`) then shows k-1
steps at dispatch cost and one long step that waits for all k, the sum of
each k steps steady: the device is busy the whole time and nothing is lost.
Per-step times are not measured there; only each k-step period is.

`fold_unsynced(records)` finds that signature and turns each period into
one record of k steps (as a hook of `steps_per_execution=k` is), which the
detector judges instead: the period's mean is the step.
"""

import numpy as np

from keras_gpufix.analysis.step_log import StepRecord
from keras_gpufix.analysis.verdicts import THRESHOLDS, slow_limit

__all__ = ["fold_unsynced"]


def fold_unsynced(records, thresholds=None):
    """The periods of unsynced asynchronous steps, one record each; or None.

    The signature, at the period k >= 2 that shows it most clearly (records
    taken k at a time, the median of each position over at least
    `min_periods` periods): exactly one position is slow (the slow-step
    rule over all records: the host read that waits for the queued work),
    and one is at dispatch cost (its `step`, the input wait and the time
    between steps apart, at most `dispatch_share` of the mean `step`). On
    JAX all steps but the read are at dispatch cost; on TensorFlow's
    asynchronous eager execution the `next()` after a dispatch queues
    behind the device's work, so only the step after the read is. Work on a
    schedule in synced steps (a plot every k steps) fails the second test,
    the other steps keeping their real cost, unless it is more than about
    three times the k steps together: times alone cannot tell that from
    unsynced steps, so the detector skips this where steps are known
    synced (`kg.watch` says so; in `fit` Keras turns the logs into numbers
    before the end hook, waiting for the step). Whether the periods' total time is steady is then
    judged on the folded records, as any step time is.

    Positions follow the records' step `index`, and a period starts after
    the slow position, so each folded record holds the dispatches and the
    read that waited for them, as a hook of `steps_per_execution=k` does
    (a period missing a record, an epoch's first, holds the steps it has);
    the partial periods at both ends are left out.

    Args:
        records: `StepRecord`s, oldest first, one step each (records of
            several steps are not dispatches of one).
        thresholds: overrides of `THRESHOLDS` by name. Defaults to None.

    Returns:
        None when the signature is not there, else a list of `StepRecord`s
        of k steps each.
    """
    th = {**THRESHOLDS, **(thresholds or {})}
    if len(records) < 6 or any(r.steps != 1 for r in records):
        return None
    cycle = np.array([r.cycle for r in records], np.float64)
    own = np.array([r.step for r in records], np.float64)
    limit = slow_limit(cycle, factor=th["slow_factor"], min_ms=th["min_slow_ms"], spread=False)
    cheap = th["dispatch_share"] * own.mean()
    if np.count_nonzero(cycle > limit) < 2 or not np.any(own <= cheap):
        return None  # the common case, decided without the search below
    index = np.array([r.index for r in records])
    found = []  # (how far the slow position stands above the others, period, its start)
    for period in range(2, cycle.size // th["min_periods"] + 1):
        # Positions by step index: an epoch's first record, left out of the
        # window, must not shift the schedule.
        position = index % period
        slowest = np.array([np.median(cycle[position == p]) for p in range(period)])
        if np.count_nonzero(slowest > limit) != 1:
            continue
        if min(np.median(own[position == p]) for p in range(period)) > cheap:
            continue
        slow = int(slowest.argmax())
        others = np.delete(slowest, slow)
        found.append((slowest[slow] / max(float(others.max()), 1e-12), period,
                      (slow + 1) % period))
    if not found:
        return None
    # the period whose slow position stands out most: a shorter one that passes by
    # chance (a few slow reads falling on one position) stands out less
    _, period, start = max(found)
    groups = {}
    for record, first in zip(records, index - (index - start) % period):
        groups.setdefault(int(first), []).append(record)
    return [_one(rs) for first, rs in groups.items()
            if first >= index[0] and first + period - 1 <= index[-1]]


def _sum(values):
    return None if any(v is None for v in values) else sum(values)


def _one(rs):
    """One record of the steps `rs`."""
    utils = [r.gpu_util for r in rs if r.gpu_util is not None]
    return StepRecord(
        index=rs[0].index, steps=len(rs), input_wait=_sum([r.input_wait for r in rs]),
        step=sum(r.step for r in rs), between=sum(r.between for r in rs),
        samples=_sum([r.samples for r in rs]), audio_seconds=_sum([r.audio_seconds for r in rs]),
        real_frames=_sum([r.real_frames for r in rs]), shape=rs[0].shape,
        new_shape=any(r.new_shape for r in rs),
        gpu_util=float(np.mean(utils)) if utils else None, epoch=rs[0].epoch,
        split=all(r.split for r in rs), traces=sum(r.traces for r in rs))
