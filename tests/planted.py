"""Planted faults with known truth for the monitor tests and the sweep.

`planted_dataset(kind)` returns an instrumented, prefetched dataset of
(x, y) batches: "healthy" (tensors in memory), "slow" (a `tf.py_function`
sleeping on every batch: input-bound) or "periodic" (sleeping on every k-th
batch: a periodic stall).
"""

import time

import keras
import numpy as np
import tensorflow as tf

from keras_gpufix.data import instrument

FEATURES = 16


def planted_dataset(kind, batches=240, batch_size=16, k=7, sleep=0.02, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((batches * batch_size, FEATURES), dtype=np.float32)
    y = x[:, :1] * 2.0
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    if kind != "healthy":
        def work(i, a):
            if kind == "slow" or int(i) % k == 0:
                time.sleep(sleep)
            return a

        def slow_map(i, batch):
            a = tf.py_function(work, [i, batch[0]], tf.float32)
            return tf.ensure_shape(a, [None, FEATURES]), batch[1]

        ds = ds.enumerate().map(slow_map)
    return instrument(ds).prefetch(2)


def tiny_model(jit_compile=False, steps_per_execution=1):
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile("adam", "mse", jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    return model
