"""diagnose's predicted gain per fix against the gain measured with the fix applied.

    python benchmarks/advice_gains.py [--patterns ...] [--rounds R] [--out PATH]
    (about 16 min on 2 cores at load 1 before the xtts pattern; xtts alone: 9 min at load 8)

For each pattern (a synthetic training script in `tests/loop_patterns.py`), R rounds
(default 3), each round:
1. `keras-gpufix diagnose --json --no-trace --steps N -- python tests/loop_patterns.py
   MODE ...` gives the verdict and the fixes, each with its `predicted` gain;
2. then the truth: the same script run with each named fix applied: by diagnose's own
   patch where it wrote one (the eager step's `step.patch`, the input's `input.patch`,
   as its first round that wrote it left it in its log dir, applied with `patch -p1` to
   a copy of the script: `PATCHED` ways, the table's `step.patch` / `input.patch`), the
   others by hand where it wrote none (a flag or a twin mode of the script: the table's
   `by hand: ...`), every way in turn, each in a fresh process
   (`loop_patterns.py truth --own-process`, the order reversed every other round;
   `blocked` in one process: `OWN_PROCESS`), each way timed by the script itself
   (its loop or fit, `LOOP_S` / `FIT_S`) or its wall time.
A diagnose run and a truth round side by side see the same load: on this 2-core VM one
fix's prediction and its truth each moved 20-40% from one run to the next, both with the
load, so the rounds are interleaved rather than all of diagnose before all of the truth.
Per fix: the predicted speedup (the median over the rounds that named it; its range the
rounds' extremes) against the measured one (the median over the rounds of as is / fixed
in the same round), their ratio and whether it is within 25% (the figure `FIGURE` names:
the whole run's, a cache's whole run, or a later run's with the cache on disk); and all
the fixes' combined prediction (diagnose's rerun with all of them, `together`, where it
ran them so; else `analysis.combined_speedup`: the time each saves adds up, as diagnose's
report says) against the script with all of them applied, where a pattern has several.
diagnose's eager-step and periodic-stall gains are themselves measured by reruns of the
script (the patch applied, the stall's line skipped: `keras_gpufix/diagnose/patched_run.py`);
the truth here is the script run as the user runs it, each way in a fresh process.

Patterns (the fixes applied as diagnose words them):
- `accum_plot`: an eager GradientTape accumulation step, a plot (a sleep) every 5 steps:
  `eager_step` -> diagnose's patch (the step in tf.function), `periodic_stall` -> no
  plot; both.
- `contention`: `fit` with a heavy TF map (after a `.repeat()`) beside a heavy step:
  `input_bound` -> diagnose's input.patch (`.cache().repeat()` after the map: it
  serves from the second pass over the data).
- `blocked`: an eager step tf.function cannot run as written: `eager_step` -> diagnose's
  patch (its four lines changed, the step in tf.function; wall time of the run, the
  trace included).
- `xtts`: an XTTS-like trainer's eager step that only tracing unblocks (a tensor-count
  accumulation loop, a None accumulator, `max()` of a tensor in it, reads, Python state,
  a `tf.print` in the loss) and a plot every 5 steps: `eager_step` -> diagnose's patch,
  `periodic_stall` -> no plot; both.
- `slow_map_1ep` / `slow_map_3ep`: `fit` over a slow `tf.py_function` map, 1 and 3
  epochs: `input_bound` -> diagnose's input.patch (`.cache()` after the map: pays from
  epoch 2), or by hand the read in TF ops (`--tf-ops`).
- `host_work`: a tf.function step and NumPy host work every 4 steps: `periodic_stall`
  -> no host work.
"""

import argparse
import json
import os
import re
import statistics
import sys

from _results import add_out_argument, run_stdout, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "tests/loop_patterns.py"

