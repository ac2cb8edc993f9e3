"""Runs in a subprocess of tests/test_distribute.py: the CPU split into two
logical devices, which must happen before TensorFlow initialises them.

Prints one line "RESULT <scenario> <json>" per scenario for the parent test.
Usage: python tests/_two_device_worker.py equivalence xla_layers builder
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import keras  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.exceptions import GpufixWarning  # noqa: E402

warnings.simplefilter("error", GpufixWarning)
DEVICES = ["/cpu:0", "/cpu:1"]
B = 8
_STRATEGY = []


def strategy_for_process():
    """One strategy per process: two MirroredStrategy objects over the same
    devices would share collective instance keys."""
    if not _STRATEGY:
        _STRATEGY.append(kg.setup_strategy(devices=DEVICES))
    return _STRATEGY[0]


def dense_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def report_dict(report):
    return {
        "jit_compile": report.jit_compile,
        "xla_scope": report.xla_scope,
        "xla_devices": list(report.xla_devices),
        "num_replicas": report.num_replicas,
        "fallback_reason": report.fallback_reason,
        "steps_per_execution": report.steps_per_execution,
    }


def equivalence():
    """One step with global batch B on 2 replicas vs one device, batch B."""
    strategy = strategy_for_process()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, 6)).astype("float32")
    y = rng.normal(size=(B, 3)).astype("float32")

    reference = dense_model()
    initial = reference.get_weights()
    reference.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
    reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)

    with strategy.scope():
        model = dense_model()
        model.set_weights(initial)
        report = kg.compile_model(
            model, keras.optimizers.SGD(0.1), "mse", mixed_precision=None,
            steps_per_execution=1, sample_batch=(x, y),
        )
    restored = all(np.array_equal(a, b) for a, b in zip(initial, model.get_weights()))
    retracing = kg.RetracingMonitor(verbose=0)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[retracing])
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), reference.get_weights())
    )
    moved = max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), initial)
    )
    return {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "restored_after_sample_step": restored,
        "max_abs_diff": diff,
        "moved": moved,
        "retracing_jit_compile": retracing.report()["jit_compile"],
        **report_dict(report),
    }


def xla_layers():
    """Dropout and BatchNormalization (variable updates inside XLA) per replica."""
    strategy = strategy_for_process()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 10, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((10, 4)),
            keras.layers.Conv1D(8, 3, padding="same"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        report = kg.compile_model(
            model, "adam", "mse", metrics=["mae"], mixed_precision=None,
            steps_per_execution=1, sample_batch=(x[:B], y[:B]),
        )
    history = model.fit(x, y, batch_size=B, epochs=2, verbose=0)
    loss = history.history["loss"]
    return {"loss": loss, "finite": bool(np.all(np.isfinite(loss))), **report_dict(report)}


def builder():
    """A padded, length-bucketed dataset of global batches, as kg.data builds."""
    strategy = strategy_for_process()
    lengths = [12, 12, 12, 12, 20, 20, 20, 20] * 2

    def gen():
        rng = np.random.default_rng(3)
        for n in lengths:
            yield rng.normal(size=(n, 5)).astype("float32"), np.float32(n / 20)

    ds = tf.data.Dataset.from_generator(
        gen,
        output_signature=(
            tf.TensorSpec((None, 5), tf.float32), tf.TensorSpec((), tf.float32),
        ),
    ).padded_batch(kg.global_batch_size(2, strategy), drop_remainder=True)
    with strategy.scope(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GpufixWarning)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((None, 5)),
            keras.layers.Conv1D(8, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        report = kg.compile_model(
            model, "adam", "mse", mixed_precision=None, steps_per_execution=2,
            sample_batch=ds,
        )
    history = model.fit(ds, epochs=2, verbose=0)
    return {
        "global_batch": kg.global_batch_size(2, strategy),
        "loss": history.history["loss"],
        "warnings": [str(w.message) for w in caught],
        **report_dict(report),
    }


if __name__ == "__main__":
    scenarios = {"equivalence": equivalence, "xla_layers": xla_layers, "builder": builder}
    for name in sys.argv[1:]:
        print(f"RESULT {name} " + json.dumps(scenarios[name]()), flush=True)
