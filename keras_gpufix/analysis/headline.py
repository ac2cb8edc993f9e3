"""The headline every view of a run opens with: three lines a person reads in ten seconds.

    verdict: input_bound; 85% of the run waiting for its input
    fix:     take the Python work out of `map` at train.py:63 ...: the whole run 6.05x faster
    check:   after the fix, run it again and: keras-gpufix compare BEFORE AFTER

and, second, a line of its own where other processes contended for the CPU during
the run (`load_line`):

    load:    other processes used 60% of the CPU during the run (load 3.1 on 2 CPUs); ...

`headline(record)` reads a run record (`RunRecord.data`) only: the console
summary of `keras-gpufix diagnose`, the monitor's end-of-run line and
report.html print the same lines, with the same figures. The evidence
(ranges, how a figure was reached, per-stage rates) follows them in each view.

Imports neither TensorFlow nor Keras.
"""

import os

from keras_gpufix.analysis.contention import contention_text
from keras_gpufix.analysis.job import job_headline
from keras_gpufix.analysis.stages import on_disk_cache
from keras_gpufix.analysis.verdicts import THRESHOLDS, where_place

__all__ = ["HEADLINE_FIXES", "headline", "gain_words", "load_line", "verdict_share"]

#: The least gain a headline offers (1.00x as printed is none).
_SOME = 1.005
#: Two gains that differ by less than this share read as one (the steady steps'
#: and the whole loop's: the second is printed only where it says more).
_SAME = 0.05
#: The longest headline line (a terminal's width at most, in one reading).
_WIDTH = 200
#: The headline's key of an input stage's fix, by the stage's kind (`analysis.stages`).
_STAGE_KEYS = {"python": "input_bound_stage", "parallel": "input_bound_stage_parallel",
               "cache": "input_bound_stage_cache", "source": "input_bound_stage_cache"}

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
    "input_bound": "move the input's work into TF ops or a feature cache",
    # the input's slow stage, by its kind (`analysis.stages`): Python work, a TF map run
    # one element at a time, a TF stage slow even in parallel (cached, not moved into TF
    # ops: it is TF ops), and a cache that pays only from the next run (kept in a file)
    "input_bound_stage": "take the Python work out of `{op}`{at} (into TF ops), or cache its "
                         "output",
    "input_bound_stage_parallel": "run `{op}`{at} in parallel "
                                  "(num_parallel_calls=tf.data.AUTOTUNE)",
    "input_bound_stage_cache": "cache the output of `{op}`{at} (`.cache()` right after it)",
    "input_bound_stage_file": "cache the output of `{op}`{at} in a file (`.cache(\"FILE\")` "
                              "right after it)",
    "periodic_stall": "move the work that runs every {period} steps{at} off the step path, or "
                      "run it less often",
    "eager_step": "compile the step{at} (tf.function, then try jit_compile=True)",
    # where diagnose made the step run compiled and checked it: its patch, which holds
    # jit_compile=True only where XLA ran it (a tf.print in the step: tf.function alone)
    "eager_step_patch": "compile the step{at}: `patch -p1 < {patch}`",
    "recompiling": "bound the input shapes (length buckets, or padding to a multiple)",
    "dispatch_bound": "run several steps per call (steps_per_execution) or larger batches",
    "sync_callbacks": "set `async_safe = True` on the batch-end callbacks that block",
    "irregular_stall": "trace one long cycle to see what runs then "
                       "(kg.ProfilerTrigger(trigger='slow_step'))",
    # ... where the long cycles' stack samples found the line their work runs at
    "irregular_stall_located": "move the work{at} off the step path, or run it less often "
                               "(the long cycles' stack samples find it there)",
    "degrading": "look for state that grows every step (lists of tensors, retracing)",
}


