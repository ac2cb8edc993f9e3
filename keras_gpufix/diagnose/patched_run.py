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
against runs of the script as it is taken beside it (`run_pairs`: alternated,
for as many rounds as the range needs; `analysis.paired_gain`, each round
judged as `keras-gpufix compare` judges two runs) is the fix's gain; a
patched script that fails, or runs no step, is said so and its patch is not
offered.

    python -m keras_gpufix.diagnose.patched_run SPEC.json   (diagnose runs it)
"""

import json
import os
import re
import subprocess
import sys
import time

from keras_gpufix.analysis.comparison import (CHEAP_ROUNDS_S, MAX_ROUNDS, MIN_ROUNDS,
                                              MOST_ROUNDS, paired_gain,
                                              patched_run_text, settled, together_run_text)
from keras_gpufix.analysis.verdicts import (PATCHED_RUN_FAILED, SKIPPED_RUN_FAILED,
                                            where_place)
from keras_gpufix.run_record import RunRecord, main_fit

__all__ = ["apply", "run_patched", "run_pairs", "skip_statement", "check_fixes", "main"]

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


def _whole(pairs):
    """The as-is runs' loop wall over the fixed runs' (trace and compile in it), over the
    rounds where both ran the same steps; None where none did."""
    same = [(main_fit(a)["wall_s"], main_fit(f)["wall_s"]) for a, f in pairs
            if (a.get("stopped") or {}).get("steps_run") == (f.get("stopped") or {}).get(
                "steps_run") and main_fit(a).get("wall_s") and main_fit(f).get("wall_s")]
    return sum(a for a, _ in same) / sum(f for _, f in same) if same else None


def run_pairs(result, variants, steps, log_dir, cwd=None, more=None, rounds=None):
    """Runs the script of `result` (diagnose's) as it is and with each of `variants`,
    alternated: a round is one as-is run and one run of each variant, the as-is run
    first in odd rounds and last in even ones (A B, B A: a load that drifts weighs
    on both sides). Rounds go on, `MIN_ROUNDS` at least, while a variant's gain is
    not `settled` (its range holds 1.0 or is wider than `SETTLED` either way, or its
    rounds' loads differ: `analysis.paired_gain`), up to `rounds`; by default up to
    `MAX_ROUNDS`, and past it up to `MOST_ROUNDS` while the reruns so far took under
    `CHEAP_ROUNDS_S` (short runs: more rounds cost little and settle a small gain).

    Args:
        result: diagnose's result of the script as it is (its command, exit code).
        variants: `{name: (patches, sources)}`, as `run_patched` takes them; each
            variant's first run is in `log_dir/name`, later ones `name_2`, ...
        steps: the steps of each run (at most `MAX_STEPS`).
        log_dir: the folder of the runs' folders (`as_is`, `as_is_2`, ...).
        cwd: the folder diagnose ran in.
        more: None, or called after the first round with the names of the variants
            that ran; returns more variants to add from the second round (the fixes
            run together).
        rounds: the most rounds. Defaults to None: `MAX_ROUNDS`, more for short runs.

    Returns:
        `(runs, seconds)`: `runs` is `{name: {"paired": paired_gain's result or None,
        "failed": why its first run failed or None, "unfinished": why a run did not
        finish or None, "whole": the loops' wall ratio or None}}`, `seconds` what the
        runs took.
    """
    before = main_fit(result)
    count = min(steps or MAX_STEPS, MAX_STEPS)
    timeout = max(120.0, 3 * (before.get("wall_s") or 0.0) + 60.0)
    state = {name: {"patches": p, "sources": s, "pairs": [], "records": [], "paired": None,
                    "failed": None, "unfinished": None, "done": False}
             for name, (p, s) in variants.items()}
    seconds = 0.0

    def rerun(folder, patches, sources):
        nonlocal seconds
        after = run_patched(result.get("command") or [], patches, count,
                            os.path.join(log_dir, folder), cwd, timeout, sources)
        seconds += after.get("seconds") or 0.0
        return after

    for r in range(rounds or MOST_ROUNDS):
        active = [n for n, v in state.items() if not v["done"]]
        if not active or (rounds is None and r >= MAX_ROUNDS and seconds >= CHEAP_ROUNDS_S):
            break
        tail = "" if r == 0 else f"_{r + 1}"
        fixed = {}
        if r % 2:
            fixed = {n: rerun(n + tail, state[n]["patches"], state[n]["sources"])
                     for n in active}
        as_is = rerun("as_is" + tail, [], None)
        if not r % 2:
            fixed = {n: rerun(n + tail, state[n]["patches"], state[n]["sources"])
                     for n in active}
        if as_is.get("unfinished") or _failure(result, as_is):
            why = as_is.get("unfinished") or _failure(result, as_is)
            for n in active:  # no as-is run beside them this round: what ran stands
                state[n]["done"] = True
                if not state[n]["pairs"]:
                    state[n]["unfinished"] = f"the script as it is, run again beside it: {why}"
            break
        for n in active:
            v, after = state[n], fixed[n]
            why = after.get("unfinished") or _failure(result, after)
            if why:
                v["done"] = True
                if not v["pairs"]:
                    v["unfinished" if after.get("unfinished") else "failed"] = why
                continue
            v["pairs"].append((as_is, after))
            v["records"].append((RunRecord.from_diagnosis(as_is).data,
                                 RunRecord.from_diagnosis(after).data))
            v["paired"] = paired_gain(v["records"])
            v["done"] = v["paired"] is None or (settled(v["paired"]) and len(
                v["pairs"]) >= min(MIN_ROUNDS, rounds or MAX_ROUNDS))
        if r == 0 and more is not None:
            for name, (p, s) in more([n for n in active if state[n]["pairs"]]).items():
                state[name] = {"patches": p, "sources": s, "pairs": [], "records": [],
                               "paired": None, "failed": None, "unfinished": None,
                               "done": False}
    runs = {n: {"paired": v["paired"], "failed": v["failed"], "unfinished": v["unfinished"],
                "whole": _whole(v["pairs"])} for n, v in state.items()}
    return runs, seconds


def check_fixes(result, steps, log_dir, cwd=None, rounds=None):
    """Runs the script again for each fix diagnose can apply in memory, beside runs of
    the script as it is (`run_pairs`), and puts what the pairs measured in the fix's
    `predicted` (`speedup` and `steady_speedup`: the steady steps/s ratio,
    `speedup_range`, `known` (False: the range holds 1.0), `settle_steps`,
    `steps_per_s` as it is and fixed, `run_speedup`: the runs' loop walls over the
    same steps, `text`):

    - the eager step's patch (`source` `patched-run`); where the patched script
      failed, the fix keeps no `patch` and says why (`patched-run-failed`);
    - a periodic stall's (or stalls with no period's) loop-body line skipped
      (`skip_statement`; `source`
      `skipped-run`): what the stall costs, all of it removed; no patch (how often
      to run it is the user's choice); where the script fails without it, the
      cost-share prediction stands and says so.

    Where two or more ran, the script runs with all of them too, from the second
    round (`result["together"]`: `speedup`, `speedup_range`, `known`,
    `steps_per_s`, `text`): the causes interact (a plot's pause slows the eager
    steps after it), so their gains measured apart do not add up.

    `rounds`: the most rounds (`run_pairs`). Returns the seconds the runs took (0
    where nothing ran)."""
    if main_fit(result) is None or (result.get("ended_by") or {}).get("kind") == "signal":
        return 0.0  # nothing judged, or the user stopped it
    stall = next((f["step"]["stall_where"] for f in result.get("fits") or ()
                  if (f.get("step") or {}).get("stall_where")), None)
    skipped = skip_statement(stall) if stall else None
    variants, fixes = {}, {}
    stalls = [f for f in result.get("fixes") or ()
              if f.get("verdict") in ("periodic_stall", "irregular_stall")]
    # the skipped line measures the stall fix that names it (else the first ranked)
    named = [f for f in stalls if any(":".join(where_place(w)) == stall for w in f.get("where") or ())]
    for fix in result.get("fixes") or ():
        if fix.get("verdict") == "eager_step" and fix.get("patch"):
            variants["patched_run"] = ([fix["patch"]], None)
            fixes["patched_run"] = fix
    if skipped and stalls:
        variants["skipped_run"] = ([], skipped)
        fixes["skipped_run"] = (named or stalls)[0]
    if not variants:
        return 0.0

    together_of = []

    def together(ran):
        if len(ran) < 2:
            return {}
        together_of[:] = ran
        sources = {}
        for name in ran:
            sources.update(variants[name][1] or {})
        return {"together_run": ([p for n in ran for p in variants[n][0]], sources)}

    runs, seconds = run_pairs(result, variants, steps, log_dir, cwd, together, rounds)
    for name, fix in fixes.items():
        run, predicted = runs[name], fix["predicted"]
        if run["unfinished"]:  # the prediction it had stands, and says so
            predicted["text"] += f"; the run to check it did not finish ({run['unfinished']})"
        elif run["failed"] and variants[name][0]:
            fix["patch"] = None
            fix["refused"] = "the script with the patch failed: " + (
                run["failed"].strip().splitlines() or ["?"])[0]
            fix["predicted"] = {**predicted, "speedup": None, "speedup_range": None,
                                "steady_speedup": None, "source": "patched-run-failed",
                                "text": PATCHED_RUN_FAILED.format(error=run["failed"])}
        elif run["failed"]:
            predicted["text"] += f"; {SKIPPED_RUN_FAILED.format(where=stall, error=run['failed'])}"
        elif run["paired"] is not None:
            paired = run["paired"]
            fix["predicted"] = {
                **predicted, "speedup": paired["gain"], "steady_speedup": paired["gain"],
                "speedup_range": paired["gain_range"], "known": paired["known"],
                "settle_steps": paired["settle_steps"], "whole_run": True,
                "source": "patched-run" if variants[name][0] else "skipped-run",
                "steps_per_s": paired["steps_per_s"], "run_speedup": run["whole"],
                "text": patched_run_text(paired, run["whole"],
                                         skipped=None if variants[name][0] else stall)}
    paired = (runs.get("together_run") or {}).get("paired")
    if paired is not None:
        result["together"] = {"speedup": paired["gain"], "speedup_range": paired["gain_range"],
                              "known": paired["known"], "steps_per_s": paired["steps_per_s"],
                              "fixes": len(together_of),
                              "text": together_run_text(len(together_of), paired)}
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
