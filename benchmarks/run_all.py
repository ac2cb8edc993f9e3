"""Re-measures every figure that docs/benchmarks.md quotes.

    python benchmarks/run_all.py            # quick settings (a few minutes on 2 cores)
    python benchmarks/run_all.py --full     # the sizes docs/benchmarks.md quotes as "full"
    python benchmarks/run_all.py end_to_end compile_speed   # some of them
    python benchmarks/run_all.py --summary  # only rewrite SUMMARY.md from the files

Runs each benchmark listed in `BENCHMARKS` as its own process with
`--out benchmarks/results/<name>.json` (its `--quick` setting unless
`--full`), one after the other, then writes `benchmarks/results/SUMMARY.md`:
one table of every figure with the command that produced it and the
machine. A benchmark that fails is reported and the others still run; the
exit code is then 1.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from _results import RESULTS

__all__ = ["BENCHMARKS", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (arguments for the quick run, arguments for the full run); each
# script accepts --out (benchmarks/_results.py).
BENCHMARKS = {
    "end_to_end": (["--quick"], []),
    "compile_speed": (["--quick"], []),
    "slow_loader": ([], []),
    "padding": ([], []),
    "corpus_scale": ([], ["--full"]),
    "no_cache_loader": ([], []),
    "batch_frames": ([], []),
    "data_throughput": (["--quick"], []),
    "spectrogram_magnitude": (["--clips", "50"], []),
    "map_parallelism": (["--rounds", "4"], []),
    "what_if": (["--quick"], []),
    "monitor_overhead": (["--quick"], ["--steps", "1000", "--rounds", "9"]),
    "async_sync": (["--rounds", "3", "--lengths", "2000"], ["--full"]),
    "step_shapes_overhead": (["--quick"], []),
    "first_step": (["--quick"], []),
    "demo_promise": (["--utterances", "48", "--burners", "0"], []),
    "validate_time": (["--rounds", "3"], []),
    "diagnose_cost": (["--quick"], []),
    "straggler": (["--repeats", "1"], []),
}


def _summary(names):
    lines = ["# Benchmark figures", "",
             "Written by `python benchmarks/run_all.py` from the JSON file each benchmark wrote "
             "in this folder. Other work on the machine changes absolute figures (the load "
             "average is recorded); ratios come from one run."]
    for name in names:
        path = os.path.join(RESULTS, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            result = json.load(f)
        lines += ["", f"## {name}", "",
                  f"`{result['command']}` on {result['machine']}, load average "
                  f"{result.get('load_average', ['?'])[0]}, {result['date_utc']} UTC", "",
                  "| figure | value |", "|---|---|"]
        lines += [f"| `{key}` | {value} |" for key, value in result["figures"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--full", action="store_true", help="full sizes instead of --quick")
    parser.add_argument("--summary", action="store_true",
                        help="run nothing: rewrite SUMMARY.md from the figures files")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    names = [] if args.summary else args.names or list(BENCHMARKS)
    failed = []
    for name in names:
        quick, full = BENCHMARKS[name]
        root = os.path.dirname(HERE)
        out = os.path.relpath(os.path.join(RESULTS, f"{name}.json"), root)
        command = [sys.executable, os.path.relpath(os.path.join(HERE, f"{name}.py"), root),
                   *(full if args.full else quick), "--out", out]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(command, cwd=root)
        print(f"== {name}: exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    summary = os.path.join(RESULTS, "SUMMARY.md")
    with open(summary, "w") as f:
        f.write(_summary(list(BENCHMARKS)))
    print(f"summary written to {summary}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
