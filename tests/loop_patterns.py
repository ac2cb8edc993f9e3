"""Training scripts in the shapes real speech trainers take, for `keras-gpufix diagnose`.

    python tests/loop_patterns.py MODE [--watch] [--steps N]

MODE:
- `accum_plot`: an eager GradientTape step with gradient accumulation (apply every 2
  steps), a "plot" (a sleep) every 5 steps; the loop calls `next()` itself.
- `tf_print [--no-plot]`: the same eager step, its loss holding a `tf.print` (XLA cannot compile it).
- `distributed`: `strategy.experimental_distribute_dataset` + `strategy.run` inside a
  tf.function (the default strategy), a `for` loop; `mirrored`: the same with a
  one-CPU `MirroredStrategy`.
- `pydataset`: a compiled step over a `keras.utils.PyDataset`.
- `debug_branch`: `fit` with `run_eagerly=True` under an `if debug:` not taken.
- `watch_iter`: `it = iter(kg.watch(ds, model=m))` and `next(it)`, no `with`.
- `contention`: `fit` with a heavy map (TF ops, parallel) beside a heavy compiled step:
  no input wait, but the map takes the step's cores.
- `tf_gradients`: a Tacotron2-style trainer: `tf.gradients` (no GradientTape) inside
  `strategy.run` inside a tf.function, over a repeated distributed dataset (80 steps).
- `blocked`: an eager accumulation step in a trainer class that tf.function cannot run
  as written: a None accumulator before a loop over its micro-batches, `self.current_step
  += 1` and `float(loss.numpy())`; `blocked_fixed`: the same step changed as diagnose's
  blockers say (zeros and a loss before the loop, the count and the read outside), in tf.function.
- `xtts [--no-plot]`: an XTTS-like trainer's eager step (gradient accumulation over a
  tensor count, which AutoGraph makes a tf.while_loop; a None accumulator and a name set
  from `max()` of a tensor inside it; `float()`/`.numpy()` reads, `self.current_step +=
  1`, a `tf.print` in the loss) and a plot every 5 steps. Prints `LOOP_S`.
- `nothing`: iterates a PyDataset and calls a tf.function without gradients.
- `slow_map`: `fit` (`--epochs E`, default 1) over utterances read by a slow
  `tf.py_function` map (a file read: a 1 ms sleep each) feeding a small compiled step;
  `--tf-ops` reads in TF ops instead (a fix: no Python in the map; the other,
  `.cache()` after the map, is diagnose's input.patch).
  Prints `FIT_S <seconds of the fit, its trace included>`.
- `host_work`: a `tf.function` step (+ its device time) and host NumPy work (a
  spectrogram of 128 frames for a plot) every 4 steps; `--no-host` leaves it out.
  Prints `LOOP_S` (its steps after the first 5: the trace left out).
- `accum_way [--compiled] [--no-plot]`: the accumulation loop one way (its step in
  `tf.function`, without its plot), timed once (`LOOP_S`).
- `truth WAY [WAY ...] [--rounds R] [--steps N] [--own-process]`: runs each WAY (a quoted
  mode and its flags, e.g. "slow_map --epochs 3 --cache") in this process in turn (with
  `--own-process` each in a process of its own, as a user runs the script), R rounds
  (default 3), the order reversed every other round, and prints `TRUTH <json of each
  way's seconds per round>`: its own `LOOP_S` / `FIT_S` where it prints one, else its
  wall time.

`--watch` runs the loop inside `kg.watch` (the same loop diagnose watches without it)
and prints `WATCH <verdict> <json of the ranked causes>` at the end. The truth, for
`accum_plot`: the loop prints `LOOP_S <seconds of its steps after the first 5>`, and
`truth` runs its `accum_way`s; for `contention`, `--cached` computes its batches before
the fit, which prints `FIT_S <seconds>`.
"""

import gc
import json
import sys
import time

import keras
import numpy as np
import tensorflow as tf

