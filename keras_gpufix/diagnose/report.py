"""The report: rank the runs' findings (never re-judging them) and print the diagnosis."""

import os
import re

from keras_gpufix import analysis
from keras_gpufix.diagnose.what_if import format_what_if, ratio_words
from keras_gpufix.profiling import format_analysis

__all__ = ["rank_causes", "seen_in_code", "not_offered", "run_verdict", "format_report", "healthy_evidence",
           "trace_evidence", "input_stage", "locate_input_stage", "format_own_cost"]


def _pct(x):
    return f"{x:.0%}"


def _label(fit):
    """`fit 1` or `loop 2`: how the report names one run."""
    return f"{fit.get('kind', 'fit')} {fit['index']}"


def _input_wait(fit):
    """The run's input-wait share: the monitor's, else (a custom loop) the time in next()."""
    wait = (fit.get("monitor") or {}).get("input_wait")
    return (fit.get("phases") or {}).get("input_share") if wait is None else wait


def _xprof(fit):
    """The run's analysed XProf traces, as `analysis.weigh` takes them."""
    return [dict(t["analysis"], start_step=t.get("start_step"), end_step=t.get("end_step"))
            for t in (fit.get("profiler") or {}).get("traces", [])
            if "classification" in (t.get("analysis") or {})]


def run_verdict(fit):
    """The run's one verdict: its monitor's, with its XProf traces and what-if
    weighed in (`analysis.weigh`); None when the run has no monitor report."""
    monitor = fit.get("monitor") or {}
    if "verdict" not in monitor:
        return None
    run = {k: monitor.get(k) for k in ("verdict", "fix", "phase", "cost_share", "because",
                                        "changed")}
    run["input_wait"] = _input_wait(fit)
    what_if = fit.get("what_if") or {}
    return analysis.weigh(run, xprof=_xprof(fit),
                          what_if=what_if if what_if.get("speedup_if_input_free") else None)


def _where(fit, verdict, scan):
    """Where a cause of this run was seen (`analysis.cause_where`)."""
    return analysis.cause_where(verdict, fit.get("step") or {}, scan)


def _fit_causes(fit, scan):
    """(verdict, cost share, evidence) of one run: its verdict, every other cause its
    judgement measured (each with its own share) and its live events. An eager step
    compiled on a real batch costs its measured excess over the compiled step."""
    run = run_verdict(fit)
    if run is None:
        return []
    label = _label(fit)
    monitor = fit.get("monitor") or {}
    events = monitor.get("events") or []
    out = []
    if analysis.is_cause(run["verdict"]):
        period = next((e.get("period") for e in events if e["verdict"] == run["verdict"]), None)
        out.append((run["verdict"], run["cost_share"] or 0.0, {
            "source": "judgement", "figure": "cost_share", "value": run["cost_share"],
            "text": f"{label}: {run['verdict']}" + "".join(f"; {b}" for b in run["because"]),
            "period": period, "phase": run["phase"],
            "where": _where(fit, run["verdict"], scan)}))
    covered = {run["verdict"], run.get("covers")}  # stalls the input's cost covers
    for cause in monitor.get("causes") or ():
        if cause["verdict"] not in covered:
            out.append((cause["verdict"], cause["share"] or 0.0, {
                "source": "judgement", "figure": "cost_share", "value": cause["share"],
                "text": f"{label}: {cause['verdict']} beside {run['verdict']}, "
                        f"{(cause['share'] or 0):.0%} of the run",
                "period": cause.get("period"), "phase": cause.get("phase"),
                "where": _where(fit, cause["verdict"], scan)}))
    sampled = (fit.get("step") or {}).get("stall_sampled")
    if sampled and "periodic_stall" not in covered and not any(
            o[0] == "periodic_stall" for o in out):  # found by the stack samples alone
        where = _where(fit, "periodic_stall", scan)
        out.append(("periodic_stall", sampled["share"], {
            "source": "stack samples", "figure": "cost_share", "value": sampled["share"],
            "text": f"{label}: periodic_stall beside {run['verdict']}: the loop body's work at "
                    f"{where} every {sampled['period']} steps, {sampled['share']:.0%} of the run "
                    "(the stack samples; the step times' spread hides its period)",
            "period": sampled["period"], "phase": "loop_body", "where": where}))
    cost = analysis.what_if_input_cost(fit.get("what_if"))
    beside = analysis.what_if_cause(cost, _input_wait(fit), run["verdict"])
    if beside is not None:  # the input's cost the what-if measured, beside another cause
        verdict, share, phase = beside
        out.append((verdict, share, {
            "source": "what-if", "figure": "speedup_if_input_free", "value": cost[0],
            "text": f"{label}: the what-if finds the input costing "
                    f"{'at least ' if not cost[2] else ''}{cost[0]:.0%} of the run",
            "period": None, "phase": phase, "where": None}))
    told = out[0][2]["text"] if out else ""  # the judgement, its events' messages in it
    for event in events:
        if (analysis.is_cause(event["verdict"]) and event["verdict"] != run.get("covers")
                and event["message"] not in told):
            out.append((event["verdict"], event.get("cost_share") or 0.0, {
                "source": "GPUOscillationMonitor", "figure": "event",
                "value": event.get("cost_share"), "text": f"{label}: {event['message']}",
                "period": event.get("period"), "phase": event.get("phase"),
                "where": _where(fit, event["verdict"], scan)}))
    return analysis.priced_by_compile(out, analysis.compiled_cause_share(
        monitor.get("causes"), fit.get("compiled_step"),
        (monitor.get("step_time") or {}).get("mean_ms")))


