"""A tiny custom training loop (no model.fit) with planted faults, for `keras-gpufix diagnose`.

    python examples/custom_loop.py MODE

MODE: `function` (a tf.function step: healthy), `eager` (the GradientTape
step runs eagerly), `between` (work between steps every 5 steps),
`slow_input` (a numpy_function in the input), `never_trains` (only iterates
the dataset), `next` (calls `next()` on the iterator itself). Exits with
code 3 so a caller can check the code is kept.
"""

import sys, time
import numpy as np
import tensorflow as tf
import keras

MODE = sys.argv[1]
xs = np.random.rand(512, 32).astype("float32")
ys = np.random.rand(512, 1).astype("float32")

def slow(x):
    time.sleep(0.01)
    return x

ds = tf.data.Dataset.from_tensor_slices((xs, ys))
if MODE == "slow_input":
    ds = ds.map(lambda x, y: (tf.numpy_function(slow, [x], tf.float32), y))
    ds = ds.map(lambda x, y: (tf.ensure_shape(x, [32]), y))
ds = ds.batch(8)
if MODE != "slow_input":
    ds = ds.cache()
ds = ds.prefetch(2)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
opt = keras.optimizers.Adam()
loss_fn = keras.losses.MeanSquaredError()

def step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

if MODE != "eager":
    step = tf.function(step, jit_compile=True)

if MODE == "never_trains":
    total = 0.0
    for x, y in ds:
        total += float(tf.reduce_sum(x))
    print("sum", total)
    sys.exit(3)

if MODE == "next":
    batches = iter(ds.repeat())
    for i in range(200):
        x, y = next(batches)
        loss = step(x, y)
    print("done")
    sys.exit(3)

for epoch in range(3):
    for i, (x, y) in enumerate(ds):
        loss = step(x, y)
        if MODE == "between" and i % 5 == 4:
            time.sleep(0.05)
print("done")
sys.exit(3)