MODE = sys.argv[1]
WATCH = "--watch" in sys.argv
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 40
PLOT_S = 0.15  # the plot every 5 steps
DEVICE_S = 0.005  # the device time of a compiled step (a GPU's), slept in the loop body
FEATURES = 32

rng = np.random.default_rng(0)
xs = rng.random((2048, FEATURES), dtype=np.float32)
ys = xs[:, :1] * 2.0
dataset = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(16).cache().repeat().prefetch(2)
strategy = (tf.distribute.MirroredStrategy(["/cpu:0"]) if MODE == "mirrored"
            else tf.distribute.get_strategy())
with strategy.scope():
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
loss_fn = keras.losses.MeanSquaredError()


def compute_loss(x, y):
    loss = loss_fn(y, model(x, training=True))
    if MODE == "tf_print":
        tf.print("loss", loss)  # the op XLA cannot compile
    return loss


accum = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]


def accumulate_step(x, y):
    with tf.GradientTape() as tape:
        loss = compute_loss(x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    for a, g in zip(accum, grads):
        a.assign_add(g)
    return loss


def apply_accumulated():
    optimizer.apply([a / 2.0 for a in accum], model.trainable_variables)
    for a in accum:
        a.assign(tf.zeros_like(a))


@tf.function
def compiled_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss


def watched(iterable):
    """`iterable` in kg.watch with `--watch`, else itself."""
    if not WATCH:
        return iterable
    import keras_gpufix as kg

    global MONITOR
    MONITOR = kg.GPUOscillationMonitor(verbose=0, nvml=False)
    return kg.watch(iterable, callbacks=[MONITOR], model=model)


def say_watch():
    if WATCH:
        report = MONITOR.report()
        print("WATCH", report["verdict"], json.dumps(report.get("causes")), flush=True)


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return xs[16 * i:16 * i + 16], ys[16 * i:16 * i + 16]


def accumulation_loop(batches, step, plot_s, steps):
    """The trainer's loop; returns the seconds of its steps after the first 5."""
    for i in range(steps):
        if i == 5:
            t0 = time.perf_counter()
        x, y = next(batches)
        step(x, y)
        if i % 2 == 1:
            apply_accumulated()
        if i % 5 == 4 and plot_s:
            time.sleep(plot_s)  # a spectrogram rendered and written
    return time.perf_counter() - t0


if MODE in ("accum_plot", "tf_print"):
    source = watched(dataset)
    plot_s = 0 if "--no-plot" in sys.argv else PLOT_S
    print("LOOP_S", accumulation_loop(iter(source), accumulate_step, plot_s, STEPS), flush=True)
    if WATCH:
        source.close()
    say_watch()
elif MODE in ("distributed", "mirrored"):
    dist = strategy.experimental_distribute_dataset(dataset.take(STEPS))

    @tf.function
    def distributed_step(batch):
        losses = strategy.run(compiled_step, args=batch)
        return strategy.reduce("SUM", losses, axis=None)

    if WATCH:
        with watched(dist) as source:
            for batch in source:
                distributed_step(batch)
                time.sleep(DEVICE_S)
    else:
        for batch in dist:
            distributed_step(batch)
            time.sleep(DEVICE_S)
    say_watch()
elif MODE == "tf_gradients":
    dist = strategy.experimental_distribute_dataset(dataset)  # repeated: --steps must stop it

    def replica_step(x, y):
        loss = loss_fn(y, model(x, training=True))
        weights = [v.value for v in model.trainable_variables]
        grads = tf.gradients(loss, weights)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    for i, batch in enumerate(dist):
        if i >= 80:
            break
        train_step(batch)
        time.sleep(DEVICE_S)
elif MODE == "blocked":
    class Trainer:
        def __init__(self):
            self.current_step = 0

        def train_step(self, x, y):
            accumulated = None
            for micro_x, micro_y in tf.data.Dataset.from_tensor_slices((x, y)).batch(8):
                with tf.GradientTape() as tape:
                    loss = loss_fn(micro_y, model(micro_x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                accumulated = grads if accumulated is None else [
                    a + g for a, g in zip(accumulated, grads)]
            optimizer.apply(accumulated, model.trainable_variables)
            self.current_step += 1
            return float(loss.numpy())

    trainer = Trainer()
    for x, y in dataset.take(STEPS):
        trainer.train_step(x, y)
elif MODE == "blocked_fixed":
    class Trainer:
        def __init__(self):
            self.current_step = 0

        @tf.function
        def train_step(self, x, y):
            accumulated = tuple(tf.zeros_like(v) for v in model.trainable_variables)
            loss = tf.constant(0.0)
            for micro_x, micro_y in tf.data.Dataset.from_tensor_slices((x, y)).batch(8):
                with tf.GradientTape() as tape:
                    loss = loss_fn(micro_y, model(micro_x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                accumulated = tuple(a + g for a, g in zip(accumulated, grads))
            optimizer.apply(accumulated, model.trainable_variables)
            return loss

    trainer = Trainer()
    for x, y in dataset.take(STEPS):
        loss = float(trainer.train_step(x, y).numpy())
        trainer.current_step += 1
elif MODE == "xtts":
    lengths = rng.integers(1, 50, len(xs)).astype(np.int32)
    utterances = tf.data.Dataset.from_tensor_slices((xs, ys, lengths)).batch(16).repeat()

    def xtts_loss(x, y):
        loss = loss_fn(y, model(x, training=True))
        tf.print("loss", loss, output_stream="file:///dev/null")  # XLA cannot compile it
        return loss

    class XTTSTrainer:
        def __init__(self):
            self.current_step = 0
            self.accumulation_steps = tf.constant(2)  # a tensor count: a tf.while_loop

        def train_step(self, x, y, text_lengths):
            accumulated = None
            size = tf.shape(x)[0] // self.accumulation_steps
            for step in range(self.accumulation_steps):
                micro_x = x[step * size:(step + 1) * size]
                micro_y = y[step * size:(step + 1) * size]
                text_maxlen = max(text_lengths[step * size:(step + 1) * size])
                with tf.GradientTape() as tape:
                    loss = xtts_loss(micro_x, micro_y)
                grads = tape.gradient(loss, model.trainable_variables)
                accumulated = grads if accumulated is None else [
                    a + g for a, g in zip(accumulated, grads)]
            optimizer.apply(accumulated, model.trainable_variables)
            self.current_step += 1
            return {"loss": float(loss.numpy()), "text_maxlen": int(text_maxlen)}

    trainer = XTTSTrainer()
    batches = iter(utterances)
    for i in range(STEPS):
        if i == 5:
            t0 = time.perf_counter()
        x, y, text_lengths = next(batches)
        logs = trainer.train_step(x, y, text_lengths)
        if i % 5 == 4 and "--no-plot" not in sys.argv:
            time.sleep(PLOT_S)  # a spectrogram plotted
    print("LOOP_S", time.perf_counter() - t0, flush=True)
    print("XTTS", trainer.current_step, "loss %.4f" % logs["loss"], flush=True)
elif MODE == "pydataset":
    data = Batches()
    source = watched(data)
    for epoch in range(2):
        for x, y in source:
            compiled_step(x, y)
            time.sleep(DEVICE_S)
    if WATCH:
        source.close()
    say_watch()
elif MODE == "debug_branch":
    debug = False
    if debug:
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    else:
        model.compile(optimizer="sgd", loss="mse")
    model.fit(dataset, steps_per_epoch=STEPS, epochs=1, verbose=0)
elif MODE == "watch_iter":
    import keras_gpufix as kg

    batches = iter(kg.watch(dataset.take(STEPS), model=model))
    for i in range(STEPS):
        x, y = next(batches)
        compiled_step(x, y)
        if i % 5 == 4:
            time.sleep(PLOT_S)
elif MODE == "contention":
    def heavy(x, y):  # features computed in TF ops: no wait, but the same cores as the step
        block = tf.tile(tf.tensordot(x, x, axes=0), [4, 4])  # 128 x 128
        for _ in range(5):
            block = tf.tanh(tf.matmul(block, block))
        return x + tf.reduce_mean(block[:, :FEATURES], axis=0), y

    features = tf.data.Dataset.from_tensor_slices((xs, ys)).repeat().map(
        heavy, num_parallel_calls=tf.data.AUTOTUNE).batch(64).prefetch(4)
    big = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1024, activation="relu"),
                            keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
    big.compile(optimizer="sgd", loss="mse")
    if "--cached" in sys.argv:  # the truth: the same batches, computed before the fit
        features = features.take(32).cache().repeat()
        for _ in features.take(32):
            pass
    big.fit(features, steps_per_epoch=5, epochs=1, verbose=0)  # the trace and compile
    gc.collect()  # its iterator, in a reference cycle, is released (as diagnose does)
    t0 = time.perf_counter()
    big.fit(features, steps_per_epoch=STEPS, epochs=1, verbose=0)
    print("FIT_S", time.perf_counter() - t0, flush=True)
elif MODE == "nothing":
    @tf.function
    def predict(x):
        return model(x)

    for x, y in Batches():
        predict(x)
elif MODE == "slow_map":
    def read_utterance(x):
        time.sleep(0.001)  # a file read and decode in Python
        return x

    epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 1
    utterances = tf.data.Dataset.from_tensor_slices((xs, ys)).map(
        (lambda x, y: (tf.identity(x), y)) if "--tf-ops" in sys.argv else
        lambda x, y: (tf.ensure_shape(tf.py_function(read_utterance, [x], tf.float32),
                                      [FEATURES]), y))
    model.compile(optimizer="sgd", loss="mse")
    t0 = time.perf_counter()
    model.fit(utterances.batch(16).prefetch(2), epochs=epochs, verbose=0)
    print("FIT_S", time.perf_counter() - t0, flush=True)
elif MODE == "host_work":
    frames = rng.random((128, 4096), dtype=np.float32)
    for i, (x, y) in enumerate(dataset.take(STEPS)):
        if i == 5:  # the steady loop, as diagnose judges it (after its warm-up of 5)
            t0 = time.perf_counter()
        compiled_step(x, y)
        time.sleep(DEVICE_S)
        if i % 4 == 3 and "--no-host" not in sys.argv:  # a spectrogram for a plot
            np.log(np.abs(np.fft.rfft(frames * np.hanning(4096))) + 1e-6)
    print("LOOP_S", time.perf_counter() - t0, flush=True)
elif MODE == "accum_way":
    step = tf.function(accumulate_step) if "--compiled" in sys.argv else accumulate_step
    plot_s = 0 if "--no-plot" in sys.argv else PLOT_S
    print("LOOP_S", accumulation_loop(iter(dataset), step, plot_s, STEPS), flush=True)
elif MODE == "truth":  # each way in turn in this process, rounds interleaved
    import contextlib
    import io
    import re
    import runpy
    import subprocess

    flags = [a for i, a in enumerate(sys.argv) if a.startswith("--")
             or sys.argv[i - 1] in ("--steps", "--rounds")]
    ways = [a for a in sys.argv[2:] if a not in flags]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    times = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways[::-1] if r % 2 else ways:
            args = way.split() + ([] if "--steps" in way else ["--steps", str(STEPS)])
            t0 = time.perf_counter()
            if "--own-process" in flags:
                out = subprocess.run([sys.executable, __file__, *args], capture_output=True,
                                     text=True, check=True).stdout
            else:
                sys.argv, buffer = [__file__, *args], io.StringIO()
                with contextlib.redirect_stdout(buffer):
                    runpy.run_path(__file__, run_name="loop_pattern")
                out = buffer.getvalue()
            wall = time.perf_counter() - t0
            own = re.search(r"^(?:LOOP_S|FIT_S) ([\d.e-]+)$", out, re.M)
            times[way].append(float(own.group(1)) if own else wall)
            gc.collect()
    print("TRUTH", json.dumps(times), flush=True)
print("done", MODE, flush=True)