def _xprof_text(a):
    """XProf's analysis of one trace as one story: its classification by the input
    share it measured, and its own summary only where that does not say otherwise."""
    if a.get("step_time_ms") is None:
        return ("XProf could not analyse it: it found no steps in the trace to time (its "
                "input-pipeline analysis reads per-step markers), so it says nothing of this "
                "run; the step log above covers every step")
    conclusion = a.get("conclusion") or ""
    others = re.search(r"POTENTIALLY input-bound because ([0-9.]+)% of the total step time "
                       r"sampled is spent on '([^']+)'", conclusion)
    if analysis.reads_not_input_bound(a) and others:
        return (f"step time {a['step_time_ms']:.1f} ms over {a['steps']} steps, waiting for "
                f"input {a['input_percent']:.1f}% -> not input-bound by its input wait; "
                f"{others.group(1)}% of the step is '{others.group(2)}' time (host work: "
                "Python, I/O or both), which XProf calls potentially input-bound: the step "
                "log's input wait and the what-if say whether the input is what it waits on")
    return format_analysis(a)


def _trace_item(fit, trace):
    a = trace["analysis"]
    analysed = a.get("step_time_ms") is not None
    return {"source": "XProf", "figure": "input_percent",
            "value": a.get("input_percent") if analysed else None,
            "text": f"{_label(fit)}: XProf trace of steps {trace['start_step']}-"
                    f"{trace['end_step']} ({trace.get('reason')}): " + _xprof_text(a),
            "path": trace.get("path")}


def trace_evidence(fits):
    return [_trace_item(fit, trace) for fit in fits
            for trace in (fit.get("profiler") or {}).get("traces", [])
            if "classification" in (trace.get("analysis") or {})]


def _ruled_out(fits, verdict):
    """Verdicts the run's judgement had the evidence for and did not give.

    Their static findings are not ranked as fixes: `input_bound` when the
    input wait was measured, `eager_step` and `recompiling` (traces or
    shapes counted) when steps were judged. A cause it cannot see
    (`dispatch_bound` without GPU utilisation) keeps its findings.
    """
    judged = _judged(fits)
    return analysis.ruled_out(
        verdict, judged=bool(judged),
        input_wait_measured=all(_input_wait(f) is not None for f in judged),
        compiles_counted=any((f.get("retracing") or {}).get("trace_count") is not None
                             or (f.get("monitor") or {}).get("new_shapes") for f in judged))


def _main(fits):
    """The run the verdict is about: the judged run that timed the most steps."""
    judged = _judged(fits)
    return max(judged, key=lambda f: (f.get("monitor") or {})["step_time"]["count"]) \
        if judged else None


