"""Add the monitors to an existing Keras training script: two lines.

    python examples/monitor_existing_model.py

The script below is an ordinary Keras script (a small 1-D conv classifier of
generated "audio frames" fed from `tf.data`). The three lines marked
`# keras_gpufix` are all it takes:

1. `import keras_gpufix as kg`
2. `callbacks=[..., *monitors]` with `kg.GPUOscillationMonitor()`,
   `kg.RetracingMonitor()` and `kg.ProfilerTrigger(log_dir)` (traces, taken
   only when the monitor finds something, go under `logs/`). The monitors
   measure the input wait of the plain `tf.data` pipeline themselves (they
   append `kg.data.instrument`'s probe to the dataset `fit` iterates).

Nothing else changes: the model, `compile` and `fit` are the user's own.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_gpufix as kg  # keras_gpufix (1/2)


def make_dataset(n=4096, frames=64, channels=16, batch_size=32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, frames, channels)).astype("float32")
    y = (x[:, :, 0].mean(axis=1) > 0).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).batch(batch_size)
    return ds


def main():
    train = make_dataset()
    train = train.prefetch(tf.data.AUTOTUNE)

    model = keras.Sequential([
        keras.Input((64, 16)),
        keras.layers.Conv1D(32, 5, activation="relu"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(train, epochs=3, verbose=2, callbacks=[
        keras.callbacks.EarlyStopping(monitor="loss", patience=2),  # the user's own
        kg.GPUOscillationMonitor(), kg.RetracingMonitor(), kg.ProfilerTrigger("logs"),  # (2/2)
    ])


if __name__ == "__main__":
    main()