def gain_words(fix: dict) -> str:
    """A ranked fix's one gain, in the unit the user sees: `the whole run 6.05x faster`
    (`expected_speedup` of the run as the script runs it), `the steps 2.10x faster`
    (a gain per step, where the whole run's is not known), `the whole run at most
    1.25x faster` (a cause known by its cost share alone), `1.66x the steps/s,
    measured with the patch applied (the whole loop 1.40x)` (diagnose ran the script
    with its patch: the steady steps, and its loops' wall, compile included), `not
    known yet` (its reruns' range holds 1.0) with the steps that would settle it, or
    why there is none."""
    speedup = fix.get("expected_speedup")
    if speedup is None:
        return "its gain was not measured"
    if fix.get("source") == "cost_share":  # known by its cost alone: what removing all of it gives
        return f"the whole run at most {speedup:.2f}x faster (all of its time removed)"
    if fix.get("known") is False:  # reruns beside the script as it is: the range holds 1.0
        low, high = fix.get("speedup_range") or (speedup, speedup)
        settle = fix.get("settle_steps")
        return (f"not known yet ({speedup:.2f}x, {low:.2f}x-{high:.2f}x measured beside the "
                "script as it is)" + (f"; runs of about {settle} steady steps would settle it"
                                      if settle else ""))
    if fix.get("source") == "patched-run":  # diagnose ran the script with the patch
        loop = fix.get("run_speedup")
        return (f"{speedup:.2f}x the steps/s, measured with the patch applied"
                + ("" if loop is None or abs(loop / speedup - 1) < _SAME
                   else f" (the whole loop {loop:.2f}x)"))
    if fix.get("source") == "skipped-run":  # ... and with the stall's line skipped
        return f"{speedup:.2f}x the steps/s with that work removed, measured"
    whole = fix.get("whole_run")
    whole = fix.get("source") != "compiled-step" if whole is None else whole
    return f"{'the whole run' if whole else 'the steps'} {speedup:.2f}x faster"


def _near(path: str) -> str:
    """`path` as the user would type it from here: relative below the current folder."""
    try:
        near = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if near.startswith("..") else near


def _line_of(where, name) -> "str | None":
    """`file:line` of a fix's first location (`file:line: why`), the file named by
    `name(file)`, or None."""
    for w in where or ():
        file, line = where_place(w)
        if file and line.isdigit():
            return f"{name(file)}:{line}"
    return None


def verdict_share(record: dict) -> tuple:
    """`(verdict, share)` the headline opens with: the verdict's name and its share of
    the run (its cause's, which its fix's gain is reckoned from; else the judgement's
    cost share; None where neither is known)."""
    v = record.get("verdict") or {}
    verdict = v.get("verdict") or "unknown"
    cause = {c.get("verdict"): c for c in record.get("causes") or ()}.get(verdict) or {}
    share = cause.get("share")
    return verdict, v.get("cost_share") if share is None else share


def _gains(fix) -> bool:
    """Whether a ranked fix's gain is one a headline may offer: measured or predicted
    above 1.00x (this run, or every later run with a cache on disk), or not known
    yet (its reruns' range holds 1.0: said so); False for a gain of 1.00x or none."""
    if fix.get("known") is False:
        return True
    return max(fix.get("expected_speedup") or 0.0, fix.get("later_speedup") or 0.0) >= _SOME


def _fix_line(fix, causes) -> str:
    """The fix line's sentence and gain for one ranked fix: its line, and the words
    true of the user's code (a map of TF ops is cached, not moved into TF ops; a
    cache that pays only in later runs says so and is kept in a file). Its file as
    the user would type it from here; by its name alone where the line would pass
    `_WIDTH` (the evidence has its path)."""
    line = _fix_sentence(fix, causes, _near)
    if len("fix:     " + line) > _WIDTH:
        line = _fix_sentence(fix, causes, os.path.basename)
    if fix["verdict"] == "eager_step" and not fix.get("patch") and fix.get("refused"):
        room = _WIDTH - len("fix:     ") - len(line) - len("; no patch: ")
        why = fix["refused"] if len(fix["refused"]) <= room else (
            fix["refused"][:max(0, room - 3)] + "...")
        line += f"; no patch: {why}" if room > 20 else ""
    return line


def _fix_sentence(fix, causes, name) -> str:
    """`_fix_line`'s sentence and gain, its file named by `name(file)`."""
    op, kind = fix.get("stage_op"), fix.get("stage_kind")
    later = fix.get("later_speedup")
    speedup = fix.get("expected_speedup")
    on_disk = bool(op) and on_disk_cache(speedup or 1.0, later)
    key = fix["verdict"]
    if key == "input_bound" and op:
        key = ("input_bound_stage_file" if on_disk else
               _STAGE_KEYS.get(kind, "input_bound_stage"))
    elif key == "eager_step" and fix.get("patch"):
        key = "eager_step_patch"
    where = _line_of(fix.get("where"), name)
    if key == "irregular_stall" and where:
        key = "irregular_stall_located"
    at = f" at {where}" if where else ""
    template = HEADLINE_FIXES.get(key)
    sentence = fix.get("fix") or "" if template is None else template.format(
        op=op, at=at, patch=fix.get("patch") and _near(fix["patch"]),
        period=(causes.get(fix["verdict"]) or {}).get("period") or "?")
    gain = (f"every later run {later:.2f}x faster (this run {speedup or 1.0:.2f}x: it fills "
            "the file)" if on_disk else gain_words(fix))
    return sentence + ("" if "{at}" in (template or "") else at) + f": {gain}"