def _predicted(cause, fits):
    """The effect of fixing a ranked cause, from the run's own measurements.

    The share of the time the cause cost (`score`) is the most its fix can
    save; for `input_bound` the what-if of the run that gave it, where it
    knows, is the prediction itself.
    """
    share = cause["score"]
    what_if = next((f.get("what_if") for f in fits if f.get("what_if")
                    and (run_verdict(f) or {}).get("verdict") == cause["verdict"]), None) or {}
    speedup = what_if.get("speedup_if_input_free")
    tried = [f["compiled_step"] for f in fits if f.get("compiled_step")]
    compiled = next((c for c in tried if c.get("best_ms") is not None),
                    tried[0] if tried else None)
    source = analysis.prediction_source(cause["verdict"], what_if, compiled)
    if source == "what-if":
        low, high = what_if.get("speedup_range") or (None, None)
        return {"share": share, "speedup": speedup, "speedup_range": [low, high],
                "source": "what-if",
                "text": f"predicted: {ratio_words(speedup)} with the input free"
                        + (f" ({low:.2f}x-{high:.2f}x)" if low and high else "")
                        + _WHAT_IF_METHOD.get(what_if.get("method"), "")}
    speedup = analysis.speedup_of(share)
    if source == "not-measured":
        return {"share": share, "speedup": None, "speedup_range": None, "source": source,
                "text": f"not predicted: diagnose could not compile the step as written (what "
                        f"blocks it, below), so nothing was measured; the eager step took "
                        f"{_pct(share)} of the run"}
    if source == "compiled-step":
        measured = next(f for f in fits if f.get("compiled_step") is compiled)
        wall, steps = measured.get("wall_s") or 0.0, measured.get("steps") or 0
        once = compiled.get("first_call_s")
        run = analysis.one_off_gain(speedup, once, wall) if once is not None and wall else None
        per_s = ((measured.get("monitor") or {}).get("step_time") or {}).get("steps_per_s")
        return {"share": share, "speedup": speedup, "speedup_range": None,
                "source": "compiled-step", "run_speedup": run,
                "steps_per_s": [per_s, per_s * speedup] if per_s else None,
                "text": f"predicted: the steps {speedup:.2f}x faster"
                        + (f", the loop's {per_s:.1f} steps/s -> {per_s * speedup:.1f} steps/s "
                           "once traced" if per_s else "")
                        + f" (the eager step's "
                        f"excess over {compiled['best']}, {compiled['eager_ms']:.1f} ms -> "
                        f"{compiled['best_ms']:.1f} ms per call, each the median of calls on the "
                        f"run's last batch after the run, not in its loop"
                        + (f", {analysis.run_clock(compiled):.2f}x on the run's clock (its "
                           f"gradients took {compiled['run_gradient_ms']:.1f} ms in the run, "
                           f"{compiled['gradient_ms']:.1f} ms alone)"
                           if analysis.run_clock(compiled) != 1.0 else "")
                        + "; "
                        + (f"{compiled['calls_per_step']:.2g} call"
                           f"{'' if compiled['calls_per_step'] == 1 else 's'} a step, "
                           "over the run's mean cycle and at most what the other causes and "
                           "the compiled calls leave of it, "
                           if compiled.get("calls_per_step") else
                           "applied to the run's steady step time, ")
                        + f"is {_pct(share)} of the run)"
                        + ("" if run is None else
                           f"; its first call traces and compiles once ({once:.2f} s here), "
                           f"so this run's {steps} steps ({wall:.1f} s) would be {run:.2f}x faster"
                           + (f" ({steps / wall:.1f} steps/s -> {run * steps / wall:.1f} steps/s)"
                              if steps else "")
                           + (", slower than now: the trace pays only in a longer run"
                              if run < 1 else ""))}
    return {"share": share, "speedup": speedup, "speedup_range": None, "source": "cost_share",
            "text": analysis.cost_share_prediction(share)}


#: How a what-if's prediction was measured, by its `method`.
_WHAT_IF_METHOD = {
    "side_by_side": " (the what-if: the step timed alone on the real input and on a cached "
                    "batch)",
    "replay": " (the what-if: the step replayed on its last batch, against the run's cycles)",
    "in_run": " (the what-if: the step as timed in the run, against the input drained alone)",
}


