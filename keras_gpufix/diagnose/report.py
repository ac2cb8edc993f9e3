"""The report: rank the measured causes and print the diagnosis for people."""

from keras_gpufix import analysis
from keras_gpufix.analysis import THRESHOLDS
from keras_gpufix.diagnose.what_if import format_what_if
from keras_gpufix.profiling import format_analysis

__all__ = ["rank_causes", "format_report", "healthy_evidence", "trace_evidence"]


def _pct(x):
    return f"{x:.0%}"


def _label(fit):
    """`fit 1` or `loop 2`: how the report names one run."""
    return f"{fit.get('kind', 'fit')} {fit['index']}"


def _input_wait(fit):
    """The run's input-wait share: the monitor's, else (a custom loop) the time in next()."""
    wait = (fit.get("monitor") or {}).get("input_wait")
    return (fit.get("phases") or {}).get("input_share") if wait is None else wait


def _eager_cause(fit, label, wait, scan):
    """The `eager_step` candidate of one run (direct evidence), or None."""
    step = fit.get("step") or {}
    if step.get("eager"):
        where = step.get("eager_where")
        text = (f"{label}: the gradient step ran eagerly (a GradientTape outside any "
                f"tf.function, at {where})")
    elif (fit.get("model") or {}).get("run_eagerly"):
        where = next((f"{f['file']}:{f['line']}" for f in scan if f["trap"] == "run_eagerly"),
                     "the model's compile (run_eagerly=True)")
        text = f"{label}: fit ran with run_eagerly=True: every op of the step ran from Python"
    else:
        return None
    share = 1.0 - (wait or 0.0)
    return ("eager_step", share, {"source": "diagnose", "figure": "step_share", "value": share,
                                  "text": text, "where": where})


def _fit_causes(fit, scan):
    """(verdict, cost share, evidence) candidates measured in one run."""
    out = []
    monitor = fit.get("monitor") or {}
    st = monitor.get("step_time") or {}
    label = _label(fit)
    wait = _input_wait(fit)
    eager = _eager_cause(fit, label, wait, scan) if st.get("count") else None
    if eager:
        out.append(eager)
    if wait is not None and wait >= THRESHOLDS["input_wait_share"]:
        out.append(("input_bound", wait, {
            "source": "GPUOscillationMonitor", "figure": "input_wait", "value": wait,
            "text": f"{label}: {_pct(wait)} of step time spent waiting for the next batch "
                    f"({st.get('count')} steps, median {st.get('p50_ms', 0):.1f} ms, "
                    f"p95 {st.get('p95_ms', 0):.1f} ms)"}))
    retr = fit.get("retracing") or {}
    if retr.get("verdict") == "recompiling":
        share = retr.get("recompile_share") or 0.0
        out.append(("recompiling", share, {
            "source": "RetracingMonitor", "figure": "recompile_share", "value": share,
            "text": f"{label}: {retr.get('new_shapes')} distinct input shapes, "
                    f"{retr.get('recompile_ms') or 0:.0f} ms spent at new shapes "
                    f"({_pct(share)} of the run's wall time, median step "
                    f"{retr.get('median_step_ms') or 0:.1f} ms), "
                    f"{retr.get('trace_count')} train-step traces"}))
    for event in monitor.get("events") or []:
        verdict = event["verdict"]
        if verdict in ("input_bound", "recompiling") and any(c[0] == verdict for c in out):
            continue
        ev = event.get("evidence") or {}
        share = event.get("cost_share") or ev.get("slow_time_share") or ev.get("input_wait") or 0.0
        out.append((verdict, share, {
            "source": "GPUOscillationMonitor", "figure": "event", "value": share,
            "text": f"{label}: {event['message']}", "period": event.get("period"),
            "phase": event.get("phase")}))
    for trace in (fit.get("profiler") or {}).get("traces", []):
        a = trace.get("analysis") or {}
        if a.get("classification") == "highly_input_bound":
            out.append(("input_bound", (a.get("input_percent") or 0) / 100,
                        _trace_item(fit, trace)))
    return out


