"""The headline every view of a run opens with: three lines a person reads in ten seconds.

    verdict: input_bound; 85% of the run waiting for its input
    fix:     take the Python work out of `map` at train.py:63 ...: the whole run 6.05x faster
    check:   after the fix, run it again and: keras-gpufix compare BEFORE AFTER

`headline(record)` reads a run record (`RunRecord.data`) only: the console
summary of `keras-gpufix diagnose`, the monitor's end-of-run line and
report.html print the same three lines, with the same figures. The evidence
(ranges, how a figure was reached, per-stage rates) follows them in each view.

Imports neither TensorFlow nor Keras.
"""

import os

from keras_gpufix.analysis.contention import contention_text
from keras_gpufix.analysis.job import job_headline
from keras_gpufix.analysis.verdicts import THRESHOLDS

__all__ = ["HEADLINE_FIXES", "headline", "gain_words"]

#: What the verdict's share of the run is, by verdict (`{period}`: its period in steps).
_SHARE_WORDS = {
    "input_bound": "waiting for its input",
    "periodic_stall": "lost to work every {period} steps",
    "eager_step": "lost to the step running eagerly (its excess over a compiled step)",
    "recompiling": "lost to compiles",
    "dispatch_bound": "lost to dispatching short steps",
    "sync_callbacks": "lost to callbacks that make each step wait",
    "irregular_stall": "lost to long cycles with no period",
    "degrading": "lost to steps that keep growing slower",
}

#: The top fix in one sentence, by verdict (`{op}`: the input's slow stage, `{period}`;
#: `{at}`: ` at file:line`, where the sentence names it; else it ends the sentence).
HEADLINE_FIXES = {
    "input_bound": "move the input's work into TF ops or a feature cache, with prefetch",
    "input_bound_stage": "take the Python work out of `{op}`{at} (into TF ops), or cache its "
                         "output",
    "periodic_stall": "move the work that runs every {period} steps{at} off the step path, or "
                      "run it less often",
    "eager_step": "compile the step{at} (tf.function, then try jit_compile=True)",
    # where diagnose made the step run compiled and checked it: its patch, which holds
    # jit_compile=True only where XLA ran it (a tf.print in the step: tf.function alone)
    "eager_step_patch": "compile the step{at}: `patch -p1 < {patch}` (diagnose traced it, "
                        "checked it and ran the script with it)",
    "recompiling": "bound the input shapes (length buckets, or padding to a multiple)",
    "dispatch_bound": "run several steps per call (steps_per_execution) or larger batches",
    "sync_callbacks": "set `async_safe = True` on the batch-end callbacks that block",
    "irregular_stall": "trace one long cycle to see what runs then "
                       "(kg.ProfilerTrigger(trigger='slow_step'))",
    "degrading": "look for state that grows every step (lists of tensors, retracing)",
}


def gain_words(fix: dict) -> str:
    """A ranked fix's one gain, in the unit the user sees: `the whole run 6.05x faster`
    (`expected_speedup` of the run as the script runs it), `the steps 2.10x faster`
    (a gain per step, where the whole run's is not known), `the whole run at most
    1.25x faster` (a cause known by its cost share alone), `1.66x the steps/s,
    measured with the patch applied` (diagnose ran the script with its patch), or why
    there is none."""
    speedup = fix.get("expected_speedup")
    if speedup is None:
        return "its gain was not measured"
    if fix.get("source") == "cost_share":  # known by its cost alone: what removing all of it gives
        return f"the whole run at most {speedup:.2f}x faster (all of its time removed)"
    if fix.get("source") == "patched-run":  # diagnose ran the script with the patch
        return f"{speedup:.2f}x the steps/s, measured with the patch applied"
    if fix.get("source") == "skipped-run":  # ... and with the stall's line skipped
        return f"{speedup:.2f}x the steps/s with that work removed, measured"
    whole = fix.get("whole_run")
    whole = fix.get("source") != "compiled-step" if whole is None else whole
    return f"{'the whole run' if whole else 'the steps'} {speedup:.2f}x faster"


def _line_of(where) -> "str | None":
    """`file:line` of a fix's first location (`file:line: why`), or None."""
    for w in where or ():
        file, _, line = w.split(": ", 1)[0].rpartition(":")
        if file and line.isdigit():
            try:
                near = os.path.relpath(file)  # as the user would type it, from here
            except ValueError:  # another drive
                near = file
            return f"{file if near.startswith('..') else near}:{line}"
    return None


def headline(record: dict, path: str = None) -> list:
    """The three lines a view of `record` (`RunRecord.data`) opens with.

    Args:
        record: the run record's data.
        path: the record's file or folder, named in the `compare` command.
            Defaults to None: `BEFORE`.

    Returns:
        `[verdict line, fix line, check line]`.
    """
    v = record.get("verdict") or {}
    verdict = v.get("verdict") or "unknown"
    causes = {c.get("verdict"): c for c in record.get("causes") or ()}
    cause = causes.get(verdict) or {}
    share = cause.get("share")  # the share its fix's gain is reckoned from
    share = v.get("cost_share") if share is None else share
    period = cause.get("period")
    contention = contention_text(record.get("contention"), verdict)
    if verdict == "healthy":
        first = f"healthy; no cause measured costs {THRESHOLDS['cost_share']:.0%} of the run"
    elif verdict == "unknown":
        first = "unknown; no training step was judged"
    else:
        words = _SHARE_WORDS.get(verdict, "lost to it").format(period=period or "?")
        first = f"{verdict}; " + (f"{share:.0%} of the run {words}" if share is not None
                                  else words)
    lines = [f"verdict: {first}" + (f"; {contention}" if contention else "")]
    fixes = record.get("fixes") or ()
    fix = fixes[0] if fixes else None
    compare = f"keras-gpufix compare {path or 'BEFORE'} AFTER"
    job = job_headline(record.get("job"))
    if job is not None:  # a multi-worker job held back by one worker: that comes first
        own = first.split(";")[0]
        return [f"verdict: {job[0]} (this worker's own steps: {own})", f"fix:     {job[1]}",
                f"check:   after the fix, run it again and: {compare}"]
    if fix is None:
        if verdict in ("healthy", "unknown"):
            told = "nothing to fix"
            if verdict == "unknown":
                told = v.get("fix") or "nothing was judged: the evidence says what was seen"
            lines.append(f"fix:     {told}")
            lines.append(f"check:   a later run against this one: {compare}")
            return lines
        sentence = (HEADLINE_FIXES[verdict].format(period=period or "?", op="?", at="")
                    if verdict in HEADLINE_FIXES else v.get("fix") or "")
        lines.append(f"fix:     {sentence}: its gain was not measured")
    else:
        op = fix.get("stage_op")
        key = ("input_bound_stage" if fix["verdict"] == "input_bound" and op
               else "eager_step_patch" if fix["verdict"] == "eager_step" and fix.get("patch")
               else fix["verdict"])
        where = _line_of(fix.get("where"))
        at = f" at {where}" if where else ""
        template = HEADLINE_FIXES.get(key)
        sentence = fix.get("fix") or "" if template is None else template.format(
            op=op, at=at, patch=fix.get("patch"),
            period=(causes.get(fix["verdict"]) or {}).get("period") or "?")
        lines.append(f"fix:     {sentence}" + ("" if "{at}" in (template or "") else at)
                     + f": {gain_words(fix)}")
    lines.append(f"check:   after the fix, run it again and: {compare}")
    return lines
