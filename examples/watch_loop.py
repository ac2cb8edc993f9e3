"""A custom training loop (no model.fit) monitored by keras_gpufix.

    python examples/watch_loop.py MODE [--callback-list]

MODE plants one fault: `cached` (input cached in memory: healthy),
`slow_input` (a 40 ms `tf.numpy_function` per batch), `between` (50 ms of
work after every 5th step, like writing a spectrogram image). The loop is
watched with `kg.watch` (one changed line), or with `--callback-list` the
monitor gets its hooks through `keras.callbacks.CallbackList`, Keras's own
custom-loop pattern.
"""

import sys
import time

import keras
import numpy as np
import tensorflow as tf

import keras_gpufix as kg

MODE = sys.argv[1]
CALLBACK_LIST = "--callback-list" in sys.argv[2:]


def slow(x):
    time.sleep(0.04)
    return x


xs = np.random.rand(40 * 32, 64).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, xs[:, :1])).batch(32)
if MODE == "slow_input":
    ds = ds.map(lambda x, y: (tf.ensure_shape(tf.numpy_function(slow, [x], tf.float32),
                                              [None, 64]), y))
else:
    ds = ds.cache()
if CALLBACK_LIST:
    ds = kg.data.instrument(ds)  # lets the monitor read the input wait from the dataset
ds = ds.prefetch(2)

model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                          keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
optimizer = keras.optimizers.Adam()
loss_fn = keras.losses.MeanSquaredError()


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss


def log_every_5th(step):
    if MODE == "between" and step % 5 == 4:
        time.sleep(0.05)


if CALLBACK_LIST:
    callbacks = keras.callbacks.CallbackList([kg.GPUOscillationMonitor()], model=model)
    callbacks.on_train_begin()
    for epoch in range(3):
        callbacks.on_epoch_begin(epoch)
        for step, (x, y) in enumerate(ds):
            callbacks.on_train_batch_begin(step)
            loss = train_step(x, y)
            callbacks.on_train_batch_end(step, {"loss": float(loss)})
            log_every_5th(step)
        callbacks.on_epoch_end(epoch)
    callbacks.on_train_end()
else:
    with kg.watch(ds, model=model) as watched:
        for epoch in range(3):
            for step, (x, y) in enumerate(watched):  # was: enumerate(ds)
                loss = train_step(x, y)
                log_every_5th(step)