def _trace_item(fit, trace):
    a = trace["analysis"]
    analysed = a.get("step_time_ms") is not None
    return {"source": "XProf", "figure": "input_percent",
            "value": a.get("input_percent") if analysed else None,
            "text": f"{_label(fit)}: XProf trace of steps {trace['start_step']}-"
                    f"{trace['end_step']} ({trace.get('reason')}): "
                    + (format_analysis(a) if analysed else
                       "XProf could not analyse it: " + format_analysis(a)),
            "path": trace.get("path")}


def trace_evidence(fits):
    return [_trace_item(fit, trace) for fit in fits
            for trace in (fit.get("profiler") or {}).get("traces", [])
            if "classification" in (trace.get("analysis") or {})]


def _ruled_out(fits, ranking):
    """Verdicts this run measured absent: their static findings are not ranked as fixes.

    `input_bound` when every timed run waited less than the threshold for
    input and no what-if found the input costing that share either (an
    input competing for the cores reads 0% wait); `eager_step` when steps
    were timed and none ran eagerly.
    """
    timed = [f for f in fits if ((f.get("monitor") or {}).get("step_time") or {}).get("count")]
    if not timed:
        return set()
    out = set()
    limit = THRESHOLDS["input_wait_share"]
    speedups = [(f.get("what_if") or {}).get("speedup_if_input_free") for f in timed]
    if all(_input_wait(f) is not None and _input_wait(f) < limit for f in timed) and not any(
            z and 1 - 1 / z >= limit for z in speedups):
        out.add("input_bound")
    if not any(c["verdict"] == "eager_step" for c in ranking):
        out.add("eager_step")
    return out


def rank_causes(fits, scan=()):
    """Ranks the measured causes; returns (verdict, ranking, fixes).

    The causes measured in each run (input wait, recompile time, time lost
    to slow steps, an eager step) are ranked by the share of time each cost
    (`keras_gpufix.analysis.rank_causes`, with the one verdict table and
    thresholds); static findings never make a verdict, they point at the
    lines to change for it; findings off the training path
    (`training_path` False) are never fixes, nor are findings of a cause
    the run measured absent (`input_bound` with little input wait and no
    what-if gain, `eager_step` with no eager step).

    Returns:
        `verdict` (`healthy` when steps were timed and no cause was
        measured, `unknown` when no training step was seen), `ranking` (list
        of dicts `verdict`, `score`, `evidence`, `fix`, best first) and
        `fixes` (ranked list of dicts `rank`, `verdict`, `fix`, `where`:
        `file:line` of the matching scan findings).
    """
    ranking = analysis.rank_causes(c for fit in fits for c in _fit_causes(fit, scan))
    verdict = ranking[0]["verdict"] if ranking else "healthy" if _judged(fits) else "unknown"
    fixes, used = [], set()
    for cause in ranking:
        where = [f for f in scan if f.get("verdict") == cause["verdict"]
                 and f.get("training_path", True)]
        used.update(id(f) for f in where)
        seen = []
        if cause["verdict"] == "eager_step":
            seen = [f"{(f.get('step') or {})['eager_where']}: the step's gradient, measured eager"
                    for f in fits if (f.get("step") or {}).get("eager_where")]
        fixes.append({"verdict": cause["verdict"], "fix": cause["fix"],
                      "where": seen + [f"{f['file']}:{f['line']}: {f['why']}; {f['fix']}"
                                       for f in where]})
    ruled_out = _ruled_out(fits, ranking)
    for f in scan:  # code that training does not run, or a cause measured absent, is no fix
        if (id(f) not in used and f.get("verdict") is not None and f.get("training_path", True)
                and f["verdict"] not in ruled_out):
            fixes.append({"verdict": f["verdict"], "fix": f["fix"],
                          "where": [f"{f['file']}:{f['line']}: {f['why']}"]})
    for rank, fix in enumerate(fixes, start=1):
        fix["rank"] = rank
    return verdict, ranking, fixes


