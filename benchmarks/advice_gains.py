"""diagnose's predicted gain per fix against the gain measured with the fix applied.

    python benchmarks/advice_gains.py [--patterns ...] [--rounds R] [--out PATH]
    (5-8 min on 2 cores at load 4-6)

For each pattern (a synthetic training script in `tests/loop_patterns.py`):
1. `keras-gpufix diagnose --json --no-trace --steps N -- python tests/loop_patterns.py
   MODE ...` gives the verdict and the fixes, each with its `predicted` gain
   (`speedup`, `speedup_range`, `share`, `source`);
2. the truth: the same script run with each named fix applied by hand (a flag or a
   twin mode of the script), every way in one process in turn, rounds interleaved
   (`loop_patterns.py truth`), each way timed by the script itself (its loop or fit,
   `LOOP_S` / `FIT_S`) or its wall time; the measured speedup is the median over the
   rounds of as is / fixed in the same round (its range: the rounds' extremes);
3. per fix: predicted vs measured speedup (as is / fixed), their ratio and whether
   it is within 25% (the figure `FIGURE` names: the whole run's, a cache's whole run,
   or per step where the truth leaves out a one-off cost); and all the fixes'
   combined prediction (`analysis.combined_speedup`: the time each saves adds up, as
   diagnose's report says) against the script with all of them applied, where a
   pattern has several.

Patterns (the fixes applied as diagnose words them):
- `accum_plot`: an eager GradientTape accumulation step, a plot (a sleep) every 5 steps:
  `eager_step` -> the step in tf.function, `periodic_stall` -> no plot; both.
- `contention`: `fit` with a heavy TF map beside a heavy step: `input_bound` -> the
  batches computed before the fit (`--cached`).
- `blocked`: an eager step tf.function cannot run as written: `eager_step` -> the step
  changed as the blockers say, in tf.function (`blocked_fixed`; wall time of the run,
  the trace included).
- `slow_map_1ep` / `slow_map_3ep`: `fit` over a slow `tf.py_function` map, 1 and 3
  epochs: `input_bound` -> `.cache()` after the map (pays from epoch 2), or the read in
  TF ops.
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
    "accum_plot": (40, ["accum_plot", "--steps", "60"],
                   ["truth", "accum_way", "accum_way --compiled", "accum_way --no-plot",
                    "accum_way --compiled --no-plot", "--steps", "30"],
                   "accum_way", {"eager_step": {"tf.function": "accum_way --compiled"},
                                 "periodic_stall": {"no plot": "accum_way --no-plot"}},
                   "accum_way --compiled --no-plot"),
    "contention": (60, ["contention", "--steps", "80"],
                   ["truth", "contention", "contention --cached", "--steps", "60"],
                   "contention", {"input_bound": {"batches before the fit":
                                                  "contention --cached"}}, None),
    "blocked": (14, ["blocked", "--steps", "40"],
                ["truth", "blocked", "blocked_fixed", "--steps", "16"],
                "blocked", {"eager_step": {"changed as said, tf.function": "blocked_fixed"}},
                None),
    "slow_map_1ep": (500, ["slow_map"], ["truth", "slow_map", "slow_map --cache",
                                         "slow_map --tf-ops"],
                     "slow_map", {"input_bound": {".cache() after the map": "slow_map --cache",
                                                  "the read in TF ops": "slow_map --tf-ops"}},
                     None),
    "slow_map_3ep": (500, ["slow_map", "--epochs", "3"],
                     ["truth", "slow_map --epochs 3", "slow_map --epochs 3 --cache",
                      "slow_map --epochs 3 --tf-ops"],
                     "slow_map --epochs 3",
                     {"input_bound": {".cache() after the map": "slow_map --epochs 3 --cache",
                                      "the read in TF ops": "slow_map --epochs 3 --tf-ops"}},
                     None),
    "host_work": (500, ["host_work", "--steps", "60"],
                  ["truth", "host_work", "host_work --no-host", "--steps", "100"],
                  "host_work", {"periodic_stall": {"no host work": "host_work --no-host"}},
                  None),
}

# which predicted figure each way is compared with: the batches computed before the fit
# (untimed, as a cache on disk serves a later run) with `speedup_later_runs` (the whole
# run from its first step, its start-up kept); a `.cache()` after a
# Python map with `speedup_if_cached` (the whole run, the cache filled in epoch 1); the
# others (the read in TF ops: the fit's trace and start-up kept) with `speedup`, the
# whole run as the script runs it
FIGURE = {"contention --cached": "speedup_later_runs", "slow_map --cache": "speedup_if_cached",
          "slow_map --epochs 3 --cache": "speedup_if_cached"}


#: patterns whose truth runs each way in a process of its own (`truth --own-process`),
#: as a user runs the script: in one process the contention's as-is way ran 42.7 ms a
#: step (3.14x against the batches before the fit) where diagnose's run and separate
#: processes ran 24-31 ms (1.66x, 2.03x): the earlier ways' tf.data threads were still
#: running beside it
OWN_PROCESS = {"contention"}


def truth(command, rounds, own_process=False):
    """{way: [seconds per round]} of `loop_patterns.py truth WAY ...`."""
    out = run_stdout([sys.executable, SCRIPT, *command, "--rounds", str(rounds)]
                     + (["--own-process"] if own_process else []))
    return json.loads(re.search(r"^TRUTH (.*)$", out, re.M).group(1))


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
                        help="rounds of the truth runs, each way once a round (default 3)")
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
    for name in args.patterns:
        steps, script, truth_command, as_is, applied, all_fixed = PATTERNS[name]
        load = os.getloadavg()
        report = json.loads(run_stdout([
            sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
            "--steps", str(steps), "--", sys.executable, SCRIPT, *script]).splitlines()[-1])
        runs = truth(truth_command, args.rounds, name in OWN_PROCESS)
        fixes = {f["verdict"]: f for f in report["fixes"]}
        pattern = {"verdict": report["verdict"], "load_average_before": load, "seconds": runs,
                   "fixes": []}
        for verdict in list(fixes) + [v for v in applied if v not in fixes]:
            fix = fixes.get(verdict) or {}
            predicted = fix.get("predicted") or {}
            for how, way in (applied.get(verdict) or {"(not applied)": None}).items():
                measured = speedup(runs[as_is], runs[way]) if way else (None,)
                label = verdict + ("" if fix else " (not named)")
                key = f"{name}_{verdict}_{re.sub(r'[^a-z]+', '_', how.lower()).strip('_')}"
                ratio = _row(figures, key, f"{name:13} {report['verdict']:15} {label:28} "
                             f"{how:24}", predicted, measured, FIGURE.get(way, "speedup"))
                pattern["fixes"].append({"verdict": verdict, "fix": fix.get("fix"),
                                         "predicted": predicted, "applied_as": how,
                                         "way": way, "measured_speedup": measured,
                                         "ratio": ratio})
        gains = [f["predicted"]["speedup"] for f in report["fixes"]
                 if f["predicted"].get("speedup")]
        if all_fixed and len(gains) > 1:  # the causes never overlap: the time each saves adds
            together = {"speedup": analysis.combined_speedup(gains)}  # up, as the report says
            measured = speedup(runs[as_is], runs[all_fixed])
            ratio = _row(figures, f"{name}_all", f"{name:13} {report['verdict']:15} "
                         f"{'all fixes together':28} {'all applied':24}", together, measured)
            pattern["together"] = {"predicted": together["speedup"], "measured": measured,
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
