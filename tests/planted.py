"""Planted faults with known truth for the monitor tests and the sweep.

`planted_dataset(kind)` returns an instrumented, prefetched dataset of
(x, y) batches: "healthy" (tensors in memory), "slow" (a `tf.py_function`
sleeping on every batch: input-bound) or "periodic" (sleeping on every k-th
batch: a periodic stall).

`StepWork`, `SleepEvery` and `StallOnce` plant time in the other two phases
of the cycle through callbacks: `StepWork` sleeps inside the model's train
function (a heavier step, optionally heavier every k-th step), `SleepEvery`
sleeps in its `on_train_batch_end` (or, `hook="begin"`, in its
`on_train_batch_begin`, which leaves Keras's asynchronous callback dispatch
on), between steps (a checkpoint-like callback), wherever it is listed, and
`StallOnce` sleeps once (a one-off checkpoint or host hiccup). Sleeping
makes the planted times independent of the machine.
"""

import functools
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


class StepWork(keras.callbacks.Callback):
    """Adds `seconds` to every step (and `extra` more on every `every`-th).

    It wraps the model's train function from `on_train_begin` to
    `on_train_end`, so the sleep lies inside the step (what `fit`,
    `train_on_batch` and so a `CallbackList` loop or `kg.watch` call),
    wherever the callback is listed.
    """

    def __init__(self, seconds, every=None, extra=0.0):
        super().__init__()
        self.seconds, self.every, self.extra = seconds, every, extra
        self._original = None

    def on_train_begin(self, logs=None):
        self.model.make_train_function()  # returns it only when it was made before
        original = self._original = self.model.train_function
        calls = iter(range(1 << 62))

        @functools.wraps(original)
        def train_function(*args, **kwargs):
            # After the original: fit's train function takes its batch first
            # (on JAX the loop's `next()` inside it is the input wait), then
            # steps; a sleep before the fetch would be time waiting for input.
            slow = self.every and next(calls) % self.every == 0
            out = original(*args, **kwargs)
            time.sleep(self.seconds + (self.extra if slow else 0.0))
            return out

        self.model.train_function = train_function

    def on_train_end(self, logs=None):
        self.model.train_function = self._original


class SleepEvery(keras.callbacks.Callback):
    """Sleeps `seconds` after every `k`-th step (a checkpoint-like callback).

    The sleep lies between steps wherever it is listed (the step stream
    times the step around the whole callback list). With `hook="begin"` it
    sleeps before every `k`-th step, in the loop's thread, and is
    `async_safe` (it overrides no batch-end hook that does anything).
    """

    def __init__(self, k, seconds, hook="end"):
        super().__init__()
        self.k, self.seconds, self.hook = k, seconds, hook
        self.async_safe = hook == "begin"

    def on_train_batch_begin(self, batch, logs=None):
        if self.hook == "begin" and batch % self.k == 0:
            time.sleep(self.seconds)

    def on_train_batch_end(self, batch, logs=None):
        if self.hook == "end" and batch % self.k == 0:
            time.sleep(self.seconds)


class StallOnce(keras.callbacks.Callback):
    """One long pause after batch `at` (a one-off checkpoint or host hiccup)."""

    def __init__(self, at=70, seconds=0.4):
        super().__init__()
        self.at, self.seconds = at, seconds

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            time.sleep(self.seconds)


def tiny_model(jit_compile=False, steps_per_execution=1):
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile("adam", "mse", jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    return model
