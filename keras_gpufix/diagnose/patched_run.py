"""diagnose's step patch, run before it is offered: the script run again with it.

The eager-step fix's patch (`step_patch.write_patch`: `LOG_DIR/step.patch`)
was traced, checked to compute the same result and timed on one batch after
the run. What the user will see is the script's run with the patch applied:
so diagnose reads the patch back as the user's `patch -p1` would apply it to
the files on disk (`apply`: a hunk that no longer matches is an error naming
it), and runs the script again in a fresh process with the patched files in
place of the originals, in memory only (`main`: the user's files are never
written), for the steps the first run timed, under the same monitors
(`run_diagnosis` with `sources`; no what-if, no trace). Its steady steps/s
against the first run's (`analysis.compare_runs`, as `keras-gpufix compare`
judges two runs) is the fix's gain; a patched script that fails, or runs
no step, is said so and its patch is not offered.

    python -m keras_gpufix.diagnose.patched_run SPEC.json   (diagnose runs it)
"""

import json
import os
import re
import subprocess
import sys
import time

from keras_gpufix.analysis.comparison import compare_runs
from keras_gpufix.analysis.verdicts import (PATCHED_RUN_FAILED, SKIPPED_RUN_FAILED,
                                            TOGETHER_RUN_TEXT, patched_run_text,
                                            steps_per_s_words)
from keras_gpufix.run_record import RunRecord, main_fit

__all__ = ["apply", "run_patched", "skip_statement", "check_fixes", "main"]

#: The most steps the patched run takes (a run of thousands of steps is timed on these).
MAX_STEPS = 200

_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply(patch, cwd, sources=None):
    """`{absolute path: text}` of the files unified diff `patch` changes, applied to
    the files under `cwd` (or to their text in `sources`) as `patch -p1` applies it.

    Raises:
        ValueError: naming the patch, the file and the hunk that does not apply.
    """
    sources = dict(sources or {})
    with open(patch, encoding="utf-8") as f:
        lines = f.read().splitlines(True)
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines)
                and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        name = lines[i + 1][4:].rstrip("\n").split("\t")[0]
        name = name.split("/", 1)[1] if "/" in name else name  # -p1
        path = os.path.abspath(os.path.join(cwd, name))
        if path not in sources:
            try:
                with open(path, encoding="utf-8") as f:
                    sources[path] = f.read()
            except OSError as exc:
                raise ValueError(f"{patch}: it changes {name}, which cannot be read from "
                                 f"{cwd} ({exc})") from None
        old, new, at = sources[path].splitlines(True), [], 0
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if m is None:
                raise ValueError(f"{patch}:{i + 1}: not a hunk header: {lines[i].strip()}")
            start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
            size_old = int(m.group(2) or 1)
            size_new = int(m.group(4) or 1)
            if start < at:
                raise ValueError(f"{patch}:{i + 1}: hunks out of order in {name}")
            new += old[at:start]
            at, header = start, i + 1
            i += 1
            while (size_old or size_new) and i < len(lines):
                kind, text = lines[i][:1], lines[i][1:]
                if kind in (" ", "-"):
                    if at >= len(old) or old[at].rstrip("\n") != text.rstrip("\n"):
                        raise ValueError(
                            f"{patch}:{header}: its hunk does not apply to {name} at line "
                            f"{at + 1} (the file changed since diagnose wrote the patch: run "
                            "diagnose again)")
                    if kind == " ":
                        new.append(old[at])
                        size_new -= 1
                    at, size_old = at + 1, size_old - 1
                elif kind == "+":
                    new.append(text)
                    size_new -= 1
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):  # \ No newline at end of file
                i += 1
        sources[path] = "".join(new + old[at:])
    return sources


