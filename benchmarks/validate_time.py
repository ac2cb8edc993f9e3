"""`keras-gpufix validate` wall time on the example configs, before and after
it stopped importing TensorFlow and Keras (issue 41).

    python benchmarks/validate_time.py [--before REV] [--rounds 5] [--out PATH]

Each example config (`examples/*.yaml`) is validated as a user runs it, a
fresh `python -m keras_gpufix validate CONFIG` process each time (this
venv's Python, `TF_CPP_MIN_LOG_LEVEL` unset as a user's is), `--rounds`
times by this working tree ("after") and by the tree of `--before`
("before"; default `31fee2f^`, the tree before issue 41's validate changes),
unpacked with `git archive` into a temp folder and run from there. The
rounds interleave (before, after, before, ...) so that load from other work
hits both alike. One more run of each (not timed) says whether TensorFlow
and Keras were imported. Prints, per config, the median wall seconds of
each side, before / after, the median CPU seconds (user + system) of each
side (what load from other work changes least), and the exit codes (0 on
both: the same verdict).

Figures go to `--out` (default `benchmarks/results/validate_time.json`):
`<config>_before_s`, `<config>_after_s` (median wall),
`<config>_before_over_after`, `<config>_before_cpu_s`, `<config>_after_cpu_s`.
"""

import argparse
import glob
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from _results import add_out_argument, write_results  # beside this file

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH")}


def _validate(tree, config):
    """(exit code, wall seconds, CPU seconds) of `keras-gpufix validate config`
    run from `tree`."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "keras_gpufix", "validate", config], cwd=tree,
                         env=_env(), capture_output=True, text=True, timeout=600)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return run.returncode, wall, cpu


def _imported(tree, config):
    """Which of TensorFlow and Keras the validate command imports (`cli.main`,
    as the console script calls it, then a look at `sys.modules`)."""
    code = ("import sys; from keras_gpufix.cli import main; main(['validate', sys.argv[1]]); "
            "print('imported:', *[m for m in ('tensorflow', 'keras') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code, config], cwd=tree, env=_env(),
                         capture_output=True, text=True, timeout=600)
    return [line.split()[1:] for line in run.stdout.splitlines()
            if line.startswith("imported:")][-1]


def _old_tree(rev, folder):
    """`rev`'s files unpacked into `folder` (no worktree: the repository is untouched)."""
    archive = subprocess.run(["git", "archive", rev], cwd=_ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="31fee2f^", metavar="REV",
                        help="the tree to compare with (default 31fee2f^: before issue 41)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each side (default 5)")
    add_out_argument(parser, "validate_time")
    args = parser.parse_args(argv)
    configs = sorted(glob.glob(os.path.join(_ROOT, "examples", "*.yaml")))
    figures, details = {}, {"before": args.before, "rounds": args.rounds, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="kg-validate-before-") as folder:
        trees = {"before": _old_tree(args.before, folder), "after": _ROOT}
        print(f"{'config':<12} {'before s':>9} {'after s':>8} {'before/after':>13}  "
              f"{'CPU s before':>12} {'after':>6}  imported (before | after)  exit codes", flush=True)
        for config in configs:
            name = os.path.splitext(os.path.basename(config))[0]
            walls, cpus = {"before": [], "after": []}, {"before": [], "after": []}
            codes = {"before": set(), "after": set()}
            for _ in range(args.rounds):
                for side, tree in trees.items():
                    code, wall, cpu = _validate(tree, config)
                    walls[side].append(round(wall, 3))
                    cpus[side].append(round(cpu, 3))
                    codes[side].add(code)
            imported = {side: _imported(tree, config) for side, tree in trees.items()}
            before, after = (statistics.median(walls[s]) for s in ("before", "after"))
            cpu_before, cpu_after = (statistics.median(cpus[s]) for s in ("before", "after"))
            figures.update({f"{name}_before_s": round(before, 3),
                            f"{name}_after_s": round(after, 3),
                            f"{name}_before_over_after": round(before / after, 2),
                            f"{name}_before_cpu_s": round(cpu_before, 3),
                            f"{name}_after_cpu_s": round(cpu_after, 3)})
            details["configs"][name] = {"walls_s": walls, "cpu_s": cpus, "imported": imported,
                                        "exit_codes": {s: sorted(c) for s, c in codes.items()}}
            print(f"{name:<12} {before:>9.2f} {after:>8.2f} {before / after:>12.1f}x  "
                  f"{cpu_before:>12.2f} {cpu_after:>6.2f}  "
                  f"{','.join(imported['before']) or 'none'} | "
                  f"{','.join(imported['after']) or 'none'}  "
                  f"{sorted(codes['before'])} {sorted(codes['after'])}", flush=True)
    write_results(args.out, "validate_time", figures, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
