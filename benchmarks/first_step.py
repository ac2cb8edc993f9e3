"""Time to the first fast step: `keras-gpufix demo` with a cold and a warm compile cache.

    python benchmarks/first_step.py [--utterances 96] [--epochs 3] [--quick] [--out PATH]

Runs the demo (`keras_gpufix.demo.run_demo`, both ways: naive and
keras_gpufix) three times in one work folder, each in a fresh process as a
restarted training run is:

1. `first`: nothing cached (the feature cache is built, every XLA shape
   compiled);
2. `cold`: the feature cache kept, the XLA compile cache cleared before it
   (`CompileCache.clear()`), so every shape compiles afresh;
3. `warm`: both kept: the shapes load from the compile cache.

`cold` and `warm` differ only in the compile cache (TensorFlow keys an
entry by the traced function's name, which counts the functions traced
before it in the process: `first` traces more, building the feature cache,
so its entries are not the ones `cold` and `warm` use).

Reported per run and way: the first epoch (and its compiling seconds,
`RetracingMonitor`'s priced compiles), each way's wall time (setup to last
step), the whole demo's wall time (the process, Python start included), the
steady utterances/s, the pay-back point (utterances, seconds, measured or
projected) and the compile entries written. The goal: the warm keras_gpufix
first epoch within 1.5x of the naive one's (`first_epoch_ratio_fast_over_naive_warm`).
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
_CHILD = """
import json, sys
from keras_gpufix.demo import run_demo
r = run_demo(sys.argv[1], utterances=int(sys.argv[2]), epochs=int(sys.argv[3]), verbose=0)
keep = ("epoch_seconds", "first_epoch_compile_s", "wall_seconds", "steady_samples_per_s")
print(json.dumps({"payback": r["payback"], "compile_cache": r["compile_cache"],
                  **{way: {k: r[way][k] for k in keep} for way in ("naive", "keras_gpufix")}}))
"""


def _demo(workdir, utterances, epochs):
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env.update(PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, workdir, str(utterances), str(epochs)],
                          capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"the demo failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["demo_wall_s"] = wall
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="48 utterances, 2 epochs")
    add_out_argument(parser, "first_step")
    args = parser.parse_args(argv)
    if args.quick:
        args.utterances, args.epochs = 48, 2
    sys.path.insert(0, _ROOT)
    from keras_gpufix.compile.compile_cache import CompileCache

    workdir = tempfile.mkdtemp(prefix="first_step_")
    compile_cache = CompileCache(CompileCache.default_directory(os.path.join(workdir, "cache")))
    runs = {}
    for name in ("first", "cold", "warm"):
        if name == "cold":
            compile_cache.clear()
        runs[name] = _demo(workdir, args.utterances, args.epochs)
        r = runs[name]
        print(f"{name:5s}: demo {r['demo_wall_s']:.1f} s; " + "; ".join(
            f"{way} first epoch {r[way]['epoch_seconds'][0]:.2f} s (compiling "
            f"{r[way]['first_epoch_compile_s']:.2f} s), wall {r[way]['wall_seconds']:.1f} s, "
            f"{r[way]['steady_samples_per_s']:.0f} utterances/s"
            for way in ("naive", "keras_gpufix"))
            + f"; compile entries written {r['compile_cache']['written']}; pay-back {r['payback']}",
            flush=True)

    figures = {}
    for name, r in runs.items():
        for way, short in (("naive", "naive"), ("keras_gpufix", "fast")):
            figures[f"first_epoch_s_{short}_{name}"] = round(r[way]["epoch_seconds"][0], 3)
            figures[f"first_epoch_compile_s_{short}_{name}"] = round(
                r[way]["first_epoch_compile_s"], 3)
            figures[f"way_wall_s_{short}_{name}"] = round(r[way]["wall_seconds"], 2)
            figures[f"steady_utterances_per_s_{short}_{name}"] = round(
                r[way]["steady_samples_per_s"], 1)
        figures[f"demo_wall_s_{name}"] = round(r["demo_wall_s"], 2)
        figures[f"first_epoch_ratio_fast_over_naive_{name}"] = round(
            r["keras_gpufix"]["epoch_seconds"][0] / r["naive"]["epoch_seconds"][0], 2)
        figures[f"compile_entries_written_{name}"] = r["compile_cache"]["written"]
        p = r["payback"]
        # 1: caught up within the run; 0: projected at the steady rates
        figures[f"payback_utterances_{name}"] = None if p is None else round(p["utterances"])
        figures[f"payback_measured_{name}"] = None if p is None else int(p["measured"])
    figures["compile_cache_bytes"] = sum(e["size_bytes"] for e in compile_cache.entries())
    write_results(args.out, "first_step", figures,
                  details={"utterances": args.utterances, "epochs": args.epochs, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