def run_patched(command, patches, steps, log_dir, cwd=None, timeout=None, sources=None):
    """Runs `command` again with `patches` applied in memory, under diagnose's
    monitors (no what-if, no trace), for `steps` steps; returns its result dict
    (`run_diagnosis`'s), or `{"error": why}` where it could not run or failed.

    Args:
        command: the script's command, as diagnose ran it.
        patches: unified diffs to apply, in turn (`apply`), to the files or to
            their text in `sources` (`{path: text}`, e.g. `skip_statement`'s).
        steps: the steps to run (`--steps`).
        log_dir: the patched run's folder (its spec, result and logs).
        cwd: the folder diagnose ran in (the patches' paths are relative to it).
        timeout: seconds the run may take. Defaults to None: no limit.
    """
    cwd = os.path.abspath(cwd or os.getcwd())
    t0 = time.perf_counter()
    try:
        sources = dict(sources or {})
        for patch in patches:
            sources = apply(patch, cwd, sources)
    except ValueError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - t0}
    os.makedirs(log_dir, exist_ok=True)
    spec = os.path.join(log_dir, "spec.json")
    out = os.path.join(log_dir, "result.json")
    with open(spec, "w", encoding="utf-8") as f:
        json.dump({"command": list(command), "steps": steps, "log_dir": log_dir,
                   "sources": sources, "out": out}, f)
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package, os.environ.get("PYTHONPATH")) if p),
               KERAS_GPUFIX_TRACKERS="off")  # the runs the script opens again get no phases
    try:
        run = subprocess.run([sys.executable, "-m", "keras_gpufix.diagnose.patched_run", spec],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:  # not the patch's failure
        return {"unfinished": f"it ran past {timeout:.0f} s" if isinstance(
            exc, subprocess.TimeoutExpired) else "it was interrupted (Ctrl-C)",
                "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    try:
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        tail = (run.stderr or run.stdout or "").strip().splitlines()[-3:]
        return {"error": f"the patched run ended with exit code {run.returncode}: "
                         + " / ".join(tail), "seconds": seconds}
    result["seconds"] = seconds
    return result


def skip_statement(where):
    """`{path: text}`: the file of `where` (`file:line`) with the innermost statement
    holding that line replaced by `pass` (its other lines left blank: the line
    numbers stay the file's), or None where no simple statement holds it (the line
    of a loop's or block's own header: skipping it would skip the training too)."""
    import ast

    path, _, line = where.rpartition(":")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        line = int(line)
        tree = ast.parse(text, path)
    except (OSError, ValueError, SyntaxError):
        return None
    held = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)
            and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if not held:
        return None
    stmt = max(held, key=lambda n: (n.lineno, -(n.end_lineno or n.lineno)))  # innermost
    if any(isinstance(getattr(stmt, field, None), list) for field in ("body", "orelse")):
        return None  # a compound statement's header
    rows = text.splitlines(True)
    first = rows[stmt.lineno - 1]
    rows[stmt.lineno - 1] = first[:len(first) - len(first.lstrip())] + "pass\n"
    for i in range(stmt.lineno, stmt.end_lineno or stmt.lineno):
        rows[i] = "\n"
    return {os.path.abspath(path): "".join(rows)}


def _judged(result, after, count):
    """(compare_runs's result, the steps run, the whole loop's wall ratio or None) of
    the rerun `after` against `result`'s run."""
    judged = compare_runs(RunRecord.from_diagnosis(result).data,
                          RunRecord.from_diagnosis(after).data)
    before, fit = main_fit(result), main_fit(after)
    ran = (after.get("stopped") or {}).get("steps_run") or count
    same = (result.get("stopped") or {}).get("steps_run") == ran  # the same steps, both runs
    whole = before["wall_s"] / fit["wall_s"] if same and fit.get("wall_s") else None
    return judged, ran, whole


def _failure(result, after):
    """Why the rerun `after` failed where `result`'s run did not, or None: its own
    error, another exit code than the run's (a script that exits 3 as written is
    judged), or no training step."""
    if after.get("error"):
        return after["error"]
    if after.get("exit_code") != result.get("exit_code"):
        return "the script failed: " + ((after.get("ended_by") or {}).get("text")
                                        or f"exit code {after.get('exit_code')}")
    return None if main_fit(after) else "the script ran no training step"


def check_fixes(result, steps, log_dir, cwd=None):
    """Runs the script again for each fix diagnose can apply in memory, and puts what
    the run measured in the fix's `predicted` (`speedup` and `steady_speedup`: the
    steady steps/s ratio, `speedup_range`, `steps_per_s` before and after,
    `run_speedup`: the two runs' walls over the same steps, `text`):

    - the eager step's patch (`source` `patched-run`); where the patched script
      failed, the fix keeps no `patch` and says why (`patched-run-failed`);
    - a periodic stall's loop-body line skipped (`skip_statement`; `source`
      `skipped-run`): what the stall costs, all of it removed; no patch (how often
      to run it is the user's choice); where the script fails without it, the
      cost-share prediction stands and says so.

    Where two or more ran, the script runs once more with all of them
    (`result["together"]`: `speedup`, `speedup_range`, `steps_per_s`, `text`): the
    causes interact (a plot's pause slows the eager steps after it), so their gains
    measured apart do not add up.

    Returns the seconds the runs took (0 where nothing ran)."""
    before = main_fit(result)
    if before is None or (result.get("ended_by") or {}).get("kind") == "signal":
        return 0.0  # nothing judged, or the user stopped it
    count = min(steps or MAX_STEPS, MAX_STEPS)
    timeout = max(120.0, 3 * (before.get("wall_s") or 0.0) + 60.0)
    stall = next((f["step"]["stall_where"] for f in result.get("fits") or ()
                  if (f.get("step") or {}).get("stall_where")), None)
    skipped = skip_statement(stall) if stall else None
    seconds, ran_ok = 0.0, []

    def rerun(name, patches, sources):
        nonlocal seconds
        after = run_patched(result.get("command") or [], patches, count,
                            os.path.join(log_dir, name), cwd, timeout, sources)
        seconds += after.get("seconds") or 0.0
        return after

    for fix in result.get("fixes") or ():
        if fix.get("verdict") == "eager_step" and fix.get("patch"):
            name, patches, sources = "patched_run", [fix["patch"]], None
        elif fix.get("verdict") == "periodic_stall" and skipped:
            name, patches, sources = "skipped_run", [], skipped
        else:
            continue
        after = rerun(name, patches, sources)
        predicted = fix["predicted"]
        if after.get("unfinished"):  # the prediction it had stands, and says so
            predicted["text"] += f"; the run to check it did not finish ({after['unfinished']})"
            continue
        failed = _failure(result, after)
        if failed and patches:
            fix["patch"] = None
            fix["predicted"] = {**predicted, "speedup": None, "speedup_range": None,
                                "steady_speedup": None, "source": "patched-run-failed",
                                "text": PATCHED_RUN_FAILED.format(error=failed)}
            continue
        if failed:
            predicted["text"] += f"; {SKIPPED_RUN_FAILED.format(where=stall, error=failed)}"
            continue
        judged, ran, whole = _judged(result, after, count)
        gain = judged["gain"]
        if gain is None:
            continue
        ran_ok.append((patches, sources))
        b, a = judged["before"]["steps_per_s"], judged["after"]["steps_per_s"]
        fix["predicted"] = {
            **predicted, "speedup": gain, "steady_speedup": gain,
            "speedup_range": judged["gain_range"], "whole_run": True,
            "source": "patched-run" if patches else "skipped-run",
            "steps_per_s": [b, a], "run_speedup": whole,
            "text": patched_run_text(ran, b, a, gain, judged["gain_range"], whole,
                                     skipped=None if patches else stall)}
    if len(ran_ok) > 1:
        sources = {}
        for _, more in ran_ok:
            sources.update(more or {})
        after = rerun("together_run", [p for patches, _ in ran_ok for p in patches], sources)
        if not after.get("unfinished") and _failure(result, after) is None:
            judged, ran, _ = _judged(result, after, count)
            gain = judged["gain"]
            if gain is not None:
                b, a = judged["before"]["steps_per_s"], judged["after"]["steps_per_s"]
                low, high = judged["gain_range"]
                result["together"] = {"speedup": gain, "speedup_range": judged["gain_range"],
                                      "steps_per_s": [b, a],
                                      "text": TOGETHER_RUN_TEXT.format(
                                          count=len(ran_ok), steps=ran,
                                          before=steps_per_s_words(b),
                                          after=steps_per_s_words(a),
                                          gain=gain, low=low or gain, high=high or gain)}
    return seconds


def main(argv=None):
    """The patched run's process: the spec's command under `run_diagnosis` with its
    patched sources in place of the files; the result written to the spec's `out`."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    sys.dont_write_bytecode = True  # no cached bytecode of a patched file, ever
    from keras_gpufix.diagnose.run import run_diagnosis

    result = run_diagnosis(spec["command"], steps=spec["steps"], log_dir=spec["log_dir"],
                           trace=False, what_if=False, verbose=0, sources=spec["sources"])
    part = spec["out"] + ".part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(part, spec["out"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
