"""What `keras-gpufix diagnose` adds to a script's run: its own seconds, item by item.

    python benchmarks/diagnose_cost.py [--rounds 2] [--quick] [--out PATH]

Two scripts of its own, each run alone and under `keras-gpufix diagnose
--json`, interleaved for `--rounds` rounds (alone, diagnosed, alone, ...) so
both ways see the same load:

| script      | what it is                                                     |
|-------------|----------------------------------------------------------------|
| short_steps | a `fit` of ~10 s over a `tf.data` input whose `py_function`    |
|             | sleeps (input-bound, ~40 ms steps, 256 steps)                  |
| long_steps  | a `fit` of multi-second compute steps (Dense 1024 x 4, batch   |
|             | 2048, 10 steps over `tf.data`: `--trace` traces steps 5-6)     |

Each way under diagnose: the default (`auto`: no trace on a host without a
GPU) and `--trace` (the trace every run took before: its capture and
analysis listed aside), each with the what-if on. Reported per script and
way: the wall alone and diagnosed (medians of the rounds), the wall
diagnose added, the seconds its report lists (`own_cost`: each item, the
total held to its bound, the what-if aside) and what is left unlisted
(the wall it added less every listed item: the monitors' per-step hooks,
and load). Figures go to `--out` (default
`benchmarks/results/diagnose_cost.json`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _results import add_out_argument, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHORT_STEPS = """\
import time
import numpy as np
import tensorflow as tf
import keras

def slow_load(x):
    time.sleep(0.004)
    return x

def load(x, y):
    x = tf.py_function(slow_load, [x], tf.float32)
    x.set_shape([16])
    return x, y

xs = np.random.rand(512, 16).astype("float32")
ys = np.random.rand(512, 1).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, ys)).map(load).batch(8).prefetch(2)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(1)])
model.compile("adam", "mse")
model.fit(ds, epochs=EPOCHS, verbose=0)
"""

LONG_STEPS = """\
import numpy as np
import tensorflow as tf
import keras

x = np.random.rand(2048 * STEPS, 1024).astype("float32")
y = np.random.rand(2048 * STEPS, 1).astype("float32")
model = keras.Sequential([keras.Input((1024,))] + [keras.layers.Dense(1024, activation="relu")
                                                  for _ in range(4)] + [keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2048), epochs=1, verbose=0)
"""

WAYS = {"alone": None, "diagnose": [], "diagnose --trace": ["--trace"]}
KEYS = {"diagnose": "diag", "diagnose --trace": "diag_trace"}


def run(way, script, work):
    """(wall seconds, the diagnosis or None) of `script` run `way`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    options = WAYS[way]
    if options is None:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "keras_gpufix", "diagnose", "--json", *options,
                   "--log-dir", tempfile.mkdtemp(dir=work), "--", "python", script]
    t0 = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return wall, (json.loads(proc.stdout.strip().splitlines()[-1]) if options is not None
                  else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one round, shorter scripts")
    add_out_argument(parser, "diagnose_cost")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    scripts = {"short_steps": SHORT_STEPS.replace("EPOCHS", "2" if args.quick else "4"),
               "long_steps": LONG_STEPS.replace("STEPS", "8" if args.quick else "10")}
    figures, details = {}, {}
    with tempfile.TemporaryDirectory() as work:
        for name, source in scripts.items():
            script = os.path.join(work, f"{name}.py")
            with open(script, "w") as f:
                f.write(source)
            walls = {way: [] for way in WAYS}
            costs = {way: [] for way in WAYS if WAYS[way] is not None}
            for _ in range(rounds):
                for way in WAYS:
                    wall, result = run(way, script, work)
                    walls[way].append(wall)
                    if result is not None:
                        costs[way].append(result["own_cost"])
            alone = statistics.median(walls["alone"])
            figures[f"{name}_alone_s"] = round(alone, 1)
            details[f"{name}_alone"] = {"walls_s": walls["alone"]}
            said = [f"{name}: alone {alone:.1f} s"]
            for way, listed in costs.items():
                key = f"{name}_{KEYS[way]}"
                wall = statistics.median(walls[way])
                items = {k: round(statistics.median(
                    next(i["seconds"] for i in c["items"] if i["item"] == k) for c in listed), 2)
                    for k in (i["item"] for i in listed[-1]["items"])}
                added = statistics.median(c["added_s"] for c in listed)
                aside = statistics.median(c["aside_s"] for c in listed)
                figures[f"{key}_wall_s"] = round(wall, 1)
                figures[f"{key}_added_wall_s"] = round(wall - alone, 1)
                figures[f"{key}_listed_held_s"] = round(added, 2)
                figures[f"{key}_listed_aside_s"] = round(aside, 2)
                figures[f"{key}_unlisted_s"] = round(wall - alone - added - aside, 1)
                figures[f"{key}_within_bound"] = all(c["within"] for c in listed)
                details[key] = {"items_s": items, "walls_s": walls[way],
                                "bound_s": listed[-1]["bound_s"],
                                "script_s": listed[-1]["script_s"], "text": listed[-1]["text"]}
                said.append(f"{way} {wall:.1f} s (+{wall - alone:.1f}: listed {added:.1f} held, "
                            f"{aside:.1f} aside; " + ", ".join(
                                f"{k} {v:.1f}" for k, v in items.items()) + ")")
            print("; ".join(said), flush=True)
    write_results(args.out, "diagnose_cost", figures, details)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
