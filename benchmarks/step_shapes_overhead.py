"""Per-step cost of the input-shape probe inside fit's XLA train step (issue 22).

    python benchmarks/step_shapes_overhead.py [--chunks 100] [--steps 50] [--quick] [--out PATH]

Under `jit_compile=True` the step stream of the keras_gpufix callbacks puts
a probe on the path of every step inside `model.train_function`
(`keras_gpufix/_step_shapes.py`): a few host ops per step that
write the batch's shapes into a ring, read by the stream every quarter
second. Two identical tiny models (a step of under a millisecond on a CPU,
so the probe's share is as large as it gets), one fixed-shape in-memory
dataset; the probe is put in one model's train function before its first
trace, as the stream does. The two models then run `model.train_function`
(what `fit` calls per step) in alternating chunks of `--steps` steps,
`--chunks` chunks each, so load on a shared host hits both alike; no
callbacks (their hooks are `monitor_overhead.py`'s).

Reported: the median step time of each (wall and process CPU time, all
threads), the median over chunk pairs of probed minus plain (the probe's
cost per step, with its quartiles: the spread on a loaded host), the ratio
of the median steps/s, and the time of one `take()` of `--steps` x 5 hooks
(the stream's read of the ring, once per sync).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_gpufix._step_shapes import StepShapes  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402


def tiny_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 4)), keras.layers.Dense(8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=True)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="30 chunks")
    add_out_argument(parser, "step_shapes_overhead")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks = 30

    x = np.random.default_rng(0).random((400, 16, 4), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, 0, :1])).batch(4).cache().repeat()
    plain, probed = tiny_model(), tiny_model()
    for model in (plain, probed):
        model.make_train_function()
    probe, note = StepShapes.attach(probed)
    assert probe is not None, note
    iterators = {"plain": iter(ds), "probed": iter(ds)}
    models = {"plain": plain, "probed": probed}
    for name in models:  # compile, fill the cache, build the kernels of the reads
        for _ in range(20):
            models[name].train_function(iterators[name])
    probe.take([1] * 20)
    wall = {"plain": [], "probed": []}
    cpu = {"plain": [], "probed": []}
    for i in range(args.chunks):
        for name in ("plain", "probed") if i % 2 else ("probed", "plain"):
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                logs = models[name].train_function(iterators[name])
            float(logs["loss"])
            wall[name].append((time.perf_counter() - start) / args.steps * 1e6)
            cpu[name].append((time.process_time() - cpu_start) / args.steps * 1e6)
    StepShapes.attach(probed)  # reads from here on, as at a fit's start
    for _ in range(5 * args.steps):
        probed.train_function(iterators["probed"])
    start = time.perf_counter()
    keys = probe.take([1] * (5 * args.steps))
    take_us = (time.perf_counter() - start) * 1e6
    assert keys[-1] == ((4, 16, 4), (4, 1)), keys[-1]
    figures = {}
    for what, times in (("wall", wall), ("cpu", cpu)):
        paired = [b - a for a, b in zip(times["plain"], times["probed"])]
        q1, median, q3 = np.percentile(paired, [25, 50, 75])
        figures.update({
            f"{what}_us_per_step_plain": round(statistics.median(times["plain"]), 1),
            f"{what}_us_per_step_probed": round(statistics.median(times["probed"]), 1),
            f"{what}_overhead_us_per_step": round(float(median), 1),
            f"{what}_overhead_us_per_step_q1": round(float(q1), 1),
            f"{what}_overhead_us_per_step_q3": round(float(q3), 1),
        })
    figures["ratio_steps_per_s_probed_over_plain"] = round(
        statistics.median(wall["plain"]) / statistics.median(wall["probed"]), 3)
    figures["take_us_per_sync"] = round(take_us, 1)
    for key, value in figures.items():
        print(f"{key}: {value}")
    write_results(args.out, "step_shapes_overhead", figures,
                  {"chunks": args.chunks, "steps": args.steps, "wall_us": wall, "cpu_us": cpu})


if __name__ == "__main__":
    main()
