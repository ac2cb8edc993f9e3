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
- each run's load beside its throughput (`load_of`: other processes' share of
  the CPU, the threads' wait for one, the process's CPU time per step). Where
  the load can explain the difference (a 2-core host under a second job slows
  a script 1.5-2.5x): the gain with the runs' waits for a CPU taken out reaches
  1.0, or, where the waits were not measured, the loads differ (`loads_differ`)
  and the more loaded run is the slower one, or the gain is `no change`
  beside loads that differ, the word is `inconclusive`, with the two loads and
  how to repeat the comparison (`_weighed`). Where the more loaded run is the
  faster one, the word stands: the load worked against it, so the difference
  is at least the one measured;
- each cause's share before and after, and for the causes that went away
  the gain per step BEFORE predicted for their fixes (alone and together),
  beside the gain measured;
- a warning for each thing that differs between the two runs and makes the
  gain not the change's alone: the machine, the Keras backend, the batch size.

`paired_gain` judges reruns taken side by side (diagnose's: the script as it is
and with a fix, alternated): rounds of two runs, each round judged as above,
a round whose two runs' loads differ (`LOAD_GAP`) left out where a matched one
exists, and a range that holds 1.0 called not known yet, with the steps a run
that would settle it.

Imports neither TensorFlow nor Keras.
"""

import math

import numpy as np

from keras_gpufix.analysis.verdicts import (PATCHED_RUN_TEXT, SKIPPED_RUN_WHAT,
                                            TOGETHER_RUN_TEXT, combined_speedup, speedup_of,
                                            steps_per_s_words)

__all__ = ["CHEAP_ROUNDS_S", "CPU_BOUND", "CPU_SHARE_GAP", "LOAD_GAP", "MAX_ROUNDS", "MIN_GAIN",
           "MIN_ROUNDS", "MOST_ROUNDS", "OTHERS_NOTICE", "QUIET_REACH",
           "REPEAT", "SETTLED", "WAIT_GAP",
           "compare_runs", "format_comparison", "load_of", "loads_differ", "paired_gain",
           "paired_words", "patched_run_text", "settled", "together_run_text"]

#: A gain within this either way of 1 is `no change`, whatever its range.
MIN_GAIN = 0.05
#: Two runs' loads differ when other processes' share of the CPU differs by this much
#: (a CPU burner on 2 cores is 0.5; two runs of one script on a shared 2-core machine
#: differ by up to about 0.2), or ...
LOAD_GAP = 0.25
#: ... their threads' wait for a CPU, seconds per second of the run, by this much (on a
#: busy machine other processes' share nears 1.0 and moves little; the wait still does),
#: where other processes took `LOAD_GAP` of the CPU in either run: beside none, the wait
#: is the run's own threads waiting for each other (MyXTTSModel's step compiled waited
#: 1.27 s/s against 0.04 eager, other processes 0% in both).
WAIT_GAP = 0.5
#: The most of a run's wall its threads' wait for a CPU can be taken to explain (`compare`:
#: a wall never shrinks to nothing).
QUIET_REACH = 0.9
#: `compare`: the slower run got this many times less of the CPU than the faster one
#: (its CPU time over its wall) while other processes took `OTHERS_NOTICE` more of the
#: machine: the load can explain the difference. A burner beside the as-is run of a
#: compiled-step pair (truth 1.02x) cut its share 0.52 -> 0.30 (others 0.74 -> 0.85),
#: its threads' waits unchanged (1.48 -> 1.50 s/s), and its wall read 2.15x.
CPU_SHARE_GAP = 1.25
OTHERS_NOTICE = 0.05
#: ... and only where the slower run's own CPU work took this share of its wall: a run
#: that mostly waits (sleeps, I/O, the device) was not asking for the CPU it did not get
#: (a stall of 30 ms `time.sleep` every 5 steps against its fix: 0.05 of a CPU, read
#: `inconclusive` beside another test worker in CI).
CPU_BOUND = 0.2
#: The most rounds (an as-is run and a fixed one) a paired rerun takes, and the fewest
#: (A B, B A: a load that drifts weighs on both sides, and the range holds the spread
#: between rounds, which one round cannot show: a plot-every-5-steps script, truth
#: 1.18x, read 0.71x (0.59x-0.85x) from one round whose fixed run got 0.70 of a CPU
#: against the as-is run's 1.03).
MAX_ROUNDS = 3
MIN_ROUNDS = 2
#: Short reruns go on past `MAX_ROUNDS` while a gain is not settled, up to `MOST_ROUNDS`,
#: as long as the reruns so far took under `CHEAP_ROUNDS_S` seconds: a cause of 20% of a
#: 200-step run (plot_small of benchmarks/load_pairs.py, truth 1.18x) read "not known
#: yet: 0.98x (0.91x-1.05x)" from 3 rounds of 1.5 s runs beside a CPU burner.
MOST_ROUNDS = 8
CHEAP_ROUNDS_S = 60.0
#: A paired gain is settled when its range lies within this factor of it either way
#: (the 25% a prediction is judged by); else rounds go on, up to `MAX_ROUNDS`. The plot
#: pair of benchmarks/load_pairs.py at load 6, two rounds: 1.60x (1.31x-1.96x) against a
#: truth of 2.15x.
SETTLED = 1.25
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


def load_of(record: dict) -> dict:
    """A run record's load: `others_share` (other processes' share of the CPU over the
    run), `waited_share` (its threads' wait for a CPU, seconds per second), `load`,
    `cpus`, `cpu_share` (this process's CPU time over its wall: the CPUs it got) and
    `cpu_ms_per_step` (its CPU time over its steps: what other processes move less
    than the wall); each None where the record has none."""
    c = record.get("contention") or {}
    count = (record.get("step_time") or {}).get("count")
    own = c.get("own_cpu_s")
    wall = c.get("wall_s")
    return {"others_share": c.get("others_share"), "waited_share": c.get("waited_share"),
            "load": c.get("load"), "cpus": c.get("cpus"),
            "cpu_share": own / wall if own is not None and wall else None,
            "cpu_ms_per_step": 1000.0 * own / count if own is not None and count else None}


def loads_differ(first: dict, second: dict) -> "float | None":
    """Whether two runs' loads (`load_of`) differ: other processes' share of the CPU
    by `LOAD_GAP` or more, or the threads' wait for a CPU by `WAIT_GAP` or more where
    other processes took `LOAD_GAP` of the CPU in either run (beside none, the wait is
    the run's own threads waiting for each other).

    Returns:
        None where they do not differ so (or were not measured); else how much
        more `second` was loaded: the difference in other processes' share where
        that differs, else in the threads' wait (negative: `first` was loaded more).
    """
    a, b = first.get("others_share"), second.get("others_share")
    if a is not None and b is not None and abs(b - a) >= LOAD_GAP:
        return b - a
    beside = a is None or b is None or max(a, b) >= LOAD_GAP
    a, b = first.get("waited_share"), second.get("waited_share")
    if beside and a is not None and b is not None and abs(b - a) >= WAIT_GAP:
        return b - a
    return None


def _load_words(load: dict) -> str:
    """`other processes 55% of the CPU, load 3.1 on 2 CPUs, threads waited 0.4 s/s`
    (or `not measured`)."""
    if load.get("others_share") is None:
        return "not measured"
    words = f"other processes {load['others_share']:.0%} of the CPU"
    if load.get("load") is not None and load.get("cpus"):
        words += f", load {load['load']:.1f} on {load['cpus']} CPUs"
    if load.get("waited_share") is not None:
        words += f", its threads waited {load['waited_share']:.2f} s/s for a CPU"
    return words


def compare_runs(before: dict, after: dict) -> dict:
    """Compares two run records (`RunRecord.data`).

    Returns:
        A dict: `word` (`improvement`, `no change`, `regression`, `inconclusive`:
        the two runs' loads differ and can explain what was measured), `gain`
        (BEFORE's wall per step over AFTER's, stalls included: AFTER's steps/s
        over BEFORE's; None when either has no steps) and `gain_range`
        (`[low, high]`, holding `gain`), `before` / `after` (each `verdict`,
        `wall_ms` (the mean wall per step) and its `wall_range_ms`,
        `steps_per_s`, `steps` (the steady steps), `points`, `load`: `load_of`),
        `load` (None where the loads say nothing of the word; else `more`: the
        side loaded more, `explains`: whether that can explain the difference,
        `quiet_range`: the gain with the runs' waits for a CPU taken out), `causes` (every
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
    b["load"], a["load"] = load_of(before), load_of(after)
    word, load = _weighed(word, gain, b["load"], a["load"])
    return {"word": word, "gain": gain, "gain_range": gain_range, "before": b, "after": a,
            "load": load, "causes": causes, "predicted": predicted,
            "predicted_together": together, "warnings": _differences(before, after)}


def _weighed(word, gain, before, after):
    """`(word, load)`: `compare_runs`'s word with the two runs' loads (`load_of`)
    weighed in.

    A run's threads waited `w` seconds for a CPU per second of it; had they not, it
    would have taken between `1 - w` of its wall (every wait on its critical path)
    and all of it (none). Both runs share the machine, so the same fraction `c` of
    their waits is taken out of both, from none to all (`c * w` at most
    `QUIET_REACH`): the quiet gain lies between the gain measured and its other
    end, `gain * (1 - c w_before) / (1 - c w_after)`. Where that range reaches 1.0
    (across it, for `no change`: beyond `MIN_GAIN`, with loads that differ), the
    load can explain the difference: `inconclusive`. Where the waits were not
    measured, other processes' share stands in (`loads_differ`): the more loaded
    run the slower explains it. Either way, a run that was loaded more and still
    the faster keeps its word.

    Returns:
        `load`: None where the loads say nothing of the word; else `more` (the
        side loaded more: `before` or `after`), `explains` (whether the load can
        explain the difference measured), `quiet_range` (the gain with the
        waits taken out, from none to all; None where not measured), `starved`,
        `cpu_ms_per_step` (before, after) and `cpu_gain` (where the slower run was
        starved of the CPU and its CPU time per step alone holds the word: that
        ratio; else None). The word then stands without a figure: neither the wall
        nor the CPU time per step is the gain at one load (a pool that spins less
        beside a burner spends less CPU per step: a cached map's 4.09x read 2.13x so).
    """
    if gain is None:
        return word, None
    gap = loads_differ(before, after)
    wb, wa = before.get("waited_share"), after.get("waited_share")
    more = ("after" if gap > 0 else "before") if gap is not None else None
    slower = "before" if gain > 1 else "after"
    explains, span = gap is not None and (word == "no change" or more == slower), None
    starved = _starved(gain, before, after) if word != "no change" else False
    cpu = [before.get("cpu_ms_per_step"), after.get("cpu_ms_per_step")]
    cpu_gain = cpu[0] / cpu[1] if all(cpu) else None
    if starved:  # the slower run got less of the CPU while other processes took more:
        # the gain less what the shares explain is the CPU time per step's; it holds
        # the word where it alone goes the same way (the work changed), else the load
        # can explain the difference
        more = slower
        explains = not (cpu_gain and (cpu_gain >= 1 + MIN_GAIN if word == "improvement"
                                      else cpu_gain <= 1 / (1 + MIN_GAIN)))
    if wb is not None and wa is not None and wb != wa:
        reach = min(1.0, QUIET_REACH / max(wb, wa))
        edge = gain * (1 - reach * wb) / (1 - reach * wa)
        span = sorted((gain, edge))
        more = more or ("after" if wa > wb else "before")
        crosses = {"improvement": span[0] <= 1, "regression": span[1] >= 1}.get(word, False)
        explains = explains or crosses
    if more is None or not explains and gap is None and not starved:
        return word, None
    return ("inconclusive" if explains else word), {
        "more": more, "explains": explains, "quiet_range": span, "starved": starved,
        "cpu_ms_per_step": cpu if all(cpu) else None,
        "cpu_gain": cpu_gain if starved and not explains else None}


def _starved(gain, before, after) -> bool:
    """Whether the slower of two runs (`load_of`), its own CPU work `CPU_BOUND` of its
    wall or more, got `CPU_SHARE_GAP` times less of the
    CPU than the faster one while other processes took `OTHERS_NOTICE` more of it:
    its threads' waits may not show it (a pool of threads that wait for each other
    wait as long beside a burner), the share of the CPU it got does."""
    got = [before.get("cpu_share"), after.get("cpu_share")]
    others = [before.get("others_share"), after.get("others_share")]
    if None in got + others or min(got) <= 0:
        return False
    slow, fast = (0, 1) if gain > 1 else (1, 0)
    return (got[slow] >= CPU_BOUND and got[fast] >= CPU_SHARE_GAP * got[slow]
            and others[slow] - others[fast] >= OTHERS_NOTICE)


def settled(paired) -> bool:
    """Whether `paired_gain`'s result needs no more rounds: its gain known (the range
    leaves out 1.0, or says no gain), no round's loads differing unless left out, and
    its range within `SETTLED` of the gain either way."""
    low, high = paired["gain_range"]
    return (paired["known"] and not any(not g["left_out"] for g in paired["load_gaps"])
            and high / paired["gain"] <= SETTLED and paired["gain"] / low <= SETTLED)


def paired_gain(rounds) -> "dict | None":
    """The gain of reruns taken side by side: `rounds` of `(as_is, fixed)` run records
    (`RunRecord.data`), each round two runs back to back.

    Each round is judged as `compare_runs` judges two runs. A round whose two runs'
    loads differ (`loads_differ`; or its slower run got `CPU_SHARE_GAP` times less of
    the CPU while other processes took `OTHERS_NOTICE` more) is left out where a
    round with matched loads exists, and named either way. The gain is the as-is runs'
    mean wall per step over the fixed runs' (so the fixed runs' steps/s over the
    as-is runs'); its range is 95% on the log scale, from each round's own spread
    and, with two or more rounds, the spread between them.

    Returns:
        None where no round has steps on both sides; else a dict: `gain`,
        `gain_range`, `known` (the range leaves out 1.0, or lies within
        `MIN_GAIN` of it: no gain), `steps_per_s` (as-is,
        fixed), `rounds` (used), `rounds_run`, `steps` (the steady steps of one
        run), `settle_steps` (where not `known`: about how many steady steps a run
        would narrow the range to leave out 1.0, or to within `MIN_GAIN` of it:
        the run's warm-up apart),
        `load_gaps` (per round left out or kept although its loads differ:
        `round`, `as_is` and `fixed` (`load_of`), `left_out`).
    """
    judged = []
    for i, (as_is, fixed) in enumerate(rounds):
        one = compare_runs(as_is, fixed)
        if one["gain"] is None:
            continue
        low, high = one["gain_range"]
        spread = ((math.log(high) - math.log(low)) / (2 * _Z) if low and high
                  else math.log(1 + MIN_GAIN))
        loads = (load_of(as_is), load_of(fixed))
        judged.append({"round": i + 1, "one": one, "spread": spread, "loads": loads,
                       "differ": loads_differ(*loads) is not None
                       or _starved(one["gain"], *loads)})
    if not judged:
        return None
    matched = [j for j in judged if not j["differ"]]
    used = matched or judged
    gaps = [{"round": j["round"], "as_is": j["loads"][0], "fixed": j["loads"][1],
             "left_out": j not in used} for j in judged if j["differ"]]
    before = float(np.mean([j["one"]["before"]["wall_ms"] for j in used]))
    after = float(np.mean([j["one"]["after"]["wall_ms"] for j in used]))
    gain = before / after
    logs = np.log([j["one"]["gain"] for j in used])
    n = len(used)
    var = float(np.mean([j["spread"] ** 2 for j in used])) / n
    if n > 1:
        var += float(np.var(logs, ddof=1)) / n
    se = math.sqrt(var)
    low, high = gain * math.exp(-_Z * se), gain * math.exp(_Z * se)
    known = low > 1 or high < 1 or 1 / (1 + MIN_GAIN) <= low <= high <= 1 + MIN_GAIN
    steps = int(min(j["one"]["before"]["steps"] for j in used))
    settle = None
    if not known and se > 0:
        aim = max(abs(math.log(gain)), math.log(1 + MIN_GAIN)) / _Z
        settle = int(math.ceil(steps * (se / aim) ** 2 / 10.0)) * 10
    return {"gain": gain, "gain_range": [low, high], "known": known,
            "steps_per_s": [1000.0 / before, 1000.0 / after], "rounds": n,
            "rounds_run": len(rounds), "steps": steps, "settle_steps": settle,
            "load_gaps": gaps}


def paired_words(paired: dict) -> str:
    """What `paired_gain` found, in words: the gain with its range, or `not known
    yet` with the steps that would settle it, then each round whose loads differed."""
    gain, (low, high) = paired["gain"], paired["gain_range"]
    words = f"{gain:.2f}x ({low:.2f}x-{high:.2f}x)"
    if not paired["known"]:
        words = (f"not known yet: {words} holds 1.0"
                 + (f"; runs of about {paired['settle_steps']} steady steps would settle it"
                    if paired.get("settle_steps") else ""))
    for gap in paired.get("load_gaps") or ():
        words += (f"; round {gap['round']}'s loads differed (as is: "
                  f"{_load_words(gap['as_is'])}; fixed: {_load_words(gap['fixed'])})"
                  + (", left out" if gap["left_out"] else ", kept: no round matched"))
    return words


def patched_run_text(paired, whole=None, skipped=None) -> str:
    """`PATCHED_RUN_TEXT`: the paired reruns' steps/s (`analysis.paired_gain`'s result),
    as it is and with the patch (`whole`: the two runs' walls over the same steps, the
    trace and compile included, where known; `skipped`: the `file:line` the reruns
    skipped, where they applied no patch)."""
    before, after = paired["steps_per_s"]
    return PATCHED_RUN_TEXT.format(
        what="the patch applied" if skipped is None else SKIPPED_RUN_WHAT.format(where=skipped),
        rounds=paired["rounds_run"], s="s" * (paired["rounds_run"] != 1), steps=paired["steps"],
        before=steps_per_s_words(before), after=steps_per_s_words(after),
        gain=paired_words(paired),
        whole="" if whole is None else f"; the whole loop {whole:.2f}x as fast, its trace "
        "and compile in it")


def together_run_text(count, paired) -> str:
    """`TOGETHER_RUN_TEXT`: `count` fixes run together, paired as `patched_run_text`."""
    before, after = paired["steps_per_s"]
    return TOGETHER_RUN_TEXT.format(
        count=count, rounds=paired["rounds_run"], s="s" * (paired["rounds_run"] != 1),
        steps=paired["steps"], before=steps_per_s_words(before),
        after=steps_per_s_words(after), gain=paired_words(paired))


def _x(value):
    return "unbounded" if value is None else f"{value:.2f}x"


def _share(value):
    return "-" if value is None else f"{value:.0%}"


#: How to compare two runs whose loads differed.
REPEAT = ("to compare them at one load, run both back to back (or alternated: `keras-gpufix "
          "diagnose` measures the fixes it can apply so), on a machine as quiet as you can")


def _load_lines(result, before, after):
    """The two runs' loads, and what they do to the word."""
    b, a = result["before"].get("load") or {}, result["after"].get("load") or {}
    if b.get("others_share") is None and a.get("others_share") is None:
        return []
    lines = []
    for name, load in ((before, b), (after, a)):
        cpu = load.get("cpu_ms_per_step")
        lines.append(f"load of {name}: {_load_words(load)}" + (
            f"; its CPU time {cpu:.3g} ms per step" if cpu else ""))
    load = result.get("load")
    if load is None:
        return lines
    more, less = (after, before) if load["more"] == "after" else (before, after)
    span = load.get("quiet_range")
    span = (f" (with the runs' waits for a CPU taken out, none to all of them, the gain is "
            f"{span[0]:.2f}x-{span[1]:.2f}x)" if span else "")
    if load.get("starved"):
        got = {n: (result[n].get("load") or {}).get("cpu_share") for n in ("before", "after")}
        span = (f" (it got {got[load['more']]:.2f} of a CPU against "
                f"{got['after' if load['more'] == 'before' else 'before']:.2f})") + span
    cpu = load.get("cpu_ms_per_step")
    if load["explains"] and cpu and not load.get("cpu_gain"):
        span += (f"; its CPU time per step, which load moves less, went {cpu[0]:.3g} -> "
                 f"{cpu[1]:.3g} ms ({cpu[0] / cpu[1]:.2f}x; it leaves out time not spent "
                 "computing)")
    if load["explains"]:
        lines.append(f"inconclusive: {more} ran under more load than {less}, enough to explain "
                     f"the difference measured{span}; {REPEAT}")
    else:
        lines.append(
            f"{more} ran under more load than {less}{span}; its CPU time per step, which load "
            f"moves less, holds the word ({load['cpu_gain']:.2f}x), but neither it nor the "
            f"wall ({result['gain']:.2f}x) is the gain at one load: {REPEAT}"
            if load.get("cpu_gain") else
            f"{more} ran under more load than {less} and was still the faster: the "
            f"difference is at least the one measured{span}")
    return lines


def format_comparison(result: dict, before: str = "BEFORE", after: str = "AFTER") -> str:
    """`compare_runs`'s result for people: the word and the measured gain first, the
    predicted gain beside it, then the causes."""
    b, a = result["before"], result["after"]
    sized = not (result.get("load") or {}).get("cpu_gain")  # else the word, no figure
    lines = []
    if result["gain"] is None:
        lines.append(f"{result['word']}: no steady steps to compare ({before}: {b['points']} "
                     f"judged points, {after}: {a['points']})")
    else:
        low, high = result["gain_range"]
        lines.append(f"{result['word']}: {after} runs "
                     + (f"{_x(result['gain'])} ({_x(low)}-{_x(high)}) the steps/s of {before}"
                        if sized else f"{'faster' if result['gain'] > 1 else 'slower'} than "
                        f"{before}, by how much not known at these loads (below)")
                     + f": {b['steps_per_s']:.3g} -> "
                     f"{a['steps_per_s']:.3g} steps/s, wall per step {b['wall_ms']:.2f} ms -> "
                     f"{a['wall_ms']:.2f} ms (the mean of {b['steps']} and {a['steps']} steady "
                     "steps, stalls included)")
    predicted = result["predicted"]
    if predicted and result["gain"] is not None:
        speedup = predicted[0]["speedup"] if len(predicted) == 1 else result["predicted_together"]
        lines.append(f"predicted by {before}: {_x(speedup)} per step, measured "
                     + (f"{_x(result['gain'])}" if sized else "not known at these loads"))
    lines += _load_lines(result, before, after)
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
