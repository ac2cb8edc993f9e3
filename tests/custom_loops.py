"""Custom training loops with planted faults (known truth), two ways to watch them.

`run_loop(kind, way)` trains a tiny model for two short epochs in the user's
own loop (a `tf.GradientTape` step, as in Keras's "writing a training loop
from scratch" guide) and returns the monitor's report. Kinds:

| kind         | the loop                                                | truth          |
|--------------|---------------------------------------------------------|----------------|
| `function`   | tf.function step, cached in-memory input                | healthy        |
| `eager`      | the same step run eagerly                               | (see diagnose) |
| `between`    | tf.function step, 40 ms of work after every 5th step    | periodic_stall |
| `slow_input` | tf.function step, a 25 ms `tf.numpy_function` per batch | input_bound    |

Every step also sleeps `DEVICE_S` (8 ms), standing in for the accelerator's
share of a real step: the tiny model alone takes well under a millisecond,
where the fixed cost of `next()` on a `tf.data` iterator (and thread wake-ups
on a loaded 2-core host) would be a large share of the cycle.

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

__all__ = ["TRUTH", "run_loop", "check_named_right", "compiled_by_kind"]

TRUTH = {"function": "healthy", "between": "periodic_stall", "slow_input": "input_bound"}
# Where the every-5-steps work is found: kg.watch cannot see where the step
# ends inside the loop body; CallbackList loops end it with on_train_batch_end.
STALL_PHASE = {"watch": "loop_body", "callback_list": "between"}
FEATURES = 16
BATCH = 8
BATCHES = 40  # per epoch; two epochs: shorter than the monitor's window
EVERY = 5
DEVICE_S = 0.008


def _slow(x):
    time.sleep(0.025)
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

    step = train_step if kind == "eager" else tf.function(train_step)

    def device_step(x, y):
        loss = step(x, y)
        time.sleep(DEVICE_S)
        return loss

    return model, step, device_step


def _between(kind, step):
    if kind == "between" and step % EVERY == EVERY - 1:
        time.sleep(0.04)  # a spectrogram written every 5th step


def run_loop(kind, way, epochs=2, retracing=False):
    """Trains in a custom loop.

    Returns:
        The GPUOscillationMonitor's report plus `steady_input_wait`; with
        `retracing=True`, the pair (that report, the report of a
        `RetracingMonitor(functions=[step])`).
    """
    model, step, train_step = _model_and_step(kind)
    callbacks = [kg.GPUOscillationMonitor(nvml=False, verbose=0)]
    if retracing:
        callbacks.append(kg.RetracingMonitor(functions=[step], verbose=0))
    ds = dataset(kind, way)
    if way == "watch":
        with kg.watch(ds, callbacks=callbacks, model=model) as watched:
            for _ in range(epochs):
                for step, (x, y) in enumerate(watched):
                    train_step(x, y)
                    _between(kind, step)
    else:
        hooks = keras.callbacks.CallbackList(callbacks, model=model)
        hooks.on_train_begin()
        for epoch in range(epochs):
            hooks.on_epoch_begin(epoch)
            for step, (x, y) in enumerate(ds):
                hooks.on_train_batch_begin(step)
                loss = train_step(x, y)
                hooks.on_train_batch_end(step, {"loss": float(loss)})
                _between(kind, step)
            hooks.on_epoch_end(epoch)
        hooks.on_train_end()
    report = callbacks[0].report()
    report["steady_input_wait"] = _steady_input_wait(callbacks[0].detector.log.records())
    return (report, callbacks[1].report()) if retracing else report


def _steady_input_wait(records):
    """Input-wait share of the steps the detector judges (epoch starts apart).

    An epoch's first step also carries the release of the previous epoch's
    exhausted iterator (0.2-0.95 s on the loaded test host), which the
    run's overall share counts.
    """
    steady = [r for r in records if not r.epoch_first]
    return sum(r.input_wait for r in steady) / sum(r.cycle for r in steady)


def check_named_right(kind, way):
    """Asserts the monitor names the planted fault of `kind` watched `way`."""
    report = run_loop(kind, way)
    assert report["verdict"] == TRUTH[kind], report
    if kind == "between":
        event = report["events"][-1]
        assert (event["phase"], event["period"]) == (STALL_PHASE[way], EVERY)
    if kind == "slow_input":
        assert report["steady_input_wait"] > 0.4  # (25 - 9) ms of every 25 ms
    else:
        assert report["steady_input_wait"] < 0.2


def compiled_by_kind(way):
    """RetracingMonitor(functions=[step])'s `compiled`, tf.function vs eager step."""
    return {kind: run_loop(kind, way, retracing=True)[1]["compiled"]
            for kind in ("function", "eager")}
