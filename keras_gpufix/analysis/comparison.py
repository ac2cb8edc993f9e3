"""`keras-gpufix compare BEFORE AFTER`: did the change make the run faster, as BEFORE said?

Two run records (`RunRecord.data`) are compared by what each measured, never
judged again:

- the throughput gain: BEFORE's wall per step over AFTER's, each the mean
  cycle (input wait + step + time between, stalls included: a stall every
  5th step is a fifth of the steps' wall, which a median leaves out by
  construction) over its record's judged points (steady steps: after
  warm-up, epoch starts left out), weighted by the steps each point holds;
  so also AFTER's steps/s over BEFORE's. Its range pairs the ends of each
  mean's 95% interval (normal, over the points);
- one word: `improvement` when the whole range lies above 1 and the gain is
  at least `1 + MIN_GAIN`, `regression` when it lies below 1 and the gain is
  at most `1 / (1 + MIN_GAIN)`, else `no change`;
- each cause's share before and after, and for the causes that went away
  the gain per step BEFORE predicted for their fixes (alone and together),
  beside the gain measured;
- a warning for each thing that differs between the two runs and makes the
  gain not the change's alone: the machine, the Keras backend, the batch size.

Imports neither TensorFlow nor Keras.
"""

import math

import numpy as np

from keras_gpufix.analysis.verdicts import combined_speedup, speedup_of

__all__ = ["MIN_GAIN", "compare_runs", "format_comparison"]

#: A gain within this either way of 1 is `no change`, whatever its range.
MIN_GAIN = 0.05
#: The mean's interval: 95% (normal quantile).
_Z = 1.96


def _steady(series):
    """`(cycles_ms, steps)` of a series' judged points (all points when none is): each
    point's cycle per step and the steps it holds."""
    wait = [w or 0.0 for w in series["input_wait_ms"]]
    cycles = np.array([w + s + b for w, s, b in zip(wait, series["step_ms"],
                                                    series["between_ms"])], dtype=float)
    steps = np.array([max(1, n or 1) for n in series["steps"]], dtype=float)
    judged = np.array(series["judged"], dtype=bool)
    return (cycles[judged], steps[judged]) if judged.any() else (cycles, steps)


def _mean_range(cycles, steps):
    """`(low, mean, high)`: the wall per step (the steps' mean cycle, each point
    weighted by its steps) and its 95% interval; None when there is no point."""
    if not cycles.size:
        return None
    mean = float(np.dot(cycles, steps) / steps.sum())
    spread = float(np.dot(steps, (cycles - mean) ** 2) / steps.sum())
    points = steps.sum() ** 2 / float(np.dot(steps, steps))  # the points' effective count
    half = _Z * math.sqrt(spread / points) if points > 1 else mean
    return max(0.0, mean - half), mean, mean + half


def _differences(before, after):
    """What differs between the runs besides the change: a list of sentences."""
    eb, ea = before["environment"], after["environment"]
    out = []
    machine = [k for k in ("host", "machine", "cpu_count", "gpus") if eb.get(k) != ea.get(k)]
    if machine:
        out.append("the machines differ (" + "; ".join(
            f"{k} {eb.get(k)!r} vs {ea.get(k)!r}" for k in machine) + ")")
    if eb.get("keras_backend") != ea.get("keras_backend"):
        out.append(f"the Keras backends differ ({eb.get('keras_backend')} vs "
                   f"{ea.get('keras_backend')})")
    bb, ba = before["step_time"].get("batch_size"), after["step_time"].get("batch_size")
    if bb and ba and abs(bb - ba) > 0.01 * max(bb, ba):
        out.append(f"the batch sizes differ ({bb:.4g} vs {ba:.4g} samples per step): "
                   "compare per sample, not per step")
    return out