def rank_causes(fits, scan=()):
    """Ranks the runs' findings; returns (verdict, ranking, fixes).

    Nothing is judged here: the verdict is the one judgement of the run
    that timed the most steps (its monitor's verdict, with its XProf
    traces and what-if weighed in by `analysis.weigh`), and the ranking
    orders every run's verdict and live events by the share of time each
    cost (`keras_gpufix.analysis.rank_causes`), the verdict first. Static
    findings never make a verdict: they point at the lines to change for
    a ranked cause. Only causes this run measured a cost for are fixes,
    each with its predicted effect; the static findings of no measured
    cause are `seen_in_code`, apart.

    Returns:
        `verdict` (`healthy` when steps were judged and no cause was
        found, `unknown` when no run was judged), `ranking` (list of dicts
        `verdict`, `score`, `evidence`, `fix`, best first) and `fixes`
        (ranked list of dicts `rank`, `verdict`, `fix`, `where`: `file:line`
        of the matching scan findings, `predicted`: `share` (the most of the
        run the fix can save), `speedup` (None when unbounded),
        `speedup_range`, `source` (`what-if` or `cost_share`), `text`).
    """
    ranking = analysis.rank_causes(c for fit in fits for c in _fit_causes(fit, scan))
    main = _main(fits)
    verdict = analysis.verdict_of_ranking(_verdict(main), ranking)
    ranking.sort(key=lambda c: c["verdict"] != verdict)  # stable: the verdict first
    fixes = []
    steps = [f.get("step") or {} for f in fits]
    compiled = [f.get("compiled_step") or {} for f in fits]
    for cause in ranking:
        if not cause["score"]:  # no measured cost: nothing to predict, not ranked
            continue
        where = [f for f in scan if f.get("verdict") == cause["verdict"] and _offered(f, fits)]
        seen = analysis.measured_lines(cause["verdict"], steps, compiled)
        fix = analysis.measured_fix(cause["verdict"], cause["fix"], compiled)
        if cause["verdict"] == "input_bound" and main is not None and main.get("tf_data") is False:
            fix = analysis.PYTHON_INPUT_FIX.format(x=main.get("x") or "?")
        fixes.append({"rank": len(fixes) + 1, "verdict": cause["verdict"], "fix": fix,
                      "where": seen + [f"{f['file']}:{f['line']}: {f['why']}; {f['fix']}"
                                       for f in where],
                      "predicted": _predicted(cause, fits)})
        if cause["verdict"] == "eager_step":  # why no patch, where none is offered
            fixes[-1]["refused"] = next(filter(None, map(analysis.patch_refusal, compiled)),
                                        None)
    locate_input_stage(fixes, fits)
    return verdict, ranking, fixes


def seen_in_code(fits, scan, fixes):
    """The static findings no ranked fix measured: listed apart, never ranked.

    Findings off the training path (`training_path` False) are left out,
    as are those of a cause the judgement had the evidence for and did not
    give (`_ruled_out`); what remains (e.g. `numpy_in_loop` when GPU
    utilisation was not measured, a `dispatch_bound` the run cannot see)
    may matter, but this run measured no effect for it.

    Args:
        fits: the runs, as `rank_causes` takes them.
        scan: the static scan's findings.
        fixes: `rank_causes`'s ranked fixes.

    Returns:
        A list of dicts `verdict`, `fix`, `where` (`file:line: why`).
    """
    main = _main(fits)
    ruled_out = _ruled_out(fits, _verdict(main))
    ranked = {f["verdict"] for f in fixes}
    out = {}
    for f in scan:
        if (f.get("verdict") is None or not _offered(f, fits) or f["verdict"] in ranked
                or f["verdict"] in ruled_out):
            continue
        seen = out.setdefault(f["verdict"], {"verdict": f["verdict"], "fix": f["fix"],
                                             "where": []})
        seen["where"].append(f"{f['file']}:{f['line']}: {f['why']}")
    return list(out.values())


def _median_step_ms(fits):
    main = _main(fits)
    return None if main is None else main["monitor"]["step_time"].get("p50_ms")


def _offered(finding, fits):
    """Whether a static finding may point at a fix: on the training path, its line ran
    (or it is not known that it did not), and the run's measurement does not rule it out."""
    return (finding.get("training_path", True) and finding.get("ran") is not False
            and analysis.contradicted(finding.get("verdict"), _median_step_ms(fits)) is None)


def not_offered(fits, scan):
    """The static findings on the training path that the run rules out, with the reason:
    their line never ran, or the measurement contradicts them (`analysis.contradicted`).

    Returns:
        A list of dicts `verdict`, `where` (`file:line`, each line once per reason) and
        `reason`.
    """
    out = {}
    for f in scan:
        if f.get("verdict") is None or not f.get("training_path", True):
            continue
        if f.get("ran") is False:
            reason = "the line never ran in this run (a branch not taken)"
        else:
            reason = analysis.contradicted(f["verdict"], _median_step_ms(fits))
        if reason:
            slot = out.setdefault((f["verdict"], reason), {"verdict": f["verdict"],
                                                          "where": [], "reason": reason})
            slot["where"].append(f"{f['file']}:{f['line']}")
    return list(out.values())