# name -> diagnose's --steps, the script's arguments, the truth's command (after the
# script), the way timed as is, {verdict: {what the fix is: the way with it applied}},
# the way with every fix applied
PATTERNS = {
    "accum_plot": (60, ["accum_plot", "--steps", "80"],
                   ["truth", "accum_way", "step.patch:accum_way", "accum_way --no-plot",
                    "step.patch:accum_way --no-plot", "--steps", "60"],
                   "accum_way", {"eager_step": {"step.patch": "step.patch:accum_way"},
                                 "periodic_stall": {"by hand: no plot": "accum_way --no-plot"}},
                   "step.patch:accum_way --no-plot"),
    "contention": (60, ["contention", "--steps", "80"],
                   ["truth", "contention", "input.patch:contention", "--steps", "80"],
                   "contention", {"input_bound": {"input.patch": "input.patch:contention"}},
                   None),
    "blocked": (14, ["blocked", "--steps", "40"],
                ["truth", "blocked", "step.patch:blocked", "--steps", "16"],
                "blocked", {"eager_step": {"step.patch": "step.patch:blocked"}}, None),
    "xtts": (40, ["xtts", "--steps", "60"],
             ["truth", "xtts", "step.patch:xtts", "xtts --no-plot", "step.patch:xtts --no-plot",
              "--steps", "40"],
             "xtts", {"eager_step": {"step.patch": "step.patch:xtts"},
                      "periodic_stall": {"by hand: no plot": "xtts --no-plot"}},
             "step.patch:xtts --no-plot"),
    "slow_map_1ep": (500, ["slow_map"], ["truth", "slow_map", "input.patch:slow_map",
                                         "slow_map --tf-ops"],
                     "slow_map", {"input_bound": {"input.patch": "input.patch:slow_map",
                                                  "by hand: read in TF ops": "slow_map --tf-ops"}},
                     None),
    "slow_map_3ep": (500, ["slow_map", "--epochs", "3"],
                     ["truth", "slow_map --epochs 3", "input.patch:slow_map --epochs 3",
                      "slow_map --epochs 3 --tf-ops"],
                     "slow_map --epochs 3",
                     {"input_bound": {"input.patch": "input.patch:slow_map --epochs 3",
                                      "by hand: read in TF ops": "slow_map --epochs 3 --tf-ops"}},
                     None),
    "host_work": (500, ["host_work", "--steps", "60"],
                  ["truth", "host_work", "host_work --no-host", "--steps", "100"],
                  "host_work", {"periodic_stall": {"by hand: no host work": "host_work --no-host"}},
                  None),
}

# which predicted figure each way is compared with: diagnose's `.cache()` after a
# Python map (its input.patch) with `speedup_if_cached` (the whole run, the cache filled
# in epoch 1: the prediction's `speedup` is the read in TF ops'); the others (the read in
# TF ops, the fit's trace and start-up kept; contention's input.patch, a cache of a map
# that is no Python work, whose `speedup` is the cache's) with `speedup`, the whole run
# as the script runs it
FIGURE = {"input.patch:slow_map": "speedup_if_cached",
          "input.patch:slow_map --epochs 3": "speedup_if_cached",
          # blocked is timed by its wall, its trace and compile in it: the whole run's
          # figure with the first call's one-off cost (the others time steps after the 5th)
          "step.patch:blocked": "run_speedup"}


#: patterns whose truth runs each way in a process of its own (`truth --own-process`),
#: as a user runs the script and as diagnose ran it: a fresh process. In one process the
#: ways that ran later ran faster: the contention's as-is way ran 42.7 ms a step (3.14x
#: against the batches before the fit) where diagnose's run and separate processes ran
#: 24-31 ms (1.66x, 2.03x), the earlier ways' tf.data threads still running beside it;
#: accum_plot's eager step took 19.8, 19.4, 17.5 and 15.1 ms in four 60-step loops in
#: turn, so the plot removed (never the first way) read 2.53x-3.61x against diagnose's
#: 2.12x-2.70x. `blocked` is timed by its wall, so it stays in one process (a process's
#: start-up would be half of it).
OWN_PROCESS = {"accum_plot", "contention", "slow_map_1ep", "slow_map_3ep", "host_work", "xtts"}


#: A way run on the script as one of diagnose's patches changed it (`patched_script`):
#: `step.patch:WAY` (the eager step compiled), `input.patch:WAY` (the input's edit at
#: its named line).
PATCHED = re.compile(r"^(\w+\.patch):")