def compare_runs(before: dict, after: dict) -> dict:
    """Compares two run records (`RunRecord.data`).

    Returns:
        A dict: `word` (`improvement`, `no change`, `regression`), `gain`
        (BEFORE's wall per step over AFTER's, stalls included: AFTER's steps/s
        over BEFORE's; None when either has no steps) and `gain_range`
        (`[low, high]`, holding `gain`), `before` / `after` (each `verdict`,
        `wall_ms` (the mean wall per step) and its `wall_range_ms`,
        `steps_per_s`, `steps` (the steady steps), `points`), `causes` (every
        cause of either: `verdict`, `before`, `after` shares, None where
        absent, `gone`), `predicted` (BEFORE's prediction for each cause that
        went away: `verdict`, `speedup` (per step, as the gain is measured),
        `speedup_range`, `text`), `predicted_together` (the speedup of all
        of them together: the sum of the time each saves, `combined_speedup`;
        None when none went away or one is unbounded) and `warnings`.
    """
    sides = {}
    for name, record in (("before", before), ("after", after)):
        cycles, steps = _steady(record["series"])
        ranged = _mean_range(cycles, steps)
        sides[name] = {"verdict": record["verdict"].get("verdict"),
                       "wall_ms": ranged and ranged[1],
                       "wall_range_ms": ranged and [ranged[0], ranged[2]],
                       "steps_per_s": 1000.0 / ranged[1] if ranged and ranged[1] else None,
                       "steps": int(steps.sum()), "points": int(cycles.size)}
    b, a = sides["before"], sides["after"]
    gain = gain_range = None
    if b["wall_ms"] and a["wall_ms"]:
        gain = b["wall_ms"] / a["wall_ms"]
        (bl, bh), (al, ah) = b["wall_range_ms"], a["wall_range_ms"]
        gain_range = [bl / ah if ah else None, bh / al if al else None]
    word = "no change"
    if gain is not None and gain_range[0] and gain_range[1]:
        if gain_range[0] > 1 and gain >= 1 + MIN_GAIN:
            word = "improvement"
        elif gain_range[1] < 1 and gain <= 1 / (1 + MIN_GAIN):
            word = "regression"
    shares = {"before": {c["verdict"]: c.get("share") for c in before["causes"]},
              "after": {c["verdict"]: c.get("share") for c in after["causes"]}}
    names = list(dict.fromkeys([*shares["before"], *shares["after"]]))
    causes = [{"verdict": v, "before": shares["before"].get(v), "after": shares["after"].get(v),
               "gone": bool(shares["before"].get(v)) and not shares["after"].get(v)}
              for v in names]
    gone = [c["verdict"] for c in causes if c["gone"]]
    fixes = {f["verdict"]: f for f in before["fixes"]}
    predicted = []
    for verdict in gone:
        fix = fixes.get(verdict) or {}
        speedup = fix.get("steady_speedup") or fix.get("expected_speedup",
                                                       speedup_of(shares["before"][verdict]))
        span = fix.get("speedup_range")
        if not (span and all(span) and span[0] <= (speedup or 0) <= span[1]):
            span = None  # a range that does not hold its own point ranges another figure
        predicted.append({"verdict": verdict, "speedup": speedup, "speedup_range": span,
                          "text": fix.get("text")})
    together = combined_speedup(p["speedup"] for p in predicted) if predicted and all(
        p["speedup"] for p in predicted) else None
    return {"word": word, "gain": gain, "gain_range": gain_range, "before": b, "after": a,
            "causes": causes, "predicted": predicted, "predicted_together": together,
            "warnings": _differences(before, after)}


def _x(value):
    return "unbounded" if value is None else f"{value:.2f}x"


def _share(value):
    return "-" if value is None else f"{value:.0%}"


def format_comparison(result: dict, before: str = "BEFORE", after: str = "AFTER") -> str:
    """`compare_runs`'s result for people: the word and the measured gain first, the
    predicted gain beside it, then the causes."""
    b, a = result["before"], result["after"]
    lines = []
    if result["gain"] is None:
        lines.append(f"{result['word']}: no steady steps to compare ({before}: {b['points']} "
                     f"judged points, {after}: {a['points']})")
    else:
        low, high = result["gain_range"]
        lines.append(f"{result['word']}: {after} runs {_x(result['gain'])} ({_x(low)}-"
                     f"{_x(high)}) the steps/s of {before}: {b['steps_per_s']:.3g} -> "
                     f"{a['steps_per_s']:.3g} steps/s, wall per step {b['wall_ms']:.2f} ms -> "
                     f"{a['wall_ms']:.2f} ms (the mean of {b['steps']} and {a['steps']} steady "
                     "steps, stalls included)")
    predicted = result["predicted"]
    if predicted and result["gain"] is not None:
        speedup = predicted[0]["speedup"] if len(predicted) == 1 else result["predicted_together"]
        lines.append(f"predicted by {before}: {_x(speedup)} per step, measured "
                     f"{_x(result['gain'])}")
    lines.append(f"verdict:  {b['verdict']} -> {a['verdict']}")
    if result["causes"]:
        lines.append("causes (share of the run, before -> after):")
        lines += [f"  {c['verdict']}: {_share(c['before'])} -> "
                  + ("gone" if c["gone"] else _share(c["after"])) for c in result["causes"]]
    if predicted:
        lines.append(f"predicted by {before} for the causes that went away (per step):")
        for p in predicted:
            span = p.get("speedup_range")
            span = f" ({_x(span[0])}-{_x(span[1])})" if span else ""
            lines.append(f"  {p['verdict']}: {_x(p['speedup'])}{span}")
        if len(predicted) > 1:
            lines.append(f"  together: {_x(result['predicted_together'])}")
    lines += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)
