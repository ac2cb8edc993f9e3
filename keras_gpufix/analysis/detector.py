"""The cost-based detector: which cause costs the training cycle its time.

`judge(records)` looks at a window of `StepRecord`s and has no side
effects. It judges by cost: the share of the cycle time (`input_wait +
step + between`) lost to slow steps (their excess over the expected
cycle, by the one slow-step rule `verdicts.slow_mask`: the median cycle,
its step expected from steps of the same input shape, so batches of uneven
length are not slow steps), the phase where that excess lies, and its
period (autocorrelation of the excess, of the cycle or of one phase: work
between uneven steps shows in its own phase). `OscillationDetector`
feeds records into a bounded window, judges it every `hop` records, turns
persistent verdicts into events and gives the run's one verdict
(`OscillationDetector.verdict()`). `weigh` takes other evidence of the same
run (an XProf trace, the what-if) into that verdict and says which reading
it believes and why.
"""

import sys
from collections import Counter, deque

import numpy as np

from keras_gpufix.analysis.dispatch import fold_unsynced
from keras_gpufix.analysis.step_log import StepLog, StepRecord
from keras_gpufix.analysis.verdicts import (
    FIXES,
    NOT_CAUSES,
    PHASES,
    THRESHOLDS,
    TOO_FEW_STEPS,
    INPUT_UNMEASURED,
    UNSYNCED_NOTE,
    fix_for,
    is_recompiling,
    recompile_cost,
    slow_limit,
    slow_mask,
    speedup_of,
    step_compiled,
)

__all__ = ["judge", "weigh", "what_if_input_cost", "locate_periodic", "sampled_share",
           "OscillationDetector"]


