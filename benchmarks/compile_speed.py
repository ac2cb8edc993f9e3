"""samples/s of a small speech-like sequence model: `kg.compile_model` (XLA,
measured steps_per_execution) against plain `model.compile` defaults.

Both models have the same architecture and initial weights and train on the
same in-memory batches; epochs alternate A, B, A, B, ... in one process so
machine load hits both alike. Prints the median samples/s of each, which
is faster and by how much, and what compile_model chose; the figures go to
`--out` (default `benchmarks/results/compile_speed.json`).

    python benchmarks/compile_speed.py [--rounds 5] [--steps 64] [--batch 16] [--quick] [--out PATH]
"""

import argparse
import logging
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.output import faster  # noqa: E402

from _results import add_out_argument, write_results  # noqa: E402 (beside this file)


def build(frames, mels, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((frames, mels))
    h = keras.layers.Conv1D(64, 5, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv1D(64, 5, padding="same", activation="relu")(h)
    h = keras.layers.GRU(64, return_sequences=True)(h)
    outputs = keras.layers.Dense(mels)(h)
    return keras.Model(inputs, outputs)


def epoch_rate(model, dataset, samples):
    start = time.perf_counter()
    model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    return samples / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64, help="steps per epoch")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--mels", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 32 steps")
    add_out_argument(parser, "compile_speed")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = min(args.rounds, 3), min(args.steps, 32)
    logging.basicConfig(level=logging.WARNING)

    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x = rng.normal(size=(n, args.frames, args.mels)).astype("float32")
    y = np.roll(x, 1, axis=1)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache()

    plain = build(args.frames, args.mels)
    plain.compile(optimizer="adam", loss="mse")  # Keras defaults
    tuned = build(args.frames, args.mels)
    report = kg.compile_model(tuned, "adam", "mse", mixed_precision=None,
                              sample_batch=dataset)

    xla_only = build(args.frames, args.mels)
    kg.compile_model(xla_only, "adam", "mse", mixed_precision=None,
                     steps_per_execution=1)
    models = {"plain": plain, "xla_only": xla_only, "compile_model": tuned}
    for model in models.values():  # warm: trace, XLA compile, fill the cache
        model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    rates = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            rates[name].append(epoch_rate(model, dataset, n))

    a = statistics.median(rates["plain"])
    b = statistics.median(rates["compile_model"])
    c = statistics.median(rates["xla_only"])
    paired = statistics.median(
        t / p for t, p in zip(rates["compile_model"], rates["plain"])
    )
    cal = report.calibration or {}
    print(f"model: Conv1D x2 + GRU(64) + Dense, input ({args.frames}, {args.mels}), "
          f"batch {args.batch}, {args.steps} steps/epoch, {args.rounds} interleaved rounds")
    print(f"plain model.compile (jit_compile='auto' -> {plain.jit_compile}, "
          f"steps_per_execution=1): {a:8.1f} samples/s  "
          f"(rounds: {', '.join(f'{r:.0f}' for r in rates['plain'])})")
    print(f"kg.compile_model (jit_compile={report.jit_compile}, "
          f"steps_per_execution={report.steps_per_execution}): {b:8.1f} samples/s  "
          f"(rounds: {', '.join(f'{r:.0f}' for r in rates['compile_model'])})")
    print(f"compile_model with steps_per_execution=1 (XLA only): {c:8.1f} samples/s  "
          f"(rounds: {', '.join(f'{r:.0f}' for r in rates['xla_only'])})")
    print(f"medians: {faster('compile_model', b, 'plain model.compile', a, ' samples/s')}; "
          f"median of per-round ratios compile_model / plain {paired:.2f}; "
          f"{faster('XLA only', c, 'plain model.compile', a, ' samples/s')}")
    if cal:
        print(f"calibration: 1 step {cal['t_1'] * 1e3:.2f} ms, {cal['k']} steps "
              f"{cal['t_k'] * 1e3:.2f} ms per execution -> overhead "
              f"{cal['overhead_s'] * 1e3:.2f} ms, step {cal['step_s'] * 1e3:.2f} ms, "
              f"chosen steps_per_execution={cal['chosen']}")
    write_results(args.out, "compile_speed", {
        "samples_per_s_plain": round(a, 1),
        "samples_per_s_compile_model": round(b, 1),
        "samples_per_s_xla_only": round(c, 1),
        "ratio_compile_model_over_plain": round(b / a, 2),
        "ratio_compile_model_over_plain_per_round_median": round(paired, 2),
        "ratio_xla_only_over_plain": round(c / a, 2),
        "steps_per_execution_compile_model": report.steps_per_execution,
    }, {"rounds": rates, "calibration": cal, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