def load_line(record: dict) -> "str | None":
    """The headline's line on the load, where other processes contended for the CPU
    during the run (`contention_text`): `load:    other processes used 60% ...`; None
    on a quiet run."""
    text = contention_text(record.get("contention"),
                           (record.get("verdict") or {}).get("verdict"))
    return f"load:    {text}" if text else None


def headline(record: dict, path: str = None) -> list:
    """The lines a view of `record` (`RunRecord.data`) opens with: the verdict, the
    load where other processes contended (`load_line`, a line of its own), the one
    fix, the check.

    A healthy run whose ranking holds a cause below its threshold names it as the
    largest cause, with its line and gain, and says it is below the threshold (the
    same cause, line and gain as a run of the script judged by that cause). A fix
    whose gain is 1.00x is never offered: the next ranked fix with a gain is, else
    `nothing to fix`.

    Args:
        record: the run record's data.
        path: the record's file or folder, named in the `compare` command.
            Defaults to None: `BEFORE`.

    Returns:
        `[verdict line, fix line, check line]`, with the load line second where
        there is one.
    """
    v = record.get("verdict") or {}
    verdict, share = verdict_share(record)
    causes = {c.get("verdict"): c for c in record.get("causes") or ()}
    period = (causes.get(verdict) or {}).get("period")
    fixes = record.get("fixes") or ()
    fix = next((f for f in fixes if _gains(f)), None)
    if verdict == "healthy":
        first = "healthy; no cause reaches its threshold " + (
            f"({THRESHOLDS['input_wait_share']:.0%} of the run waiting for input, "
            f"{THRESHOLDS['cost_share']:.0%} lost to another cause)")
    elif verdict == "unknown" and v.get("input_unmeasured"):
        first = "unknown; " + v["fix"]  # the phase that holds the input, and how to measure it
    elif verdict == "unknown":
        first = "unknown; no training step was judged"
    else:
        words = _SHARE_WORDS.get(verdict, "lost to it").format(period=period or "?")
        first = f"{verdict}; " + (f"{share:.0%} of the run {words}" if share is not None
                                  else words)
    lines = [f"verdict: {first}"] + [line for line in (load_line(record),) if line]
    compare = f"keras-gpufix compare {path or 'BEFORE'} AFTER"
    job = job_headline(record.get("job"))
    if job is not None:  # a multi-worker job held back by one worker: that comes first
        own = first.split(";")[0]
        return [f"verdict: {job[0]} (this worker's own steps: {own})", f"fix:     {job[1]}",
                f"check:   after the fix, run it again and: {compare}"]
    if fix is None:
        if verdict in ("healthy", "unknown") or fixes:
            told = "nothing to fix"
            if verdict == "unknown" and v.get("input_unmeasured"):
                told = "none judged until the input wait is measured (the command above)"
            elif verdict == "unknown":
                told = v.get("fix") or "nothing was judged: the evidence says what was seen"
            elif fixes:  # ranked, but none gains anything measurable
                told += (f": the fix of {fixes[0]['verdict']} measured no gain "
                         f"({fixes[0].get('expected_speedup') or 1.0:.2f}x)")
            lines.append(f"fix:     {told}")
            lines.append(f"check:   a later run against this one: {compare}")
            return lines
        sentence = (HEADLINE_FIXES[verdict].format(period=period or "?", op="?", at="")
                    if verdict in HEADLINE_FIXES else v.get("fix") or "")
        lines.append(f"fix:     {sentence}: its gain was not measured")
    elif verdict == "healthy":  # a cause below its threshold: named, with its gain
        share = fix.get("share")
        lines.append(f"fix:     none needed to call it healthy; the largest cause, "
                     f"{fix['verdict']}"
                     + (f" ({share:.0%} of the run)" if share is not None else "")
                     + f": {_fix_line(fix, causes)}")
    else:
        line = f"fix:     {_fix_line(fix, causes)}"
        both = _together(record, fix)
        lines.append(line + both if len(line + both) <= _WIDTH else line)
    lines.append(f"check:   after the fix, run it again and: {compare}")
    return lines


def _together(record, fix) -> str:
    """`; both fixes together: 44.98x` (`all 3 fixes`), where diagnose ran the fixes
    together beside the script as it is and they gain more than the one named; else
    nothing."""
    both = record.get("together") or {}
    gain = both.get("speedup")
    if not gain or not both.get("known") or gain <= (fix.get("expected_speedup") or 1.0):
        return ""
    count = both.get("fixes") or 2
    return f"; {'both' if count == 2 else f'all {count}'} fixes together: {gain:.2f}x"
