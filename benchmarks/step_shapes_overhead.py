"""Per-step cost of the input-shape probe inside fit's XLA train step (issue 22).

    python benchmarks/step_shapes_overhead.py [--rounds 9] [--steps 400] [--quick] [--out PATH]

Under `jit_compile=True` the step stream of the keras_gpufix callbacks puts
a probe on the path of every step inside `model.train_function`
(`keras_gpufix/callbacks/_step_shapes.py`): a few host ops per step that
write the batch's shapes into a ring, read by the stream every quarter
second. Two identical tiny models (a step of about a millisecond on a CPU,
so the probe's share is as large as it gets), one fixed-shape in-memory
dataset; the probe is put in one model's train function before its first
trace, as the stream does. Each round fits one epoch of each model, in
alternating order, with no callbacks (the probe stays in the traced graph:
this is its cost alone, the monitors' hooks are `monitor_overhead.py`'s).

Reported: median steps/s of each, the per-step overhead (difference of the
median step times, microseconds), the ratio probed / plain (median, and
the range over rounds), the process CPU time per step of each (all
threads: less swayed than wall time by other work on a shared host), and
the time of one `take()` of the run's steps (the stream's read of the ring,
once per sync).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_gpufix.callbacks._step_shapes import StepShapes  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402


def tiny_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 4)), keras.layers.Dense(8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=True)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 steps")
    add_out_argument(parser, "step_shapes_overhead")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 200

    x = np.random.default_rng(0).random((args.steps * 4, 16, 4), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, 0, :1])).batch(4).cache()
    plain, probed = tiny_model(), tiny_model()
    probed.make_train_function()
    probe, note = StepShapes.attach(probed)
    assert probe is not None, note
    for model in (plain, probed):  # compile and fill the cache
        model.fit(ds, epochs=1, verbose=0)
    rates = {"plain": [], "probed": []}
    cpu_us = {"plain": [], "probed": []}
    for i in range(args.rounds):
        order = ("plain", "probed") if i % 2 else ("probed", "plain")
        for name in order:
            model = plain if name == "plain" else probed
            start, cpu = time.perf_counter(), time.process_time()
            model.fit(ds, epochs=1, verbose=0)
            rates[name].append(args.steps / (time.perf_counter() - start))
            cpu_us[name].append((time.process_time() - cpu) / args.steps * 1e6)
    StepShapes.attach(probed)  # reads from here on, as at a fit's start
    probed.fit(ds, epochs=1, verbose=0)
    start = time.perf_counter()
    keys = probe.take([1] * args.steps)
    take_us = (time.perf_counter() - start) * 1e6
    assert keys[-1] == ((4, 16, 4), (4, 1)), keys[-1]
    median = {name: statistics.median(r) for name, r in rates.items()}
    overhead_us = (1 / median["probed"] - 1 / median["plain"]) * 1e6
    ratios = [p / q for p, q in zip(rates["probed"], rates["plain"])]
    figures = {
        "steps_per_s_plain": round(median["plain"], 1),
        "steps_per_s_probed": round(median["probed"], 1),
        "overhead_us_per_step": round(overhead_us, 1),
        "ratio_probed_over_plain": round(median["probed"] / median["plain"], 3),
        "ratio_probed_over_plain_min": round(min(ratios), 3),
        "ratio_probed_over_plain_max": round(max(ratios), 3),
        "cpu_us_per_step_plain": round(statistics.median(cpu_us["plain"]), 1),
        "cpu_us_per_step_probed": round(statistics.median(cpu_us["probed"]), 1),
        "take_us_per_sync": round(take_us, 1),
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    write_results(args.out, "step_shapes_overhead", figures,
                  {"rounds": args.rounds, "steps": args.steps, "rates": rates,
                   "cpu_us_per_step": cpu_us})


if __name__ == "__main__":
    main()
