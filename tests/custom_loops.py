"""Custom training loops with planted faults (known truth), two ways to watch them.

`run_loop(kind, way)` trains a tiny model for two short epochs in the user's
own loop (a `tf.GradientTape` step, as in Keras's "writing a training loop
from scratch" guide) and returns the monitor's report. Kinds:

| kind         | the loop                                              | truth          |
|--------------|-------------------------------------------------------|----------------|
| `function`   | tf.function step, cached in-memory input              | healthy        |
| `eager`      | the same step run eagerly                             | (see diagnose) |
| `between`    | tf.function step, 40 ms of work after every 5th step  | periodic_stall |
| `slow_input` | tf.function step, a 15 ms `tf.numpy_function` per batch | input_bound  |

Ways: `watch` (`for batch in kg.watch(ds, ...)`) and `callback_list`
(Keras's `keras.callbacks.CallbackList`, hooks called by the loop, the
dataset through `kg.data.instrument` so the input wait is measured).
"""

import time

import keras
import numpy as np
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.data import instrument

__all__ = ["TRUTH", "run_loop"]

TRUTH = {"function": "healthy", "between": "periodic_stall", "slow_input": "input_bound"}
FEATURES = 16
BATCH = 8
BATCHES = 40  # per epoch; two epochs: shorter than the monitor's window
EVERY = 5


def _slow(x):
    time.sleep(0.015)
    return x


def dataset(kind, way):
    x = np.random.default_rng(0).random((BATCHES * BATCH, FEATURES), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 2.0)).batch(BATCH)
    if kind == "slow_input":
        ds = ds.map(lambda a, b: (tf.ensure_shape(
            tf.numpy_function(_slow, [a], tf.float32), [None, FEATURES]), b))
    else:
        ds = ds.cache()
    if way == "callback_list":
        ds = instrument(ds)
    return ds.prefetch(2)


def _model_and_step(kind):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.MeanSquaredError()

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        return loss

    return model, (train_step if kind == "eager" else tf.function(train_step))


def _between(kind, step):
    if kind == "between" and step % EVERY == EVERY - 1:
        time.sleep(0.04)  # a spectrogram written every 5th step


def run_loop(kind, way, epochs=2, **monitor_args):
    """Trains in a custom loop; returns the GPUOscillationMonitor's report."""
    model, train_step = _model_and_step(kind)
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0, **monitor_args)
    ds = dataset(kind, way)
    if way == "watch":
        with kg.watch(ds, callbacks=[monitor], model=model) as watched:
            for _ in range(epochs):
                for step, (x, y) in enumerate(watched):
                    train_step(x, y)
                    _between(kind, step)
        return watched.report()
    callbacks = keras.callbacks.CallbackList([monitor], model=model)
    callbacks.on_train_begin()
    for epoch in range(epochs):
        callbacks.on_epoch_begin(epoch)
        for step, (x, y) in enumerate(ds):
            callbacks.on_train_batch_begin(step)
            loss = train_step(x, y)
            callbacks.on_train_batch_end(step, {"loss": float(loss)})
            _between(kind, step)
        callbacks.on_epoch_end(epoch)
    callbacks.on_train_end()
    return monitor.report()
