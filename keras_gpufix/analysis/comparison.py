"""`keras-gpufix compare BEFORE AFTER`: did the change make the run faster, as BEFORE said?

Two run records (`RunRecord.data`) are compared by what each measured, never
judged again:

- the steady gain: BEFORE's median step (per step: input wait + step + time
  between) over AFTER's, each taken over its record's judged points (steady
  steps: after warm-up, epoch starts left out), with a range from the two
  step distributions (each median's 95% distribution-free interval, from
  the order statistics of its points; the gain's range pairs their ends);
- one word: `improvement` when the whole range lies above 1 and the gain is
  at least `1 + MIN_GAIN`, `regression` when it lies below 1 and the gain is
  at most `1 / (1 + MIN_GAIN)`, else `no change`;
- each cause's share before and after, and for the causes that went away
  the speedup BEFORE predicted for their fixes (alone and together), beside
  the gain measured;
- a warning for each thing that differs between the two runs and makes the
  gain not the change's alone: the machine, the Keras backend, the batch size.

Imports neither TensorFlow nor Keras.
"""

import math

import numpy as np

from keras_gpufix.analysis.verdicts import combined_speedup, speedup_of

__all__ = ["MIN_GAIN", "compare_runs", "format_comparison"]

#: A steady gain within this either way of 1 is `no change`, whatever its range.
MIN_GAIN = 0.05
#: The median's interval: 95% (normal quantile).
_Z = 1.96


def _steady_ms(series) -> np.ndarray:
    """Per-step cycles (ms) of a series' judged points (all points when none is)."""
    wait = [w or 0.0 for w in series["input_wait_ms"]]
    cycles = np.array([w + s + b for w, s, b in zip(wait, series["step_ms"],
                                                    series["between_ms"])], dtype=float)
    judged = np.array(series["judged"], dtype=bool)
    return cycles[judged] if judged.any() else cycles


def _median_range(times):
    """`(low, median, high)` of `times`: the median and its 95% interval by order
    statistics (ranks n/2 -+ 1.96 sqrt(n)/2); None when empty."""
    t = np.sort(np.asarray(times, dtype=float))
    n = t.size
    if not n:
        return None
    half = _Z * math.sqrt(n) / 2
    low = max(0, int(math.floor(n / 2 - half)))
    high = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return float(t[low]), float(np.median(t)), float(t[max(low, high)])


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
        (BEFORE's steady median step over AFTER's; None when either has no
        steps) and `gain_range` (`[low, high]`), `before` / `after` (each
        `verdict`, `median_ms` and its `median_range_ms`, `points`),
        `causes` (every cause of either: `verdict`, `before`, `after` shares,
        None where absent, `gone`), `predicted` (BEFORE's prediction for each
        cause that went away: `verdict`, `speedup`, `speedup_range`, `text`),
        `predicted_together` (the speedup of all of them together: the sum of
        the time each saves, `combined_speedup`; None when none went away or one is
        unbounded) and `warnings`.
    """
    sides = {}
    for name, record in (("before", before), ("after", after)):
        ranged = _median_range(_steady_ms(record["series"]))
        sides[name] = {"verdict": record["verdict"].get("verdict"),
                       "median_ms": ranged and ranged[1],
                       "median_range_ms": ranged and [ranged[0], ranged[2]],
                       "points": int(sum(record["series"]["judged"]))}
    b, a = sides["before"], sides["after"]
    gain = gain_range = None
    if b["median_ms"] and a["median_ms"]:
        gain = b["median_ms"] / a["median_ms"]
        (bl, bh), (al, ah) = b["median_range_ms"], a["median_range_ms"]
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
        share = shares["before"][verdict]
        predicted.append({"verdict": verdict,
                          "speedup": fix.get("expected_speedup", speedup_of(share)),
                          "speedup_range": fix.get("speedup_range"),
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
    """`compare_runs`'s result for people, the word first."""
    b, a = result["before"], result["after"]
    lines = []
    if result["gain"] is None:
        lines.append(f"{result['word']}: no steady steps to compare ({before}: {b['points']} "
                     f"judged points, {after}: {a['points']})")
    else:
        low, high = result["gain_range"]
        lines.append(f"{result['word']}: {after} is {_x(result['gain'])} the speed of "
                     f"{before} per step ({_x(low)}-{_x(high)}), steady median step "
                     f"{b['median_ms']:.2f} ms -> {a['median_ms']:.2f} ms")
    lines.append(f"verdict:  {b['verdict']} -> {a['verdict']}")
    if result["causes"]:
        lines.append("causes (share of the run, before -> after):")
        lines += [f"  {c['verdict']}: {_share(c['before'])} -> "
                  + ("gone" if c["gone"] else _share(c["after"])) for c in result["causes"]]
    if result["predicted"]:
        lines.append(f"predicted by {before} for the causes that went away:")
        for p in result["predicted"]:
            span = p.get("speedup_range") or ()
            span = f" ({_x(span[0])}-{_x(span[1])})" if len(span) == 2 and all(span) else ""
            lines.append(f"  {p['verdict']}: {_x(p['speedup'])}{span}"
                         + (f"; {p['text']}" if p.get("text") else ""))
        if len(result["predicted"]) > 1:
            lines.append(f"  together: {_x(result['predicted_together'])}")
        if result["gain"] is not None:
            lines.append(f"  measured: {_x(result['gain'])}")
    lines += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)
