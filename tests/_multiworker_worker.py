"""One worker of the two-process MultiWorkerMirroredStrategy tests.

The parent (tests/test_distribute.py) sets TF_CONFIG (loopback ports) and
runs two of these with the same arguments; each runs the scenarios named
after the corpus folder, in order, and writes each one's result to
OUT/<scenario>-<task index>.json.

Usage: python tests/_multiworker_worker.py OUT CORPUS coverage weights
"""

import contextlib
import importlib.util
import io
import json
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.exceptions import GpufixWarning  # noqa: E402
from keras_gpufix.run_record import RunRecord  # noqa: E402

STRATEGY = kg.setup_strategy()
TASK = STRATEGY.cluster_resolver.task_id


def weights(corpus):
    """A few steps of compile_model's per-replica XLA step: final weights."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GpufixWarning)
        rng = np.random.default_rng(0)  # the same data on every worker
        x = rng.normal(size=(64, 6)).astype("float32")
        y = rng.normal(size=(64, 2)).astype("float32")
        batch = kg.global_batch_size(4, STRATEGY)
        with STRATEGY.scope():
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
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), initial))
    return {
        "strategy": type(STRATEGY).__name__,
        "replicas": STRATEGY.num_replicas_in_sync,
        "global_batch": batch,
        "jit_compile": report.jit_compile,
        "xla_devices": list(report.xla_devices),
        "steps_per_execution": report.steps_per_execution,
        "moved": moved,
        "weights": [w.tolist() for w in model.get_weights()],
        "warnings": [str(w.message) for w in caught],
    }


def coverage(corpus, service=None):
    """The ids this worker reads in two epochs of the builder's dataset
    (defaults: `seed=None`), distributed as Keras's `fit` distributes it."""
    builder = kg.data.SpeechDatasetBuilder(corpus, verbose=0)
    dataset = builder.build(batch_size=kg.global_batch_size(4, STRATEGY), num_buckets=3,
                            as_dict=True, service=service)
    distributed = STRATEGY.experimental_distribute_dataset(dataset)
    epochs = []
    for _ in range(2):
        ids = []
        for batch in distributed:
            for part in STRATEGY.experimental_local_results(batch["id"]):
                ids.extend(name.decode() for name in part.numpy())
        epochs.append(ids)
    return {"task": TASK, "epochs": epochs, "utterances": builder.report["utterances"],
            "remainder": builder.report["remainder"]}


def straggler(corpus, loop="fit"):
    """`fit` (or a custom loop over the distributed dataset under `kg.watch`) with
    the monitor, task 1's input slowed by SLOW_S per batch; the job report each
    worker's monitor gathered in $KG_TEST_LOG_DIR/<loop>, what it printed, the
    chief's run record and report.html, and the truth: samples consumed / wall
    time after warmup."""
    batch, steps, warmup, slow_s = kg.global_batch_size(4, STRATEGY), 40, 5, 0.1

    def features(index):
        x = tf.random.stateless_normal((batch, 6), tf.stack([index, index]))
        return x, tf.reduce_sum(x, axis=1, keepdims=True)

    def slowed(x, y):
        def sleep(value):
            time.sleep(slow_s)
            return value
        return tf.numpy_function(sleep, [x], tf.float32, stateful=True), y

    ds = tf.data.Dataset.range(steps).map(features)
    if TASK == 1:
        ds = ds.map(slowed).map(lambda x, y: (tf.ensure_shape(x, (batch, 6)), y))
    ds = kg.data.instrument(ds).prefetch(2)
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
    log_dir = os.path.join(os.environ["KG_TEST_LOG_DIR"], loop)
    ends = []
    monitor = kg.GPUOscillationMonitor(warmup=warmup, log_dir=log_dir, nvml=False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if loop == "fit":
            with STRATEGY.scope():
                kg.compile_model(model, optimizer, "mse", mixed_precision=None,
                                 steps_per_execution=1, sample_batch=next(iter(ds)))
            clock = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda step, logs: ends.append(time.perf_counter()))
            model.fit(ds, epochs=1, verbose=0, callbacks=[monitor, clock])
        else:
            train_step = _example("two_workers").train_step(
                STRATEGY, model, optimizer, keras.losses.MeanSquaredError())
            with kg.watch(STRATEGY.experimental_distribute_dataset(ds), callbacks=[monitor],
                          model=model) as watched:
                for x, y in watched:
                    train_step(x, y)
                    ends.append(time.perf_counter())
    truth = (len(ends) - warmup) * batch / (ends[-1] - ends[warmup - 1])
    record = os.path.join(log_dir, "keras_gpufix", "run_record.json")
    html = None
    if TASK == 0:
        html = open(RunRecord.load(record).write_html()).read()
    return {"task": TASK, "job": monitor.report()["job"], "printed": printed.getvalue(),
            "true_samples_per_s": truth, "steps": len(ends),
            "record": json.load(open(record)) if TASK == 0 else None, "html": html}


def straggler_loop(corpus):
    """`straggler` through a custom loop: `strategy.run` over the distributed dataset."""
    return straggler(corpus, loop="custom")


def _example(name):
    """The module examples/<name>.py (its `main` is not run)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def coverage_service(corpus):
    """`coverage` through the tf.data service at $KG_TEST_SERVICE."""
    return coverage(corpus, os.environ["KG_TEST_SERVICE"])


if __name__ == "__main__":
    scenarios = {"weights": weights, "coverage": coverage, "coverage_service": coverage_service,
                 "straggler": straggler, "straggler_loop": straggler_loop}
    out, corpus = sys.argv[1:3]
    for name in sys.argv[3:]:
        result = scenarios[name](corpus)
        with open(os.path.join(out, f"{name}-{TASK}.json"), "w") as f:
            json.dump(result, f)
