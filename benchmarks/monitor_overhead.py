"""Overhead of StepTimer + GPUOscillationMonitor on model.fit throughput.

    python benchmarks/monitor_overhead.py [--rounds 7] [--steps 300] [--hidden 512]

One compiled model, one in-memory instrumented dataset; each round fits one
epoch without callbacks and one with the monitors, in alternating order, and
the ratio of steps/s (on / off) is reported per round and as the median.
Goal: ratio >= 0.98.
"""

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_gpufix as kg  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.random((args.steps * args.batch_size, 128), dtype=np.float32)
    y = x[:, :1]
    ds = kg.data.instrument(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).cache()
    ).prefetch(tf.data.AUTOTUNE)
    model = keras.Sequential([
        keras.Input((128,)),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile("adam", "mse", jit_compile=True)
    model.fit(ds, epochs=1, verbose=0)  # compile, fill the cache

    def run(with_monitors):
        callbacks = [kg.StepTimer(), kg.GPUOscillationMonitor(verbose=0)] if with_monitors else []
        start = time.perf_counter()
        model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
        return args.steps / (time.perf_counter() - start)

    ratios = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        rates = {flag: run(flag) for flag in order}
        ratios.append(rates[True] / rates[False])
        print(f"round {r}: off {rates[False]:.1f} steps/s, on {rates[True]:.1f} steps/s, "
              f"ratio {ratios[-1]:.3f}")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, "
          f"TF {tf.__version__}, Keras {keras.__version__}, "
          f"devices {[d.device_type for d in tf.config.list_logical_devices()]}")
    print(f"median ratio (on/off steps/s) over {args.rounds} rounds of {args.steps} steps: "
          f"{statistics.median(ratios):.3f}  (goal >= 0.98)")


if __name__ == "__main__":
    main()