def _judged(fits):
    """The runs whose steps were timed and numerous enough for the monitor to judge."""
    return [f for f in fits if ((f.get("monitor") or {}).get("step_time") or {}).get("count")
            and (f.get("monitor") or {}).get("verdict") != "unknown"]


def healthy_evidence(fits):
    """What a `healthy` verdict rests on; for `unknown`, that nothing was seen or judged."""
    out = []
    counts = [((f.get("monitor") or {}).get("step_time") or {}).get("count") or 0 for f in fits]
    if not any(counts):
        loops = ", ".join(_label(f) for f in fits) or "no model.fit call"
        return [{"source": "diagnose", "figure": "steps", "value": 0,
                 "text": f"the script ran but no training step was seen ({loops}; no gradient "
                         "step between iterations of a tf.data dataset): nothing was measured, "
                         "so nothing can be judged"}]
    if not _judged(fits):
        return [{"source": "diagnose", "figure": "steps", "value": max(counts),
                 "text": f"{_label(f)}: {n} steps timed after the warm-up, too few to judge "
                         f"(at least {THRESHOLDS['min_judge_steps']} are needed): run longer "
                         "(a larger --steps)"} for f, n in zip(fits, counts) if n]
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
                            + "; no cause measured: the steps are compute-bound"})
    return out


def format_report(result):
    """The diagnosis as text for people."""
    command = " ".join(result["command"]).replace("\n", "; ")  # -c code on one line
    lines = [f"keras-gpufix diagnose: {command} "
             f"(exit code {result['exit_code']})",
             f"verdict: {result['verdict']}"]
    if result.get("ended_by"):
        lines.insert(1, f"ended by: {result['ended_by']['text']}")
    if result["evidence"]:
        lines.append("evidence:")
        lines += [f"  - {e['text']}" for e in result["evidence"]]
    if result.get("what_if"):
        lines.append(format_what_if(result["what_if"]))
    if result["fixes"]:
        lines.append("fixes (ranked):")
        for fix in result["fixes"]:
            lines.append(f"  {fix['rank']}. [{fix['verdict']}] {fix['fix']}")
            lines += [f"     {w}" for w in fix["where"]]
    lines.append(f"static scan: {len(result['scan'])} finding(s)")
    lines += [f"  {f['file']}:{f['line']}: {f['trap']}: {f['code']}"
              + ("" if f.get("training_path", True) else " (not on the training path)")
              for f in result["scan"]]
    env = result["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "none"
    nvml = "available" if env["nvml"]["available"] else f"unavailable ({env['nvml']['reason']})"
    lines.append(f"environment: TensorFlow {env['tensorflow']}, Keras {env['keras']} "
                 f"({env['keras_backend']}), Python {env['python']}, {env['cpu_count']} CPUs "
                 f"({env['cpus_usable']} usable), GPUs: {gpus}, XLA built: "
                 f"{env['xla']['built_with_xla']}, NVML: {nvml}, policy {env['dtype_policy']}")
    for fit in result["fits"]:
        st = (fit.get("monitor") or {}).get("step_time") or {}
        retr = fit.get("retracing") or {}
        text = f"{_label(fit)}: {fit.get('steps') or 0} steps timed in {fit.get('wall_s', 0):.1f} s"
        if fit.get("stopped_by_diagnose"):
            text += " (stopped by --steps)"
        if st.get("count"):
            text += f", median {st['p50_ms']:.1f} ms, p95 {st['p95_ms']:.1f} ms"
        if retr.get("trace_count") is not None:
            text += f", {retr['trace_count']} traces, recompile {retr.get('recompile_ms') or 0:.0f} ms"
        if fit.get("error"):
            text += f"; ended by {fit['error']}"
        lines.append(text)
    if result["fits"]:
        lines.append(f"TensorBoard (step times, oscillation scalars"
                     f"{', traces' if result['traces'] else ''}): "
                     f"tensorboard --logdir {result['log_dir']}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
