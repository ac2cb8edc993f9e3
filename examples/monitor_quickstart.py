"""Train a small Keras model on generated data with the monitors on.

    python examples/monitor_quickstart.py [--slow-input]

Two runs of the same model: one fed from memory (healthy), one from a
loader that sleeps on every batch (a stand-in for librosa in a
`tf.numpy_function`). The monitor names the second one input-bound, with
the measured input wait as evidence, and prints its report.
"""

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf

import keras_gpufix as kg


def dataset(slow, batches=200, batch_size=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((batches * batch_size, 64), dtype=np.float32)
    y = x @ rng.random((64, 1), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    if slow:
        def load(a):
            time.sleep(0.01)  # what a Python loader costs per batch
            return a

        ds = ds.map(lambda a, b: (tf.ensure_shape(tf.numpy_function(load, [a], tf.float32),
                                                  [None, 64]), b))
    return kg.data.instrument(ds).prefetch(tf.data.AUTOTUNE)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    reports = {}
    for name, slow in (("in-memory input", False), ("slow Python loader", True)):
        print(f"\n=== {name} ===")
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse")
        timer = kg.StepTimer()
        monitor = kg.GPUOscillationMonitor()
        model.fit(dataset(slow), epochs=args.epochs, verbose=0, callbacks=[timer, monitor])
        report = monitor.report()
        reports[name] = report
        print("StepTimer:", {k: round(v, 2) if isinstance(v, float) else v
                             for k, v in timer.summary().items()})
    print("\n=== reports ===")
    for name, report in reports.items():
        brief = {k: report[k] for k in ("verdict", "input_wait", "fix")}
        print(name, json.dumps(brief, default=str))


if __name__ == "__main__":
    main()