def _period(excess, threshold, min_spikes=3):
    """Period (in steps) of an excess series by autocorrelation.

    `excess` holds each slow step's time above the median (0 elsewhere), so
    large stalls weigh more than small slow steps.

    Returns:
        `(period, autocorrelation)`; `period` is None when there is none.
    """
    n = excess.size
    if np.count_nonzero(excess) < min_spikes:
        return None, 0.0
    x = excess - excess.mean()
    denom = float(np.dot(x, x))
    if denom == 0.0:
        return None, 0.0
    lags = np.arange(2, n // 2 + 1)
    if not lags.size:
        return None, 0.0
    acf = np.array([np.dot(x[:-lag], x[lag:]) / denom for lag in lags])
    best = int(np.argmax(acf))
    # Prefer the fundamental: the smallest lag whose correlation is close to
    # the best one (multiples of the period correlate too).
    candidates = np.nonzero(acf >= max(threshold, 0.8 * acf[best]))[0]
    if candidates.size == 0:
        return None, float(acf[best])
    lag = int(candidates[0])
    return int(lags[lag]), float(acf[lag])


def _in_step(excess, period):
    """The positions in step with `period`: the offset holding the most excess."""
    offsets = np.arange(excess.size) % period
    best = int(np.argmax(np.bincount(offsets, weights=excess, minlength=period)))
    return offsets == best


def _after_effect(cycle, on, n, z):
    """Seconds the cycles right after each stall (`on`) took above the period's other
    cycles: the after cycles' median over the others' median, times their steps, when
    it exceeds `z` standard errors of the two medians (a robust spread of the others);
    0 otherwise."""
    after = np.zeros_like(on)
    after[1:] = on[:-1]
    after &= ~on
    rest = ~(on | after)
    if after.sum() < 2 or rest.sum() < 2:
        return 0.0
    base = float(np.median(cycle[rest]))
    effect = float(np.median(cycle[after])) - base
    spread = 1.4826 * float(np.median(np.abs(cycle[rest] - base)))
    error = spread * np.sqrt(np.pi / 2 * (1.0 / after.sum() + 1.0 / rest.sum()))
    if effect <= 0.0 or effect <= z * error:
        return 0.0
    return effect * float(n[after].sum())


def _elements(shape):
    """Elements per batch of a shape key (`((B, T, F), (B,))`), or None."""
    try:
        return float(sum(np.prod([int(d) for d in leaf]) for leaf in shape))
    except (TypeError, ValueError):
        return None


def _theil_sen(x, y):
    """`(intercept, slope)` of the Theil-Sen line through points (x, y), or None."""
    dx = x[None, :] - x[:, None]
    dy = y[None, :] - y[:, None]
    pairs = np.triu(dx != 0, k=1)
    if not pairs.any():
        return None
    slope = float(np.median(dy[pairs] / dx[pairs]))
    return float(np.median(y - slope * x)), slope


def _expected_step(shapes, step, min_steps):
    """Each record's expected step time (per step), from steps of its own shape.

    The median step of the record's input shape when that shape was seen
    `min_steps` times; otherwise the Theil-Sen line of step time vs
    elements per batch over the shapes' medians (robust to a stalled
    step); without shapes (or with one), the median step. So steps of
    uneven length (speech batches) are not slow steps, and a stall is
    measured against steps like its own.
    """
    base = np.full(step.size, float(np.median(step)))
    groups = {}
    for i, shape in enumerate(shapes):
        if shape is not None:
            groups.setdefault(shape, []).append(i)
    if len(groups) < 2:
        return base
    medians = {shape: float(np.median(step[rows])) for shape, rows in groups.items()}
    sizes = {shape: _elements(shape) for shape in groups}
    sized = [shape for shape in groups if sizes[shape] is not None]
    line = _theil_sen(np.array([sizes[s] for s in sized]),
                      np.array([medians[s] for s in sized])) if len(sized) >= 2 else None
    for shape, rows in groups.items():
        if len(rows) >= min_steps:
            base[rows] = medians[shape]
        elif line is not None and sizes[shape] is not None:
            base[rows] = max(0.0, line[0] + line[1] * sizes[shape])
    return base


def _padding(rs, step, n):
    """The padding in the window's batches and the step time spent on it.

    A record's batch is padded when its shape key's largest tensor (the
    features, `(B, T, ...)`) holds more frames (`B x T` a step) than the
    record's real frames (`kg.data.instrument(frames=...)`: the utterances'
    own lengths). The step's time per element is the slope of the Theil-Sen
    line of step time vs elements per batch over the shapes' median steps
    (how the step itself grows with its batch, robust to a stalled step),
    at most the step's time in proportion to its padded elements; with one
    shape, or shapes within 1.25x of each other's elements (batches all
    padded to about the same longest utterance), the slope cannot be
    measured, and that proportion (an upper bound) is the price.

    Args:
        rs: the window's records.
        step: each record's step time, per step (seconds).
        n: each record's steps.

    Returns:
        None when no record says its real frames (or its shape); else a dict
        `padding` (the share of the features' frames that are padding),
        `seconds` (the step time spent on it, over the window), `shapes`
        (distinct input shapes in the window) and `per_element` (the
        slope, seconds per element; None with one shape).
    """
    rows = []
    for i, r in enumerate(rs):
        key = r.shape
        if key is None or not r.real_frames or r.real_frames <= 0:
            continue
        sizes = [_elements((dims,)) for dims in key]
        if any(s is None for s in sizes):
            continue
        features = key[int(np.argmax(sizes))]
        if len(features) < 2:
            continue
        frames = float(features[0]) * float(features[1]) * n[i]
        if not 0 < r.real_frames <= frames:
            continue
        padding = 1.0 - r.real_frames / frames
        rows.append((i, key, frames, padding, padding * max(sizes) * n[i], sum(sizes)))
    if not rows:
        return None
    groups = {}
    for i, key, *_ in rows:
        groups.setdefault(key, []).append(step[i])
    slope = None
    sizes = np.array([_elements(k) for k in groups])
    if len(groups) >= 2 and sizes.max() >= 1.25 * sizes.min():
        line = _theil_sen(sizes, np.array([float(np.median(groups[k])) for k in groups]))
        slope = None if line is None else max(0.0, line[1])
    seconds = 0.0
    for i, key, frames, padding, padded, elements in rows:
        # at most the step's share of padded elements: a step that costs more per
        # element than its own time per element is a noisy slope, not the padding
        most = step[i] * n[i] * padded / elements
        seconds += most if slope is None else min(most, slope * padded)
    frames = sum(row[2] for row in rows)
    return {"padding": sum(row[2] * row[3] for row in rows) / frames, "seconds": seconds,
            "shapes": len(groups), "per_element": slope}


def _recurring(counts, most):
    """`(column, period, offset)` of the line (a column of `counts`, samples per cycle)
    seen in the cycles of one offset of a period and seldom in the others, or None.

    A line that runs every `period` cycles (a plot every 5 steps) is sampled in the
    cycles of its offset and in no other, however the load spreads the cycles'
    times; a line every cycle runs (the step) is seen everywhere, a line sampled by
    chance seldom anywhere. Each line's score is the share of its offset's cycles
    it was seen in less the share of the other cycles; the best line at the period
    with the best score (its multiples score lower: half their offsets miss)."""
    seen = counts > 0
    best = None
    for period in range(2, most + 1):
        offsets = np.arange(seen.shape[0]) % period
        for column in range(seen.shape[1]):
            hits = np.bincount(offsets, weights=seen[:, column], minlength=period)
            sizes = np.bincount(offsets, minlength=period)
            offset = int(np.argmax(hits / sizes))
            others = sizes.sum() - sizes[offset]
            score = hits[offset] / sizes[offset] - (hits.sum() - hits[offset]) / others
            if sizes[offset] >= _MIN_RECURRING and (best is None or score > best[0]):
                best = (score, column, period, offset)
    if best is None or best[0] < _RECURRING_SCORE:
        return None
    return best[1], best[2], best[3]


#: A line seen in the cycles of one offset of a period and seldom in the others: its
#: score (the share of its offset's cycles it was seen in less the others') from which
#: it is named, and the fewest cycles at its offset.
_RECURRING_SCORE = 0.6
_MIN_RECURRING = 4


def locate_periodic(cycles, samples, period, thresholds=None):
    """Where the work every `period` steps runs, from stack samples.

    A sampler counts, in each cycle, where the program was (a source line)
    at regular instants. The cycles in step with the period (the offset
    holding the most excess over the median cycle, as the detector finds
    it) spend extra time; the line that holds most of their extra samples
    over the other cycles' is where the periodic work runs.

    Under load (6-7 runnable processes on 2 cores) the cycles' times lose
    the period: other processes' slices make any cycle slow, and the
    detector may find stalls with no period. The samples keep it: the work's
    line is seen in its own cycles only. Where the times name no line (or no
    period was given), the line seen in the cycles of one offset of a period
    and seldom in the others is named (`_recurring`), with that period.

    Args:
        cycles: seconds of each cycle (the part that was sampled), oldest
            first.
        samples: one dict per cycle, location -> samples taken there (or the
            seconds they stand for, where the sampler's interval varies).
        period: the stall's period, in cycles; None where the run found
            stalls with no period (the samples' own period is looked for).
        thresholds: overrides of `THRESHOLDS` (`locate_share`, `locate_z`).

    Returns:
        `(location, share, period)`: the location, the share of the in-step
        cycles' extra samples it holds and the period; None when no location
        holds `locate_share` of them by at least `locate_z` standard errors
        and no line recurs with a period (or too few cycles were sampled).
    """
    th = {**THRESHOLDS, **(thresholds or {})}
    t = np.asarray(cycles, dtype=np.float64)
    if period is not None and period < 2 or len(samples) != t.size or t.size < 2 * (
            period or _MIN_RECURRING):
        return None
    places = sorted({place for counts in samples for place in counts})
    if not places:
        return None
    counts = np.array([[c.get(place, 0) for place in places] for c in samples], np.float64)
    if period is not None:
        on = _in_step(np.maximum(0.0, t - np.median(t)), period)
        found = None if on.all() else _extra_place(counts, on, th)
        if found is not None:
            return places[found[0]], found[1], period
    # each offset of a period searched holds `_MIN_RECURRING` cycles (30 cycles: up to 7)
    recurring = _recurring(counts, period or max(2, t.size // _MIN_RECURRING))
    if recurring is None or period is not None and period % recurring[1]:
        return None  # none, or not the period the run found (nor one it holds)
    column, found_period, offset = recurring
    on = np.arange(t.size) % found_period == offset
    extra = counts[on].mean(axis=0) - counts[~on].mean(axis=0)
    total = float(extra[extra > 0].sum())
    return places[column], float(extra[column] / total) if total > 0 else 1.0, found_period


def sampled_share(samples, location) -> float:
    """The share of the sampled time (every cycle's samples) that `location` holds
    above its median cycle's count: the time of work it runs in some cycles only (a
    plot every 5 steps), not of what every cycle runs there.

    Args:
        samples: one dict per cycle, location -> samples taken there (or the
            seconds they stand for, where the sampler's interval varies).
        location: the line (`locate_periodic`'s).
    """
    total = sum(sum(c.values()) for c in samples)
    if not total:
        return 0.0
    at = np.array([c.get(location, 0) for c in samples], dtype=np.float64)
    return float(np.maximum(0.0, at - np.median(at)).sum() / total)


def _extra_place(counts, on, th):
    """`(column, share)` of the line holding most of the in-step cycles' (`on`) extra
    samples, by `locate_share` of them and `locate_z` standard errors; else None."""
    extra = counts[on].mean(axis=0) - counts[~on].mean(axis=0)
    total = float(extra[extra > 0].sum())
    best = int(np.argmax(extra))
    if total <= 0 or extra[best] / total < th["locate_share"]:
        return None
    # its extra must stand out of its own cycle-to-cycle spread (picking the
    # offset with the most excess favours some line by chance)
    spread = np.sqrt(counts[on, best].var() / on.sum() + counts[~on, best].var() / (~on).sum())
    if extra[best] < th["locate_z"] * max(spread, 1e-12) and spread > 0:
        return None
    return best, float(extra[best] / total)


def _judgement(verdict, evidence, period=None, phase=None, cost_share=None):
    return {"verdict": verdict, "phase": phase, "period": period,
            "cost_share": cost_share, "evidence": evidence}


def judge(records, thresholds=None, baseline_ms=None, jit=None, eager=False,
          shapes_seen=0, synced=None, async_blockers=None, input_workers=None) -> dict:
    """Judges a window of step records; no side effects.

    Beside the verdict (the first cause in precedence order), `causes`
    lists every cause the window measured, each with its own share of the
    window's time, never one's time counted in another's: `recompiling`
    (the compiling steps' excess), `eager_step` (the steady step time: the
    most compiling the step can save; the stalls' excess is not in it),
    `periodic_stall` (the excess of the cycles in step with the period, and
    of the cycles right after them where those run slower: its after-effect,
    taken out of the steady step time) and
    `input_bound` (the input wait). Fixing each alone makes the window
    `1 / (1 - share)` faster.

    Args:
        records: `StepRecord`s, oldest first (the first record of an epoch is
            left out: iterator creation and shuffle-buffer filling happen
            there).
        thresholds: overrides of `THRESHOLDS` by name. Defaults to None.
        baseline_ms: the first judged window's median cycle (for
            `degrading`). Defaults to None (not judged).
        jit: whether the step is XLA-compiled (new shapes then compile).
        eager: the step is known to run eagerly (direct evidence).
        shapes_seen: distinct input shapes seen in the run so far.
        synced: whether each step was timed to the end of its device work
            (`kg.watch` syncs; None: not known). Unless True, unsynced
            asynchronous steps (`dispatch.fold_unsynced`) are judged per
            period, `evidence["unsynced_period"]` says so.
        async_blockers: the callbacks that turned Keras's asynchronous
            dispatch off (names), or None (it is on, or the backend has
            none). Their price: the host time of each cycle (between steps
            and waiting for input) that would overlap the device step with
            dispatch on, at most the step (`sync_callbacks`); where the
            records hold what the host `awaited` after dispatching each
            step, the host's part is the rest of the cycle.
        input_workers: workers that make the batches in parallel (a
            PyDataset's), or None. Their batches arrive in bursts: an input
            wait that recurs every `input_workers` batches or fewer is the
            input being slow as a whole (`input_bound`), not a stall on a
            schedule.

    Returns:
        A dict `verdict`, `phase` (where the time goes: `input_wait`,
        `step`, `between`, `loop_body`, or None), `period`, `cost_share`
        (share of the window's cycle time the cause cost), `evidence`
        (figures, and `signals`: the evidence used) and `causes` (dicts
        `verdict`, `share`, `speedup` (the whole run's once the cause's time
        goes: `speedup_of(share)`), `phase`, `period`; the verdict's first).
    """
    judgement = _judge(records, thresholds, baseline_ms, jit, shapes_seen, synced,
                       async_blockers, input_workers)
    ev = judgement["evidence"]
    also = ev.pop("also", [])
    causes = [] if judgement["verdict"] in NOT_CAUSES else [_cause(judgement)]
    causes += [_cause(j) for j in also]
    if eager and judgement["verdict"] not in ("unknown", "recompiling"):
        ev["signals"].append("eager")
        judgement = _judgement("eager_step", ev, phase="step",
                               cost_share=ev["steady_step_share"])
        causes.insert(0, _cause(judgement))
    judgement["causes"] = causes
    return judgement


def _cause(judgement):
    share, ev = judgement["cost_share"], judgement["evidence"]
    return {"verdict": judgement["verdict"], "share": share,
            "speedup": None if share is None else speedup_of(share),
            "phase": judgement["phase"], "period": judgement["period"],
            "fix": fix_for(judgement["verdict"], phase=judgement["phase"],
                           period=judgement["period"], share=share, **_fix_fields(ev))}


def _fix_fields(ev):
    """The fields of a fix text that come from a judgement's evidence."""
    return {"padding": ev.get("padding"), "shapes": ev.get("shapes")}


def _judge(records, thresholds, baseline_ms, jit, shapes_seen, synced, async_blockers,
           input_workers):
    """`judge` without the eager step: the verdict in precedence order; a periodic
    stall's window that also waits for input lists that in `evidence["also"]`."""
    th = {**THRESHOLDS, **(thresholds or {})}
    rs = [r for r in records if not r.epoch_first]
    if len(rs) < th["min_judge_steps"]:
        return _judgement("unknown", {"signals": [], "records": len(rs)})
    # Steps that compiled (a new trace, or a new shape under XLA), priced
    # and judged by the one rule (`recompile_cost`, `is_recompiling`). Only
    # a step at a new shape or with new traces can have compiled, and a step
    # that did not compile costs 0: only those that did are priced.
    seen_shapes = any(r.new_shape or r.traces or r.compile_s for r in rs)
    if seen_shapes:
        how = [{"traces": r.traces, "new_shape": r.new_shape, "jit": jit,
                "compile_s": r.compile_s} for r in rs]
        compiled = [step_compiled(**h) for h in how]
        compile_s = 0.0
        if any(compiled):
            # The reference is the steps that did not compile; when every step
            # compiled (a new shape at each), each whole step counts: an upper bound.
            normal = [r.step / max(1, r.steps) for r, c in zip(rs, compiled) if not c]
            med_step = float(np.median(normal)) if normal else 0.0
            compile_s = sum(recompile_cost(r.step, med_step, max(1, r.steps), **h)
                            for r, h, c in zip(rs, how, compiled) if c)
        recompiling, compile_share = is_recompiling(
            compile_s, sum(r.cycle for r in rs), retraces=sum(r.traces for r in rs),
            late_compiles=sum(1 for r, c in zip(rs, compiled)
                              if c and r.new_shape and r.epoch > 0),
            shapes=shapes_seen, max_new_shapes=th["max_new_shapes"], cost_share=th["cost_share"])
        if any(compiled) and not recompiling:
            # Compiles that stop (a bounded set of shapes compiling once each
            # in the first epoch) or cost little are warm-up, not a stall:
            # leave those steps out.
            rs = [r for r, c in zip(rs, compiled) if not c]
            if len(rs) < th["min_judge_steps"]:
                return _judgement("unknown", {"signals": [], "records": len(rs)})
    # Unsynced asynchronous steps (issue 26): judge each period of k steps.
    folded = None if synced else fold_unsynced(rs, th)
    rs = folded or rs
    n = np.array([max(1, r.steps) for r in rs], np.float64)
    waits_known = all(r.input_wait is not None for r in rs)
    phase = {
        "input_wait": np.array([r.input_wait or 0.0 for r in rs]) / n,
        "step": np.array([r.step for r in rs]) / n,
        "between": np.array([r.between for r in rs]) / n,
    }
    cycle = phase["input_wait"] + phase["step"] + phase["between"]
    total = float(np.dot(cycle, n))
    med = float(np.median(cycle))
    # Each phase's expected time: its median, and for the step the median
    # of steps of the same input shape (`_expected_step`); each cycle is
    # judged against its own expected cycle, so uneven steps are not slow.
    base = {p: np.full(cycle.size, float(np.median(x))) for p, x in phase.items()}
    if not folded:  # a folded record holds k steps of several shapes
        base["step"] = _expected_step([r.shape for r in rs], phase["step"],
                                      th["shape_min_steps"])
    expected = med + base["step"] - float(np.median(phase["step"]))
    slow = slow_mask(cycle, expected, th["slow_factor"], th["min_slow_ms"], spread=False)
    excess = np.where(slow, cycle - expected, 0.0)
    lost = float(np.dot(excess, n))
    lost_share = lost / total if total > 0 else 0.0
    mean = float(cycle.mean())
    cv = float(cycle.std() / mean) if mean > 0 else 0.0
    dev = {p: x - base[p] for p, x in phase.items()}
    where = None
    if slow.any():  # where the slow steps' excess lies, phase by phase
        phase_excess = {p: float(np.dot(np.where(slow, np.maximum(0.0, dev[p]), 0.0), n))
                        for p in PHASES}
        where = max(PHASES, key=lambda p: phase_excess[p])
    ev = {
        "signals": ["step_time"] + (["input_wait"] if waits_known else []),
        "median_ms": med * 1e3,
        "cv": cv,
        "slow_steps": int(slow.sum()),
        "slow_time_share": lost_share,
        "phases": {p: float(np.dot(x, n)) / total if total > 0 else 0.0
                   for p, x in phase.items()},
        "slow_phase": where,
    }
    if not waits_known:
        ev["phases"]["input_wait"] = None
    if folded:
        ev["signals"].append("unsynced_dispatch")
        # a period missing a record (an epoch's first) holds fewer: the largest is its length
        ev["unsynced_period"] = int(n.max())
    split = all(r.split for r in rs)
    new_shape = np.array([r.new_shape or r.traces > 0 for r in rs])
    if seen_shapes:
        ev["signals"].append("new_shape")
        ev["new_shapes"] = int(sum(r.new_shape for r in rs))
        ev["recompile_ms"] = compile_s * 1e3
        ev["recompile_share"] = compile_share
        if recompiling:
            ev["slow_steps_at_new_shapes"] = int(np.sum(slow & new_shape))
            return _judgement("recompiling", ev, phase="step", cost_share=compile_share)

    # The step time without the slow cycles' excess: what compiling an eager
    # step can save at most (a stall's excess is the stall's own cost).
    ev["steady_step_share"] = (float(np.dot(np.minimum(phase["step"], base["step"]), n)) / total
                               if total > 0 else 0.0)
    wait_share = ev["phases"]["input_wait"]
    if wait_share is not None:
        ev["input_wait"] = wait_share
    padded = None if folded else _padding(rs, phase["step"], n)
    padded_share = 0.0
    if padded is not None:
        padded_share = padded["seconds"] / total if total > 0 else 0.0
        ev["signals"].append("padding")
        ev.update(padding=padded["padding"], padding_time_share=padded_share,
                  shapes=max(shapes_seen, padded["shapes"]))
    padding_costs = padded_share >= th["cost_share"]
    utils = [r.gpu_util for r in rs if r.gpu_util is not None]
    util = None
    if utils:
        ev["signals"].append("gpu_util")
        util = ev["gpu_util"] = float(np.mean(utils))

    # periodic_stall: the excess recurs with a period and the recurring part
    # alone (the cycles in step with the period) costs >= cost_share. The
    # period is looked for in the cycles' excess, then in each phase's: a
    # phase's excess counts in slow cycles and where it alone would make
    # its cycle slow; it costs its excess in step over the other cycles'.
    # The wait and the time between steps are looked at even when the
    # slow cycles lost little: work there every k steps hides in the cycle
    # when the steps are uneven (their own variation is not a stall).
    phase_excess = {
        p: np.where(slow | slow_mask(expected + dev[p], expected, th["slow_factor"],
                                     th["min_slow_ms"], spread=False),
                    np.maximum(0.0, dev[p]), 0.0)
        for p in PHASES}
    sources = [(p, phase_excess[p]) for p in ("input_wait", "between")]
    if lost_share >= th["cost_share"] and lost * 1e3 >= th["min_lost_ms"]:
        sources = [("cycle", excess)] + list(phase_excess.items())
    for source, x in sources:
        period, acf = _period(x, th["acf_threshold"])
        if period is None:
            continue
        on = _in_step(x, period)
        if source == "cycle":
            cost = float(np.dot(x[on], n[on]))
        else:
            cost = float(np.dot(dev[source][on] - np.median(dev[source][~on]), n[on]))
        share = cost / total if total > 0 else 0.0
        if share < th["cost_share"] or cost * 1e3 < th["min_lost_ms"]:
            continue  # noise that lines up by chance costs little in step
        stall_phase = max(PHASES, key=lambda p: float(np.dot(phase_excess[p][on], n[on])))
        if stall_phase == "input_wait" and input_workers and period <= input_workers:
            continue  # the workers' bursts: judged as input_bound below
        if (stall_phase == "input_wait" and wait_share is not None
                and wait_share - share >= max(th["input_wait_share"], share)):
            # The input is waited for at every step, the periodic part is the
            # lesser cost (a loop that reads its loss every k steps while the
            # device idles in next()): input_bound, judged below.
            break
        if stall_phase == "step" and not split and not new_shape.any():
            # A fixed-shape step does not cost more every k steps; work
            # on a schedule in an unsplit loop body does.
            stall_phase = "loop_body"
        # The cycles right after each stall, slower than the others, are its
        # after-effect: the fix removes them too (tests/loop_patterns.py xtts and
        # accum_plot: the step after the plot's sleep ran 30-35% slower than the
        # period's others). Priced with the stall, taken out of the steady step
        # time (the eager step's cause) so no time is counted twice.
        after = _after_effect(cycle, on, n, th["after_effect_z"]) / total if total > 0 else 0.0
        ev.update(period=period, autocorrelation=acf, period_from=source,
                  periodic_time_share=share, after_effect_share=after)
        ev["steady_step_share"] = max(0.0, ev["steady_step_share"] - after)
        if wait_share is not None and wait_share >= th["input_wait_share"]:
            ev["also"] = [_judgement("input_bound", ev, phase="input_wait",
                                     cost_share=wait_share)]
        if padding_costs:
            ev.setdefault("also", []).append(
                _judgement("padded_batches", ev, phase="step", cost_share=padded_share))
        return _judgement("periodic_stall", ev, period, stall_phase, share + after)

    if wait_share is not None and wait_share >= th["input_wait_share"]:
        # While the input is the bound, a lighter step waits longer: the
        # padding's time is a cause beside it, ranked by its share.
        if padding_costs:
            ev["also"] = [_judgement("padded_batches", ev, phase="step",
                                     cost_share=padded_share)]
        return _judgement("input_bound", ev, phase="input_wait", cost_share=wait_share)
    if padding_costs:
        # The run's own measurements say where the step's time goes: no stall
        # verdict (whose fix is a trace) is given past it.
        return _judgement("padded_batches", ev, phase="step", cost_share=padded_share)
    if async_blockers:
        # With dispatch on, the host's part of each cycle overlaps the device's:
        # the smaller of the two is lost per step. The device's part is what the
        # host awaited after dispatching (`StepRecord.awaited`); without it, the
        # step is taken as the device's and the host's part is what the hooks see.
        awaited = [r.awaited for r in rs]
        if all(a is not None for a in awaited):
            device = np.array(awaited) / n
            host = cycle - device
        else:
            device, host = phase["step"], phase["between"] + phase["input_wait"]
        sync_share = float(np.dot(np.minimum(host, device), n)) / total if total else 0.0
        ev.update(sync_callbacks=list(async_blockers), sync_host_ms=float(np.median(host)) * 1e3,
                  sync_time_share=sync_share)
        if sync_share >= th["cost_share"]:
            ev["signals"].append("sync_callbacks")
            return _judgement("sync_callbacks", ev, phase="between", cost_share=sync_share)
    if util is not None and util < th["low_gpu_util"]:
        if wait_share is None and med * 1e3 >= th["short_step_ms"]:
            return _judgement("input_bound", ev, phase="input_wait", cost_share=1.0 - util)
        if wait_share is None or wait_share < th["input_wait_share"]:
            return _judgement("dispatch_bound", ev, phase="step", cost_share=1.0 - util)
    stalls = slow_mask(cycle, expected, th["stall_factor"], th["min_slow_ms"])
    stalled = float(np.dot(np.where(stalls, cycle - expected, 0.0), n))
    ev["stall_time_share"] = stalled / total if total > 0 else 0.0
    if (ev["stall_time_share"] >= th["irregular_share"]
            and stalled * 1e3 >= 5 * th["min_lost_ms"]):
        return _judgement("irregular_stall", ev, phase=where,
                          cost_share=ev["stall_time_share"])
    if baseline_ms:
        growth = med * 1e3 / baseline_ms - 1.0
        ev["growth"] = growth
        if (growth >= th["growth_threshold"] and med * 1e3 - baseline_ms >= th["min_slow_ms"]
                and not slow.any()):
            return _judgement("degrading", ev, phase=None,
                              cost_share=1.0 - baseline_ms / (med * 1e3))
    return _judgement("healthy", ev)


class OscillationDetector:
    """Finds stalling, starved or recompiling training from step records.

    Records are kept in a window of `window` records; every `hop` records
    (once the window is full) the window is judged with `judge`. A verdict
    other than `healthy` becomes an event only after it held for
    `min_windows` consecutive judgements (`recompiling` and `eager_step`,
    direct evidence, at once); consecutive judgements with the same verdict
    extend one event. After a problem, a `healthy` judgement emits one
    `healthy` event (recovery). `finish()` judges a run shorter than the
    window at its end.

    Args:
        window: records per judged window. Defaults to 96 (long enough to
            see four periods of a stall every 20 steps).
        hop: records between judgements. Defaults to `window // 4`.
        warmup: records ignored at the start (compilation, first batches).
            Defaults to 5.
        min_windows: consecutive judgements a verdict must hold before it is
            reported. Defaults to 2.
        jit: whether the step is XLA-compiled (new shapes compile).
            Defaults to None (not known: new shapes are not priced).
        eager: the step runs eagerly. Defaults to False.
        synced: each step is timed to the end of its device work (see
            `judge`). Defaults to None (not known).
        eager_where: `file:line` where the step was made eager (a
            `run_eagerly=True`, an eager gradient), named by the
            `eager_step` fix. Defaults to None (not known: "at ?").
        **thresholds: overrides of `keras_gpufix.analysis.THRESHOLDS`
            (`slow_factor`, `cost_share`, `input_wait_share`, ...).

    Attributes:
        log: the `StepLog` of the records after warmup, the first of each
            epoch left out (the run's summary).
        events: the events so far (at most `MAX_EVENTS`).

    Example:

    >>> det = OscillationDetector(window=32, warmup=0)
    >>> events = [det.update(0.3 if i % 5 == 0 else 0.01) for i in range(200)]
    >>> [e["verdict"] for e in events if e]
    ['periodic_stall']
    """

    MAX_EVENTS = 100
    # `stall_limit()`: recent cycles it is taken over, and how often renewed.
    STALL_REFERENCE = 64
    STALL_RENEW = 16

    def __init__(self, window=96, hop=None, warmup=5, min_windows=2, jit=None, eager=False,
                 synced=None, eager_where=None, **thresholds):
        unknown = set(thresholds) - set(THRESHOLDS)
        if unknown:
            raise ValueError(f"Unknown thresholds {sorted(unknown)}; expected some of "
                             f"{sorted(THRESHOLDS)}")
        if window < 8:
            raise ValueError(f"`window` must be >= 8. Received: window={window}")
        hop = window // 4 if hop is None else hop
        if not 1 <= hop <= window:
            raise ValueError(
                f"`hop` must be in [1, window]. Received: hop={hop}, window={window}"
            )
        if warmup < 0:
            raise ValueError(f"`warmup` must be >= 0. Received: warmup={warmup}")
        if min_windows < 1:
            raise ValueError(
                f"`min_windows` must be >= 1. Received: min_windows={min_windows}"
            )
        factor = thresholds.get("slow_factor", THRESHOLDS["slow_factor"])
        if factor <= 1.0:
            raise ValueError(f"`slow_factor` must be > 1. Received: slow_factor={factor}")
        self.window = window
        self.hop = hop
        self.warmup = warmup
        self.min_windows = min_windows
        self.jit = jit
        self.eager = eager
        self.synced = synced
        self.eager_where = eager_where
        self.stall_where = None
        self.async_blockers = None  # RunFacts (tell): judge's arguments and the fix's fields
        self.input_source = self.input_in = None
        self.input_workers = None
        self.thresholds = dict(thresholds)
        self.log = StepLog(window)
        self.reset()

    def tell(self, facts):
        """Takes what the run's adapters know about it (an `analysis.RunFacts`)."""
        self.jit, self.eager, self.eager_where = facts.jit, facts.eager, facts.eager_where
        self.stall_where = facts.stall_where
        self.synced = facts.synced
        self.run_thresholds = dict(facts.thresholds)
        self.async_blockers = facts.async_blockers
        self.input_source, self.input_workers = facts.input_source, facts.input_workers
        self.input_in = facts.input_in

    def active_thresholds(self) -> dict:
        """Every threshold this detector judges with (`THRESHOLDS`, the
        constructor's overrides, then this run's `run_thresholds`)."""
        return {**THRESHOLDS, **self.thresholds, **self.run_thresholds}

    def reset(self):
        """Forgets every record and event."""
        self._seen = 0
        self._since_judgement = 0
        self._ring = deque(maxlen=self.window)
        self._streak = (None, 0)
        self._current = None
        self._shapes = set()
        self.log.reset()
        self.events = []
        self.judgements = 0
        self.last_judgement = None
        self._baseline_ms = None
        self._stall = (None, 0)  # (limit, median) and the count of cycles it was taken at
        # Overrides for this run only (a RetracingMonitor's max_new_shapes).
        self.run_thresholds = {}

    def stall_limit(self, coming=0, recent=None):
        """`(limit, median)` in seconds per step: a cycle over `limit` is a stall.

        THE slow-step rule (`slow_limit`) with this run's `stall_factor` and
        `min_slow_ms`, over the last `STALL_REFERENCE` per-step cycles of
        the log (after warmup, epoch starts left out) and of the records
        still coming (measured, not yet added), renewed every `STALL_RENEW`
        cycles; for a callback that judges each step as it ends
        (`ProfilerTrigger`'s `"slow_step"`).

        Args:
            coming: how many records are measured and not yet added.
            recent: called (only when the limit is renewed) for those
                records' `(cycle per step, epoch_first)`, oldest first.

        Returns:
            The pair, or None before `min_judge_steps` cycles were seen.
        """
        limit, at = self._stall
        count = self.log.records_added + coming
        if limit is not None and count - at < self.STALL_RENEW:
            return limit
        th = self.active_thresholds()
        times = [r.cycle / r.steps for r in self.log.records()[-self.STALL_REFERENCE:]]
        if coming and recent is not None:
            skip = max(0, self.warmup - self._seen)  # not logged: warmup
            times += [c for c, first in list(recent())[skip:] if not first]
        times = times[-self.STALL_REFERENCE:]
        if len(times) < th["min_judge_steps"]:
            return None
        median = float(np.median(times))
        limit = (float(slow_limit(times, median, factor=th["stall_factor"],
                                  min_ms=th["min_slow_ms"])), median)
        self._stall = (limit, count)
        return limit

    def update(self, record, **signals):
        """Adds one record; returns a new event (dict) or None.

        Args:
            record: a `StepRecord`, or a step's wall time in seconds with
                `**signals` (`input_wait` s, `gpu_util` 0..1, `new_shape`
                bool, `step` int, `between` s): that form builds the record.

        Returns:
            None, or an event dict: `verdict`, `phase`, `start_step`,
            `end_step`, `cv`, `period`, `cost_share`, `evidence`, `fix`
            and `message` (one line for people).
        """
        if not isinstance(record, StepRecord):
            record = self._record(record, signals)
        elif signals:
            raise ValueError("Pass signals inside the StepRecord, not as keywords.")
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        if record.shape is not None:
            if len(self._shapes) <= 4 * THRESHOLDS["max_new_shapes"]:
                self._shapes.add(record.shape)
        elif record.new_shape:
            self._shapes.add(("#", self._seen))
        self._ring.append(record)
        if not record.epoch_first:  # epoch starts are judged apart, as in `judge`
            self.log.add(record)
        self._since_judgement += 1
        if len(self._ring) < self.window or self._since_judgement < self.hop:
            return None
        return self._judge_now(self.min_windows)

    def _record(self, step_time, signals):
        unknown = set(signals) - {"input_wait", "gpu_util", "new_shape", "step", "between"}
        if unknown:
            raise ValueError(f"Unknown signals {sorted(unknown)}; expected "
                             "input_wait, gpu_util, new_shape, step, between")
        wait = signals.get("input_wait")
        index = signals.get("step")
        return StepRecord(
            index=self._seen if index is None else int(index), steps=1, input_wait=wait,
            step=max(0.0, float(step_time) - (wait or 0.0)),
            between=float(signals.get("between", 0.0)), gpu_util=signals.get("gpu_util"),
            new_shape=bool(signals.get("new_shape", False)))

    def judge(self) -> dict:
        """`judge` of the current window (no side effects)."""
        return judge(self._ring, self.active_thresholds(), self._baseline_ms, self.jit,
                     self.eager, len(self._shapes), self.synced, self.async_blockers,
                     self.input_workers)

    def finish(self):
        """Judges the records not judged yet at the end of a run.

        A run shorter than a window, or the tail after the last judgement,
        is judged once over what the window holds (at least
        `min_judge_steps` records). A run never judged before reports its
        verdict at once (`min_windows` does not apply). Returns a new event
        or None, like `update`.
        """
        min_steps = self.active_thresholds()["min_judge_steps"]
        if self._since_judgement == 0 or len(self._ring) < min_steps:
            return None
        return self._judge_now(1 if self.judgements == 0 else self.min_windows)

    def _judge_now(self, min_windows):
        self._since_judgement = 0
        self.judgements += 1
        judgement = self.judge()
        if self._baseline_ms is None and judgement["verdict"] != "unknown":
            self._baseline_ms = judgement["evidence"]["median_ms"]
        self.last_judgement = judgement
        return self._consider(judgement, min_windows)

    def _consider(self, judgement, min_windows):
        verdict = judgement["verdict"]
        if verdict == "unknown":
            return None
        start, end = self._ring[0].index, self._ring[-1].index + self._ring[-1].steps - 1
        last, count = self._streak
        self._streak = (verdict, count + 1 if verdict == last else 1)
        current = self._current
        if current is not None and current["verdict"] == verdict:
            current["end_step"] = end
            current["causes"] = [dict(c) for c in judgement.get("causes", ())]  # the latest
            return None
        if verdict == "healthy":
            if current is None or current["verdict"] == "healthy":
                return None
        elif self._streak[1] < (1 if verdict in ("recompiling", "eager_step") else min_windows):
            return None
        event = _event(judgement, start, end, self._where(verdict), self.input_source)
        self._current = event
        if len(self.events) < self.MAX_EVENTS:
            self.events.append(event)
        return event

    def _where(self, verdict):
        """The file:line a verdict's fix names (the eager step's, a periodic stall's
        loop-body line), or None."""
        if verdict == "sync_callbacks":
            return ", ".join(self.async_blockers or ()) or None
        return {"eager_step": self.eager_where,
                "periodic_stall": self.stall_where}.get(verdict)

    def dominant_verdict(self) -> str:
        """The verdict that covered the most steps: `healthy` if none was
        found, `unknown` when nothing was judged."""
        steps = Counter()
        for e in self.events:
            if e["verdict"] != "healthy":
                steps[e["verdict"]] += e["end_step"] - e["start_step"] + 1
        if steps:
            return steps.most_common(1)[0][0]
        judged = self.last_judgement is not None and self.last_judgement["verdict"] != "unknown"
        return "healthy" if judged else "unknown"

    def verdict(self) -> dict:
        """The run's one verdict so far (no side effects).

        The verdict that covered the most steps among the events; before
        any event, the judgement of the current window. Every output of a
        run (the callbacks' console lines and `report()`, Keras `logs`,
        TensorBoard, `kg.watch`, diagnose) names this verdict.

        Returns:
            A dict `verdict`, `fix`, `phase` (where the time goes),
            `cost_share` (share of the time the cause cost, None for
            `healthy` / `unknown`), `because` (sentences: what the verdict
            rests on), `changed` (the live events that said otherwise,
            None when none did) and `causes` (every cause the verdict's
            judgement measured, each with its own share: `judge`).
        """
        verdict = self.dominant_verdict()
        judgement = None if self.events else self.judge()
        if judgement is not None:
            verdict = judgement["verdict"]
        same = [e for e in self.events if e["verdict"] == verdict]
        because = []
        causes = list((judgement or {}).get("causes") or ())
        if same:
            fix, phase, share = same[-1]["fix"], same[-1]["phase"], same[-1]["cost_share"]
            causes = same[-1].get("causes") or []
            where = self._where(verdict)
            if where:  # the line may have been learnt after the event (kg.watch's stalls)
                fix = fix_for(verdict, phase=phase, period=same[-1].get("period"),
                              share=share, where=where, source=self.input_source,
                              **_fix_fields(same[-1]["evidence"]))
            because.append(f"{verdict} from step {same[0]['start_step']} to step "
                           f"{same[-1]['end_step']}: {same[-1]['message']}")
        elif judgement is not None and verdict not in NOT_CAUSES:
            phase, share = judgement["phase"], judgement["cost_share"]
            fix = fix_for(verdict, phase=phase, period=judgement["period"], share=share,
                          where=self._where(verdict), source=self.input_source,
                          **_fix_fields(judgement["evidence"]))
        else:
            fix, phase, share = FIXES[verdict], None, None
        others = [e for e in self.events if e["verdict"] != verdict]
        changed = None
        if others:  # the live events that said otherwise, and what changed
            changed = ("during the run: " + ", ".join(
                f"{e['verdict']} at steps {e['start_step']}-{e['end_step']}" for e in others)
                + f"; {verdict} covered the most steps")
        count = self.log.summary()["count"]
        unmeasured = None
        phases = ((self.last_judgement or {}).get("evidence") or {}).get("phases") or {}
        if verdict == "healthy" and self.input_in in phases and phases.get("input_wait", 0) is None:
            # never `healthy` on what was not measured: the input hides in a phase
            unmeasured = {"phase": self.input_in, "share": phases[self.input_in]}
            verdict, fix = "unknown", INPUT_UNMEASURED.format(
                phase=self.input_in, share=f"{phases[self.input_in]:.0%}",
                command=" ".join(["python"] + [str(a) for a in sys.argv]))
        elif verdict == "unknown" and count:
            fix = TOO_FEW_STEPS.format(steps=count,
                                       min_steps=self.active_thresholds()["min_judge_steps"])
        causes = [dict(c, where=self._where(c["verdict"])) if self._where(c["verdict"])
                  else c for c in causes]
        return {"verdict": verdict, "fix": fix, "phase": phase, "cost_share": share,
                "because": because, "changed": changed, "causes": causes,
                "input_unmeasured": unmeasured}


def _event(judgement, start, end, where=None, source=None):
    verdict, ev = judgement["verdict"], judgement["evidence"]
    period, phase, share = judgement["period"], judgement["phase"], judgement["cost_share"]
    return {
        "verdict": verdict,
        "phase": phase,
        "start_step": start,
        "end_step": end,
        "cv": ev.get("cv"),
        "period": period,
        "cost_share": share,
        "evidence": ev,
        "fix": fix_for(verdict, phase=phase, period=period, share=share, where=where,
                       source=source, **_fix_fields(ev)),
        "message": _message(verdict, start, ev, period, phase, share),
        "causes": [dict(c) for c in judgement.get("causes", ())],
    }


def _message(verdict, start, ev, period, phase, share):
    parts = [f"from step {start}: {verdict}", f"median {ev['median_ms']:.1f} ms",
             f"cv {ev['cv']:.2f}"]
    if period:
        where = {"input_wait": "input wait", "step": "the step", "between": "between steps",
                 "loop_body": "the loop body"}.get(phase, phase)
        parts.append(f"slow every {period} steps in {where} ({share:.0%} of time lost)")
    if ev.get("input_wait") is not None:
        parts.append(f"input wait {ev['input_wait']:.0%}")
    if ev.get("padding") is not None:
        parts.append(f"padding {ev['padding']:.0%} of the frames, {ev['shapes']} shapes "
                     f"({ev['padding_time_share']:.0%} of time in the step)")
    if "gpu_util" in ev:
        parts.append(f"GPU util {ev['gpu_util']:.0%}")
    if "slow_steps_at_new_shapes" in ev:
        parts.append(f"{ev['slow_steps_at_new_shapes']} of {ev['slow_steps']} "
                     f"slow steps at new input shapes ({ev['recompile_share']:.0%} of time)")
    if "unsynced_period" in ev:
        parts.append(UNSYNCED_NOTE.format(period=ev["unsynced_period"]))
    parts.append("evidence: " + "+".join(ev["signals"]))
    return "; ".join(parts)



def what_if_input_cost(what_if, thresholds=None):
    """`(cost, least, known)`: the share of the run the what-if finds the input costing
    (`1 - 1/speedup`), that share at the low end of its range, and whether it knows;
    None when it says nothing. A what-if that does not know (its range wider than
    `what_if_uncertainty`) still bounds the gain from below: when its low end alone
    shows `what_if_share`, its cost is that low end's (`known` False); below, None.
    """
    th = {**THRESHOLDS, **(thresholds or {})}
    what_if = what_if or {}
    speedup = what_if.get("speedup_if_input_free")
    if not speedup:
        return None
    low = (what_if.get("speedup_range") or (speedup, speedup))[0] or speedup
    least = 1.0 - 1.0 / low
    if what_if.get("known", True):
        return 1.0 - 1.0 / speedup, least, True
    if least >= th["what_if_share"]:
        return least, least, False
    return None


def weigh(run, xprof=None, what_if=None, thresholds=None) -> dict:
    """The run's verdict with the other evidence of the same run weighed in.

    The step log's verdict (`OscillationDetector.verdict()`) rests on every
    step of the run. An XProf trace covers a few steps and counts
    host-to-device copies as input; it never changes the verdict, and where
    its classification disagrees the verdict says so and why. The what-if
    times the step alone beside the run's own cycles: when it finds the
    input costing at least `what_if_share` of a run judged `healthy` (at
    the low end of its range), the verdict becomes `input_bound`, and says
    that it changed and why. Where the run's input wait explains that cost
    less `what_if_share`, the input competes with the step for the host's
    cores (the wait reads ~0 while the step runs slower beside the
    pipeline): phase `step` and the contention fix, with the predicted
    gain. A run judged `irregular_stall` is weighed the same way when the
    what-if's input cost covers the stalls' (a loaded host turns the
    contention's slower steps into stalls with no period). A what-if
    finding nothing to gain leaves an `input_bound` verdict standing (the
    replayed batch is cached, the run's were not) and says so. A what-if
    that does not know (`known` False: its timings varied more than
    `what_if_uncertainty`) counts only by the low end of its range
    (`what_if_input_cost`): the gain is at least that. A run whose input,
    drained alone, supplies `input_rate_margin` times the step's demand or
    more is never `input_bound` (the wait it measured is load or epoch
    starts): `healthy`, unless another cause of its ranking reaches its
    threshold (`verdict_of_ranking`), `covers` naming `input_bound`.

    Args:
        run: the dict of `OscillationDetector.verdict()`, with `input_wait`
            (the run's input-wait share, None when not measured).
        xprof: `profiling.analyze_trace` results of the run's traces (with
            `start_step`, `end_step` when known). Defaults to None.
        what_if: the what-if figures (`speedup_if_input_free`,
            `speedup_range`, `known`, `bound`, `method`). Defaults to None.
        thresholds: overrides of `THRESHOLDS`. Defaults to None.

    Returns:
        `run` with `verdict`, `fix`, `phase`, `cost_share` weighed and
        `because` extended by one sentence per piece of evidence that
        disagreed; where the what-if overturned the step log's verdict,
        `covers` names it (its time is the input's, not a cause beside it).
    """
    th = {**THRESHOLDS, **(thresholds or {})}
    out = dict(run, because=list(run.get("because") or []))
    verdict, wait = out["verdict"], out.get("input_wait")
    waited = "not measured" if wait is None else f"{wait:.0%}"
    what_if = what_if or {}
    speedup = what_if.get("speedup_if_input_free")
    bound = what_if_input_cost(what_if, th)
    if bound is not None:
        cost, least, known = bound
        low, high = what_if.get("speedup_range") or (speedup, speedup)
        span = f" ({low:.2f}x-{high:.2f}x)" if low and high else ""
        if not known:  # only its low end is sure: the gain is at least that
            top = f"{high:.2f}x" if high else "unbounded"
            speedup, span = low, f" (at least: its range {low:.2f}x-{top} was too wide)"
        # Stalls with no period that the input's measured cost covers are the
        # step waiting for the cores the input holds (a loaded host turns
        # contention's slower steps into stalls): the input is their cause.
        stalls = out.get("cost_share") or 0.0
        if (verdict == "healthy" or verdict == "irregular_stall" and least >= stalls) \
                and least >= th["what_if_share"]:
            contention = wait is not None and least - wait >= th["what_if_share"]
            phase = "step" if contention else "input_wait"
            read = ("healthy" if verdict == "healthy" else
                    f"irregular_stall (stalls with no period, {stalls:.0%} of the run)")
            out.update(verdict="input_bound", phase=phase, cost_share=cost,
                       fix=fix_for("input_bound", phase=phase, share=cost), covers=verdict)
            out["because"].append(
                f"the step log read {read} (input wait {waited}), but with the input free "
                f"the run would be {speedup:.2f}x faster{span}: the input costs {cost:.0%} of "
                "the run"
                + (": contention, the input pipeline competes with the step for the CPU "
                   "(the step ran slower in the run than replayed alone), so the wait reads "
                   "low" if contention else " (it competes with the step for the host, so the "
                   "wait reads low)")
                + "; the what-if times both side by side, so the verdict is input_bound")
        elif verdict == "input_bound" and speedup < th["min_speedup"]:
            out["because"].append(
                f"the what-if finds the run no faster with the input free ({speedup:.2f}x), "
                f"but it replays one cached batch; the step log measured {waited} input "
                "wait over the whole run, so the verdict stays input_bound")
    rate, demand = what_if.get("input_batches_per_s"), what_if.get("step_batches_per_s")
    if out["verdict"] == "input_bound" and rate and demand and (
            rate >= th["input_rate_margin"] * demand):
        out.update(verdict="healthy", phase=None, cost_share=None, fix=fix_for("healthy"),
                   covers="input_bound")
        out["because"].append(
            f"the step log measured {waited} input wait, but the input drained alone supplies "
            f"{rate:.1f} batches/s, {rate / demand:.0f}x the step's demand of {demand:.2f}: "
            "the pipeline's speed is not what the step waited for (other processes' load, "
            "or the epochs' first batches), so the verdict is not input_bound")
    for trace in xprof or ():
        kind = trace.get("classification")
        if kind is None:
            continue
        steps = (f" of steps {trace['start_step']}-{trace['end_step']}"
                 if trace.get("start_step") is not None else "")
        if (kind == "not_input_bound") == (out["verdict"] == "input_bound"):
            out["because"].append(
                f"XProf's trace{steps} reads input {trace.get('input_percent') or 0:.1f}% "
                f"({kind}); the verdict stays {out['verdict']}: the trace covers "
                f"{trace.get('steps') or 'a few'} steps and counts host-to-device copies as "
                f"input, the step log's input wait ({waited}) covers every step")
    return out