def input_stage(fit):
    """`analysis.judge_stages` of a run's measured input stages, or None."""
    stages = (fit.get("stages") or {}).get("stages")
    if not stages:
        return None
    what_if = fit.get("what_if") or {}
    step, between = what_if.get("step_batches_per_s"), what_if.get("between_ms") or 0.0
    demand = 1.0 / (1.0 / step + between / 1000.0) if step else None
    observed = what_if.get("observed_batches_per_s")
    known = what_if.get("known", True) is not False
    return analysis.judge_stages(stages, step_per_s=demand, observed_per_s=observed,
                                 cpus=fit["stages"].get("cpus") or 1,
                                 run=_script_run(fit, observed),
                                 input_free=what_if.get("speedup_if_input_free") if known
                                 else None)


def _script_run(fit, observed_per_s):
    """The script's run, as `analysis.run_gain` takes it: a fit's steps are its epochs
    times its steps per epoch (the script's, whatever --steps ran), a loop's the cycles
    it ran; its fixed time (what no input fix removes) the fit's wall less diagnose's
    own train and epoch hooks (`own_hooks_s`: 0.19 s of slow_map's 1.0 s fit, 0.42 s
    of its 3-epoch 2.5 s; they run before the first step, after the last and inside
    each epoch's first record), less its epoch iterators' release (`teardown_s`: at
    each later epoch's start beyond the first's gap and after its last hook; over
    slow_map's `py_function` map one release took 1.4-2.2 s in 2 of 8 plain Keras fits
    and 4 of 8 diagnosed ones, TF 2.21, under 0.03 s in the others: the input's, gone
    with its fix (`released_s`), not the script's start-up; counted there, the 3-epoch
    run's TF-ops figure read 2.8-5.1x where the others read 10-13x), less its steps at
    the steady cycle, less the input's wait beyond the steady one at the steps not
    judged (an epoch's first fill: a faster input fills faster)."""
    timed = fit.get("steps_run") or ((fit.get("monitor") or {}).get("step_time") or {}).get(
        "count")
    if not observed_per_s or not timed or not fit.get("wall_s"):
        return None
    per_epoch = fit.get("steps_per_epoch") if fit.get("kind") == "fit" else None
    steps = per_epoch * (fit.get("epochs") or 1) if per_epoch else timed
    fixed = (fit["wall_s"] - (fit.get("own_hooks_s") or 0.0) - (fit.get("teardown_s") or 0.0)
             - timed / observed_per_s)
    series = (fit.get("monitor") or {}).get("series") or {}
    if series.get("steps"):
        points = list(zip(series["input_wait_ms"], series["steps"], series["judged"]))
        steady = sorted(wait or 0.0 for wait, _, judged in points if judged)
        steady = steady[len(steady) // 2] if steady else 0.0
        fixed -= sum(max(0.0, (wait or 0.0) - steady) * n
                     for wait, n, judged in points if not judged) / 1000.0
    return {"steps": steps, "steps_per_epoch": per_epoch, "fixed_s": max(0.0, fixed),
            "released_s": fit.get("teardown_s") or 0.0}


def locate_input_stage(fixes, fits):
    """The `input_bound` fix located: the slow stage of the input (measured,
    `input_stage`) by the line that built it, its fix and predicted gain.

    The fix's text becomes the stage's, its `where` starts with the stage's
    line and loses the scan's findings at the lines of the measured stages
    (the slow one is named by its measurement, the others are measured
    cheap); `stage` holds the judgement. Fixes stay as they were when no
    run's input was measured or no stage is slow.
    """
    fix = next((f for f in fixes if analysis.located_by_stage(f["verdict"])), None)
    judged = analysis.located_stage(
        map(input_stage, sorted(fits, key=lambda f: -(f.get("wall_s") or 0))))
    if fix is None or judged is None:
        return
    slow = judged["slow"]
    where = slow.get("where") or slow.get("function") or "?"

    def line(where):  # file:line, the file made absolute (the scan's may be relative)
        file, number = analysis.where_place(where)
        return os.path.abspath(file), number

    named = {line(s[k]) for s in judged["stages"] for k in ("where", "function") if s.get(k)}
    fix["fix"] = slow["text"]
    fix["stage"] = {k: slow.get(k) for k in ("op", "where", "function", "kind", "rate_per_s",
                                             "share", "predicted_gain", "predicted_per_s",
                                             "run_gain")}
    fix["predicted"] = _stage_predicted(slow, fix.get("predicted") or {})
    fix["stage"].update(input_per_s=judged["input_per_s"],
                        demand_per_s=judged["demand_per_s"])
    fix["where"] = [f"{where}: `{slow['op']}`, the input's slow stage: {slow['rate_per_s']:.1f} "
                    f"batches/s alone, {slow['share']:.0%} of the input's time"] + [
        w for w in fix["where"] if line(w) not in named]


def _stage_predicted(slow, before):
    """The located fix's one predicted gain: its stage's (`judge_stages`), the whole
    run's as the script runs it where known (else the gain per step), its range the
    what-if's relative spread where the what-if gave one (`before`: the fix's
    prediction before the stage was located). The stage's text (the fix) says how
    each figure was reached; this line names the one predicted."""
    gain, whole = slow["predicted_gain"], slow.get("run_gain")
    low, high = before.get("speedup_range") or (None, None)
    base = before.get("speedup")
    spread = [gain * low / base, gain * high / base] if low and high and base else None
    return {"share": before.get("share"), "speedup": whole if whole is not None else gain,
            "steady_speedup": gain, "speedup_if_cached": slow.get("run_gain_cached"),
            "speedup_later_runs": slow.get("run_gain_later"),
            "speedup_range": spread if whole is None else None,  # the per-step gain's
            "whole_run": whole is not None, "source": "stage",
            "text": f"predicted: {gain:.2f}x per step once the fix applies"
                    + (f" ({spread[0]:.2f}x-{spread[1]:.2f}x, the what-if's spread)"
                       if spread else "")
                    + (f", {whole:.2f}x for the script's whole run" if whole is not None
                       and whole != gain else "")
                    + (" (from the second epoch: a cache serves nothing in the first)"
                       if whole is None else "")
                    + (f", {slow['run_gain_later']:.2f}x for each later run with the cache on "
                       "disk" if slow.get("run_gain_later") else "")
                    + " (the stage's share of the input's part of the run's cycle; the fix "
                      "above says how each figure was reached)"}


def _judged(fits):
    """The runs whose steps were timed and numerous enough for the monitor to judge."""
    return [f for f in fits if ((f.get("monitor") or {}).get("step_time") or {}).get("count")
            and analysis.is_judged((f.get("monitor") or {}).get("verdict"))]


def _verdict(main):
    """The verdict of the main run (`_main`); `unknown` without one."""
    return (analysis.not_run_verdict() if main is None else run_verdict(main))["verdict"]


def _what_was_seen(seen):
    """What the script was seen doing when no step was, and how to point diagnose at its loop."""
    seen = seen or {}
    iterables = "; ".join(seen.get("iterables") or ()) or "none"
    functions = "; ".join(seen.get("functions") or ()) or "none"
    return (f"seen: iterables the script iterated itself: {iterables}; tf.functions it "
            f"called: {functions}. {POINT_AT_LOOP}")


#: How a loop becomes visible to diagnose when it was not seen.
POINT_AT_LOOP = (
    "diagnose times a loop whose body computes a gradient (tf.GradientTape.gradient, eager or "
    "in a tf.function; tf.gradients or an optimizer's apply in a tf.function, in strategy.run "
    "too) between next() calls on a tf.data dataset, a tf.distribute "
    "distributed dataset or a keras.utils.PyDataset that the script iterates; to point it at "
    "another loop, wrap what the loop iterates: `for batch in kg.watch(batches, model=model)`"
)


def healthy_evidence(fits, seen=None):
    """What a `healthy` verdict rests on; for `unknown`, that nothing was seen or judged
    (with `seen`, `LoopPatch.seen()`: what the script was seen doing)."""
    out = []
    counts = [((f.get("monitor") or {}).get("step_time") or {}).get("count") or 0 for f in fits]
    if not any(counts):
        loops = ", ".join(_label(f) for f in fits) or "no model.fit call"
        return [{"source": "diagnose", "figure": "steps", "value": 0,
                 "text": f"the script ran but no training step was seen ({loops}; no gradient "
                         "step between iterations of what it iterates): nothing was measured, "
                         "so nothing can be judged; " + _what_was_seen(seen)}]
    if not _judged(fits):
        return [{"source": "GPUOscillationMonitor", "figure": "steps", "value": n,
                 "text": f"{_label(f)}: {(f.get('monitor') or {}).get('fix')} (a larger --steps)"}
                for f, n in zip(fits, counts) if n]
    for fit in fits:
        monitor = fit.get("monitor") or {}
        st = monitor.get("step_time") or {}
        if not st.get("count"):
            continue
        wait = _input_wait(fit)
        retr = fit.get("retracing") or {}
        out.append({"source": "GPUOscillationMonitor", "figure": "step_time",
                    "value": st.get("p50_ms"),
                    "text": f"{_label(fit)}: {st['count']} steps, median "
                            f"{st['p50_ms']:.1f} ms, p95 {st['p95_ms']:.1f} ms, cv {st['cv']:.2f}"
                            + ("" if wait is None else f", input wait {_pct(wait)}")
                            + (f", {retr['trace_count']} train-step traces"
                               if retr.get("trace_count") is not None else "")
                            + "; no cause measured: the steps are compute-bound"
                            + "".join(f"; {b}" for b in [*(run_verdict(fit) or {}).get(
                                "because", []), monitor.get("changed")] if b)})
    return out


def _compile_cache_words(fit, retr):
    """`, compiling X s, N of M compiles from the compile cache, K fresh` for a run of an
    XLA-compiled step while the script's compile cache was on (TensorFlow counts each
    input shape's compile; JAX reports its compiles and cache hits); else nothing."""
    cache = fit.get("compile_cache")
    if not cache or not ((fit.get("model") or {}).get("jit_compile") or cache.get("compiles")):
        return ""
    written = cache.get("written") or 0
    compiles = cache.get("compiles")
    if compiles is None:
        compiles = len(retr.get("shapes") or ()) or None
    compiling = sum(e.get("cost_ms") or 0.0 for e in retr.get("shape_events") or ()
                    if e.get("first_compile")) / 1000.0
    if cache.get("compile_s") is not None:
        compiling = cache["compile_s"]
    words = f", compiling {compiling:.1f} s" if compiling else ""
    if compiles:
        return words + (f", {max(0, compiles - written)} of {compiles} compiles from the "
                        f"compile cache ({cache['directory']}), {written} fresh")
    return words + f", {written} fresh compiles written to the compile cache"


def _steps_line(fit):
    """One run's steps and seconds, adding up: all its steps in its wall, the steady
    ones (those judged) with their mean and median, and what else the wall holds."""
    st = (fit.get("monitor") or {}).get("step_time") or {}
    wall = fit.get("wall_s") or 0.0
    series = (fit.get("monitor") or {}).get("series") or {}
    run = sum(series.get("steps") or ()) or fit.get("steps_run") or fit.get("steps") or 0
    text = f"{_label(fit)}: {run} steps in {wall:.1f} s"
    if fit.get("stopped_by_diagnose"):
        text += " (stopped by --steps)"
    if not st.get("count"):
        return text
    text += (f"; the {st['count']} steady ones took {st['total_s']:.1f} s (mean "
             f"{st['mean_ms']:.1f} ms, median {st['p50_ms']:.1f} ms, p95 {st['p95_ms']:.1f} ms)")
    cycles = zip(series.get("input_wait_ms") or (), series.get("step_ms") or (),
                 series.get("between_ms") or (), series.get("steps") or (),
                 series.get("judged") or ())
    others = [((w or 0.0) + s + b) * n / 1000.0 for w, s, b, n, judged in cycles if not judged]
    rest = wall - st["total_s"] - sum(others)
    if others:
        text += (f"; the other {run - st['count']} (warm-up, epoch starts) {sum(others):.1f} s")
    if rest >= 0.05:
        text += f"; {rest:.1f} s around the steps (start-up, compiles, epoch ends, callbacks)"
    return text


def format_report(result):
    """The diagnosis as text for people: the headline (`analysis.headline`, from the
    run record), then the evidence under it."""
    from keras_gpufix.run_record import RunRecord

    command = " ".join(result["command"]).replace("\n", "; ")  # -c code on one line
    lines = analysis.headline(RunRecord.from_diagnosis(result).data, result.get("record"))
    live = [v for v in dict.fromkeys((f.get("monitor") or {}).get("verdict")
                                     for f in result["fits"]) if v]
    weighed = [name for name, taken in (("the what-if", result.get("what_if")),
                                        ("XProf", result.get("traces"))) if taken]
    if live and result["verdict"] not in live:  # the monitors' own lines, above, differ
        lines.append(f"         (the GPUOscillationMonitor line above said {' and '.join(live)}, "
                     "from the step log alone; this verdict weighs in "
                     + (" and ".join(weighed) if weighed else "the ranked causes")
                     + ": evidence below)")
    lines += ["", f"keras-gpufix diagnose: {command} (exit code {result['exit_code']})"]
    if result.get("ended_by"):
        lines.append(f"ended by: {result['ended_by']['text']}")
    if result.get("stopped"):
        lines.append(result["stopped"]["text"])
    if result["evidence"]:
        lines.append("evidence:")
        lines += [f"  - {e['text']}" for e in result["evidence"]]
    if result.get("what_if"):
        lines.append(format_what_if(result["what_if"], gain=not any(
            f.get("stage") for f in result["fixes"])))  # one gain for the input's cause
    if result["fixes"]:
        lines.append("fixes (ranked):")
        for fix in result["fixes"]:
            lines.append(f"  {fix['rank']}. [{fix['verdict']}] {fix['fix']}")
            if fix.get("stage"):  # its text names its line and says each figure once
                lines += [f"     {w}" for w in fix["where"][1:]]
                continue
            lines.append(f"     {fix['predicted']['text']}")
            lines += [f"     {w}" for w in fix["where"]]
        predicted = [f["predicted"]["speedup"] for f in result["fixes"]
                     if f["predicted"].get("speedup")]
        if result.get("together"):  # diagnose ran them all together
            lines.append(f"  {result['together']['text']}")
        elif len(predicted) > 1:  # the causes never overlap: the time each fix saves adds up
            speedup = analysis.combined_speedup(predicted)
            left = 1 / speedup if speedup else 0.0
            lines.append(f"  the {len(predicted)} predicted fixes together: "
                         + (f"the whole run {speedup:.2f}x faster (they save "
                            f"{_pct(1 - left)} of it, {_pct(left)} is left)" if speedup
                            else "unbounded")
                         + "; the sum takes the causes as apart, and they can interact (a "
                           "plot's pause slows the eager steps after it), so what is left is "
                           "the least sure figure and each fix's own gain the firmer one "
                           "(docs/benchmarks.md, advice-gains: each fix and the sum, "
                           "predicted against measured)")
    if result.get("seen_in_code"):
        lines.append("seen in the code (no effect measured in this run: not ranked):")
        for seen in result["seen_in_code"]:
            lines.append(f"  - [{seen['verdict']}] {seen['fix']}")
            lines += [f"    {w}" for w in seen["where"]]
    if result.get("not_offered"):
        lines.append("not offered (the run rules them out):")
        lines += [f"  - [{n['verdict']}] {', '.join(n['where'])}: {n['reason']}"
                  for n in result["not_offered"]]
    lines.append(f"static scan: {len(result['scan'])} finding(s)")
    lines += [f"  {f['file']}:{f['line']}: {f['trap']}: {f['code']}"
              + ("" if f.get("training_path", True) else " (not on the training path)")
              + (" (never ran)" if f.get("ran") is False else "")
              for f in result["scan"]]
    env = result["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "none"
    nvml = "available" if env["nvml"]["available"] else f"unavailable ({env['nvml']['reason']})"
    keras = (f"tf_keras {env['tf_keras']} (TF_USE_LEGACY_KERAS=1: tf.keras; Keras "
             f"{env['keras']} installed beside it)" if env.get("tf_keras")
             else f"Keras {env['keras']} ({env['keras_backend']})")
    framework = (f"TensorFlow {env['tensorflow']}" if env.get("tensorflow")
                 else f"JAX {env['jax']}, no TensorFlow" if env.get("jax") else "no TensorFlow")
    lines.append(f"environment: {framework}, {keras}, Python {env['python']}, "
                 f"{env['cpu_count']} CPUs ({env['cpus_usable']} usable), GPUs: {gpus}, XLA built: "
                 f"{env['xla']['built_with_xla']}, NVML: {nvml}, policy {env['dtype_policy']}")
    for fit in result["fits"]:
        retr = fit.get("retracing") or {}
        text = _steps_line(fit)
        if retr.get("trace_count") is not None:
            text += f", {retr['trace_count']} traces, recompile {retr.get('recompile_ms') or 0:.0f} ms"
        text += _compile_cache_words(fit, retr)
        if fit.get("error"):
            text += f"; ended by {fit['error']}"
        lines.append(text)
    if result["fits"]:
        lines.append(f"TensorBoard (step times, oscillation scalars"
                     f"{', traces' if result['traces'] else ''}): "
                     f"tensorboard --logdir {result['log_dir']}")
    lines += format_own_cost(result)
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def format_own_cost(result):
    """The report's lines on what diagnose added beyond the script (`own_cost`), or none."""
    return list((result.get("own_cost") or {}).get("text") or ())
