"""One worker of the two-process MultiWorkerMirroredStrategy test.

The parent (tests/test_distribute.py) sets TF_CONFIG (loopback ports) and
runs two of these; each trains a few steps and writes its final weights and
CompileReport to the .npz / .json path given as argv[1] (without suffix).
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.exceptions import GpufixWarning  # noqa: E402


def main(out):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GpufixWarning)
        strategy = kg.setup_strategy()
        rng = np.random.default_rng(0)  # the same data on every worker
        x = rng.normal(size=(64, 6)).astype("float32")
        y = rng.normal(size=(64, 2)).astype("float32")
        batch = kg.global_batch_size(4, strategy)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(2),
            ])
            initial = model.get_weights()
            report = kg.compile_model(
                model, keras.optimizers.SGD(0.05), "mse", mixed_precision=None,
                sample_batch=(x[:batch], y[:batch]),
            )
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        model.fit(ds, epochs=1, steps_per_epoch=4, shuffle=False, verbose=0)
    np.savez(out + ".npz", *model.get_weights())
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), initial))
    with open(out + ".json", "w") as f:
        json.dump({
            "strategy": type(strategy).__name__,
            "replicas": strategy.num_replicas_in_sync,
            "global_batch": batch,
            "jit_compile": report.jit_compile,
            "xla_devices": list(report.xla_devices),
            "steps_per_execution": report.steps_per_execution,
            "moved": moved,
            "warnings": [str(w.message) for w in caught],
        }, f)


if __name__ == "__main__":
    main(sys.argv[1])