def patched_script(report, name, folder):
    """(the script with the patch `name` (`step.patch`, `input.patch`) diagnose wrote
    (a fix's `patch`, or `compiled_step`'s) applied by `patch -p1`, as a user applies
    it, to a copy under `folder`; the patch's text), or (None, None) where diagnose
    wrote none."""
    import shutil
    import subprocess

    written = [f.get("patch") for f in report.get("fixes") or ()] + [
        (f.get("compiled_step") or {}).get("patch") for f in report.get("fits") or ()]
    patch = next((p for p in written if p and os.path.basename(p) == name), None)
    if patch is None:
        return None, None
    folder = os.path.join(folder, name)
    copy = os.path.join(folder, SCRIPT)
    os.makedirs(os.path.dirname(copy), exist_ok=True)
    shutil.copy(os.path.join(ROOT, SCRIPT), copy)
    subprocess.run(["patch", "-p1", "-i", patch], cwd=folder, check=True, capture_output=True)
    with open(patch, encoding="utf-8") as f:
        return copy, f.read()


def truth(command, reverse=False, own_process=False, patched=None):
    """{way: [seconds]} of one round of `loop_patterns.py truth WAY ...`, the ways in
    the order given or reversed; the `PATCHED` ways by their patched script's own truth
    (`patched`: {patch name: script}; a patch not written: those ways not run), after
    the others (before them, reversed)."""
    ways = [a for i, a in enumerate(command[1:], 1)
            if not a.startswith("--") and command[i - 1] != "--steps"]
    flags = [a for a in command[1:] if a not in ways]
    out = {}
    runs = [(SCRIPT, [w for w in ways if not PATCHED.match(w)], "")]
    for name, script in sorted((patched or {}).items()):
        prefix = f"{name}:"
        runs.append((script, [w[len(prefix):] for w in ways if w.startswith(prefix)], prefix))
    for script, mine, prefix in runs[::-1] if reverse else runs:
        if not mine:
            continue
        text = run_stdout([sys.executable, script, "truth", *(mine[::-1] if reverse else mine),
                           *flags, "--rounds", "1"] + (["--own-process"] if own_process else []))
        seconds = json.loads(re.search(r"^TRUTH (.*)$", text, re.M).group(1))
        out.update({prefix + way: value for way, value in seconds.items()})
    return out


def _median_predicted(predictions, which):
    """One fix's predictions over the rounds (an empty dict where a round did not name
    it) as one: the median of `which` (and of `speedup`) over the rounds that named it,
    its range the rounds' extremes."""
    out = {}
    for key in dict.fromkeys((which, "speedup")):
        values = sorted(p[key] for p in predictions if p.get(key))
        if values:
            out[key] = statistics.median(values)
            if key == which:
                out["speedup_range"] = (values[0], values[-1])
    return out


def speedup(as_is, fixed):
    """(median, lowest, highest) over the rounds of as is / fixed, each round's pair run
    side by side (the same load)."""
    ratios = sorted(a / f for a, f in zip(as_is, fixed))
    return statistics.median(ratios), ratios[0], ratios[-1]


def _x(value, low=None, high=None):
    return (f"{value:.2f}x" if value else "-") + (f" ({low:.2f}-{high:.2f})" if low and high
                                                  else "")


#: what each compared figure is, as the table's last column says
_FOR = {"steady_speedup": "per step", "speedup_if_cached": "run, cached",
        "speedup_later_runs": "a later run, cache on disk"}


