"""The second run is fast: README's `keras-gpufix demo` and `examples/train_tts.py`, each run twice.

    python benchmarks/first_step.py [--utterances 96] [--epochs 3] [--quick] [--out PATH]

1. README's main command, `keras-gpufix demo`, run twice as a user runs it:
   no `--dir`, so both runs work in the per-user folder
   (`$XDG_CACHE_HOME/keras_gpufix/demo`; `XDG_CACHE_HOME` points at a new
   temp folder, so the benchmark starts from nothing and leaves the real
   user cache alone), each a fresh process (`--json` for the figures). The
   first run generates the corpus, builds the feature cache and compiles
   every bucket shape; the second opens both caches. Per run and way: the
   first epoch and its compiling seconds (`RetracingMonitor`'s priced
   compiles), the shapes loaded from the compile cache and compiled afresh,
   the steady utterances/s and the whole process's wall time. The goal:
   the second run's keras_gpufix first epoch within 1.5x of naive's first
   epoch of the same run (`first_epoch_ratio_fast_over_naive_second`).
2. `examples/train_tts.py` run, then resumed from its checkpoint with one
   more epoch (`--epochs 1`, then `--epochs 2`), then once more with the
   compile cache cleared first (`--epochs 3`, `resumed_cold`: what a resume
   cost before): the compiles each run added to the compile cache (the
   resumed run: 0 when every compile loaded from it) and its wall time.

Figures go to `--out` (default `benchmarks/results/first_step.json`).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _results import add_out_argument, write_results  # beside this file

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = (("naive", "naive"), ("keras_gpufix", "fast"))


def _run(args, env):
    """(the command's last stdout line as JSON, its wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=_ROOT, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=96, help="the demo's (README: 96)")
    parser.add_argument("--epochs", type=int, default=3, help="the demo's (README: 3)")
    parser.add_argument("--tts-utterances", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="demo 48 utterances, 2 epochs")
    add_out_argument(parser, "first_step")
    args = parser.parse_args(argv)
    if args.quick:
        args.utterances, args.epochs = 48, 2
    home = tempfile.mkdtemp(prefix="first_step_")
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env.update(PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="3", XDG_CACHE_HOME=home)

    figures, details = {}, {"utterances": args.utterances, "epochs": args.epochs,
                            "tts_utterances": args.tts_utterances, "runs": {}}
    for run in ("first", "second"):
        r, wall = _run(["-m", "keras_gpufix", "demo", "--json", "--utterances",
                        str(args.utterances), "--epochs", str(args.epochs)], env)
        shapes = r["keras_gpufix"]["retracing"].get("new_shapes") or 0
        fresh = min(r["compile_cache"]["written"], shapes)
        for way, short in WAYS:
            side = r[way]
            figures[f"first_epoch_s_{short}_{run}"] = round(side["epoch_seconds"][0], 3)
            figures[f"first_epoch_compile_s_{short}_{run}"] = round(
                side["first_epoch_compile_s"], 3)
            figures[f"steady_utterances_per_s_{short}_{run}"] = round(
                side["steady_samples_per_s"], 1)
        figures[f"first_epoch_ratio_fast_over_naive_{run}"] = round(
            r["keras_gpufix"]["epoch_seconds"][0] / r["naive"]["epoch_seconds"][0], 2)
        figures[f"shapes_from_compile_cache_{run}"] = shapes - fresh
        figures[f"shapes_fresh_{run}"] = fresh
        figures[f"demo_wall_s_{run}"] = round(wall, 1)
        details["runs"][run] = {"workdir": r["workdir"], "payback": r["payback"],
                                "compile_cache": r["compile_cache"]}
        print(f"demo {run}: {r['workdir']}, process {wall:.1f} s; " + "; ".join(
            f"{way} first epoch {r[way]['epoch_seconds'][0]:.2f} s (compiling "
            f"{r[way]['first_epoch_compile_s']:.2f} s), then "
            f"{r[way]['steady_samples_per_s']:.0f} utterances/s" for way, _ in WAYS)
            + f"; keras_gpufix / naive first epoch "
            f"{figures[f'first_epoch_ratio_fast_over_naive_{run}']:.2f}x; shapes "
            f"{shapes - fresh} from the compile cache, {fresh} fresh", flush=True)

    sys.path.insert(0, _ROOT)
    from keras_gpufix.compile.compile_cache import CompileCache

    output = os.path.join(home, "tts")
    for run, epochs in (("first", 1), ("resumed", 2), ("resumed_cold", 3)):
        if run == "resumed_cold":
            CompileCache(CompileCache.default_directory(os.path.join(output, "cache"))).clear()
        r, wall = _run([os.path.join("examples", "train_tts.py"), "--output", output,
                        "--epochs", str(epochs), "--utterances", str(args.tts_utterances),
                        "--verbose", "0"], env)
        figures[f"tts_compiles_fresh_{run}"] = r["compile_cache"]["fresh"]
        figures[f"tts_wall_s_{run}"] = round(wall, 1)
        print(f"train_tts {run} (--epochs {epochs}): process {wall:.1f} s, epochs run "
              f"{r['epochs_run']}, compiles added to the cache {r['compile_cache']['fresh']}",
              flush=True)
    write_results(args.out, "first_step", figures, details=details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