def _row(figures, key, cells, predicted, measured, which="speedup"):
    """Prints one line of the table and keeps its figures; returns the ratio."""
    which = which if predicted.get(which) else "speedup"
    gain = predicted.get(which)
    ratio = gain / measured[0] if gain and measured[0] else None
    within = None if ratio is None else abs(ratio - 1) <= 0.25
    print(f"{cells} {_x(gain, *(predicted.get('speedup_range') or ())):>20} "
          f"{_x(*measured):>20} {f'{ratio:.2f}' if ratio else '-':>9}  "
          f"{'-' if within is None else 'yes' if within else 'no':3}  "
          f"{_FOR.get(which, 'run') if gain else ''}",
          flush=True)
    figures[f"{key}_predicted_{which}"] = gain and round(gain, 3)
    figures[f"{key}_measured_speedup_as_is_over_fixed"] = measured[0] and round(measured[0], 3)
    figures[f"{key}_ratio_predicted_over_measured"] = ratio and round(ratio, 3)
    figures[f"{key}_within_25_percent"] = within
    return ratio


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS),
                        default=list(PATTERNS), help="the patterns to run (default: all)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each a diagnose run and then each way once (default 3)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    sys.path.insert(0, ROOT)
    from keras_gpufix import analysis

    add_out_argument(parser, "advice_gains")
    args = parser.parse_args(argv)
    figures, details = {}, {}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} "
          "cores", flush=True)
    print(f"{'pattern':13} {'verdict':15} {'fix':28} {'applied as':24} {'predicted':>20} "
          f"{'measured':>20} {'pred/meas':>9}  within 25%, predicted for", flush=True)
    import tempfile

    work = tempfile.mkdtemp(prefix="advice_gains_")
    for name in args.patterns:
        steps, script, truth_command, as_is, applied, all_fixed = PATTERNS[name]
        load = os.getloadavg()
        reports, runs, patched, diffs = [], {}, {}, {}
        wanted = {PATCHED.match(w).group(1) for w in truth_command if PATCHED.match(w)}
        for r in range(args.rounds):  # diagnose and one truth round in turn: the same load
            reports.append(json.loads(run_stdout([
                sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
                "--steps", str(steps), "--", sys.executable, SCRIPT, *script]).splitlines()[-1]))
            for patch in wanted - set(patched):  # diagnose's own, as it first wrote it
                copy, diff = patched_script(reports[-1], patch, os.path.join(work, name))
                if copy is not None:
                    patched[patch], diffs[patch] = copy, diff
            for way, seconds in truth(truth_command, r % 2, name in OWN_PROCESS,
                                      patched).items():
                runs.setdefault(way, []).extend(seconds)
        verdicts = [report["verdict"] for report in reports]
        verdict = statistics.mode(verdicts)
        rounds = [{f["verdict"]: f for f in report["fixes"]} for report in reports]
        pattern = {"verdicts": verdicts, "load_average_before": load, "seconds": runs,
                   "fixes": [], "patches": diffs}
        named = list(dict.fromkeys(v for fixes in rounds for v in fixes))
        for fix_verdict in named + [v for v in applied if v not in named]:
            fix = next((fixes[fix_verdict] for fixes in rounds if fix_verdict in fixes), {})
            for how, way in (applied.get(fix_verdict) or {"(not applied)": None}).items():
                which = FIGURE.get(way, "speedup")
                predicted = _median_predicted(
                    [fixes.get(fix_verdict, {}).get("predicted") or {} for fixes in rounds],
                    which)
                measured = speedup(runs[as_is], runs[way]) if way in runs else (None,)
                named_in = sum(fix_verdict in fixes for fixes in rounds)
                label = fix_verdict + ("" if named_in == len(rounds) else
                                       f" ({named_in}/{len(rounds)} named)")
                key = f"{name}_{fix_verdict}_{re.sub(r'[^a-z]+', '_', how.lower()).strip('_')}"
                ratio = _row(figures, key, f"{name:13} {verdict:15} {label:28} "
                             f"{how:24}", predicted, measured, which)
                pattern["fixes"].append({"verdict": fix_verdict, "fix": fix.get("fix"),
                                         "predicted": predicted, "applied_as": how,
                                         "way": way, "measured_speedup": measured,
                                         "ratio": ratio})
        together = []  # as the report says: the fixes run together where diagnose ran
        for report, fixes in zip(reports, rounds):  # them so, else the time each saves
            gains = [f["predicted"]["speedup"] for f in fixes.values()  # added up
                     if (f.get("predicted") or {}).get("speedup")]
            if (report.get("together") or {}).get("speedup"):
                together.append(report["together"]["speedup"])
            elif len(gains) > 1:
                together.append(analysis.combined_speedup(gains))
        if all_fixed and together:
            predicted = {"speedup": statistics.median(together),
                         "speedup_range": (min(together), max(together))}
            measured = speedup(runs[as_is], runs[all_fixed]) if all_fixed in runs else (None,)
            ratio = _row(figures, f"{name}_all", f"{name:13} {verdict:15} "
                         f"{'all fixes together':28} {'all applied':24}", predicted, measured)
            pattern["together"] = {"predicted": together, "measured": measured,
                                   "ratio": ratio}
        details[name] = pattern
    rows = [v for k, v in figures.items() if k.endswith("_within_25_percent") and v is not None]
    figures["fixes_predicted"] = len(rows)
    figures["fixes_within_25_percent"] = sum(rows)
    print(f"{sum(rows)} of {len(rows)} predicted gains within 25% of the measured one; load "
          f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    details["rounds"] = args.rounds
    write_results(args.out, "advice_gains", figures, details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
