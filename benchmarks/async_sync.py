"""What kg.watch's per-step sync costs, and its hook cost against the run's length.

    python benchmarks/async_sync.py [--rounds 5] [--steps 300] [--tf-async]
        [--lengths 2000 20000] [--rounds-length 2] [--full] [--out PATH]
    KERAS_BACKEND=jax python benchmarks/async_sync.py ...

Two measurements, each interleaved in one run (the order rotates every
round, so drifting load on a shared host falls on all sides alike):

1. The sync's cost. A Keras model trains in a custom loop that reads its
   loss every 5th step (a loop that logs every few steps), on the backend of
   `KERAS_BACKEND` (`--tf-async`: TensorFlow with asynchronous eager
   execution), three ways a round: `bare` (no monitor), `unsynced`
   (`kg.watch(..., sync=False)`) and `synced` (`kg.watch(...)`, the
   default: it waits at each step's end for the device work queued, as
   `fit` does). Reported: median steps/s of each and the medians of the
   per-round ratios `synced / unsynced` (what the sync costs: the overlap
   of the host's next step with the device's work that it gives up) and
   `synced / bare`; and the sync call alone with nothing pending (us; None
   where execution is synchronous, TensorFlow's default on a CPU: kg.watch
   then makes no sync).
2. The hook cost against the run's length: `--lengths` runs of steps that
   busy-wait 1 ms each over a list of NumPy batches, bare and under
   `kg.watch` with its default monitor, in rotating order, `--rounds-length`
   rounds. Per step, the CPU time of the loop's thread outside the loop
   body (from the end of one body to the start of the next: `next()`, the
   hooks, the sync; CPU time, so that the host's other work, which only
   delays a thread, does not count) is summed; reported per length: that
   time per step, watched minus bare (us), and the wall-clock steps/s ratio
   watched / bare (which other work on the host swings). Flat in the length
   means nothing grows with the run.

`--full` adds a 100k-step length (about 7 minutes more on 2 cores).
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402
from keras_gpufix.watched import _sync_call  # noqa: E402

EVERY = 5
BATCH = 128
FEATURES = 256


def model_step(hidden):
    """(train_step(x, y) -> loss) of a 3-layer MLP on the Keras backend."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.MeanSquaredError()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.function
        def tf_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            optimizer.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)
            return loss

        return tf_step
    import jax

    optimizer.build(model.trainable_variables)

    def loss_of(trainable, non_trainable, x, y):
        pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, pred), non_trainable

    @jax.jit
    def jax_step(state, x, y):
        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(
            state[0], state[1], x, y)
        trainable, opt_vars = optimizer.stateless_apply(state[2], grads, state[0])
        return loss, (trainable, non_trainable, opt_vars)

    state = [(tuple(v.value for v in model.trainable_variables),
              tuple(v.value for v in model.non_trainable_variables),
              tuple(v.value for v in optimizer.variables))]

    def step(x, y):
        loss, state[0] = jax_step(state[0], x, y)
        return loss

    return step


def sync_cost(args):
    """Part 1: steps/s bare, unsynced and synced, interleaved by round."""
    step = model_step(args.hidden)
    rng = np.random.default_rng(0)
    batches = [(rng.random((BATCH, FEATURES), dtype=np.float32),
                rng.random((BATCH, 1), dtype=np.float32)) for _ in range(args.steps)]

    def run(way):
        monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
        loop = batches if way == "bare" else kg.watch(batches, callbacks=[monitor],
                                                      sync=way == "synced")
        start = time.perf_counter()
        for i, (x, y) in enumerate(loop):
            loss = step(x, y)
            if i % EVERY == EVERY - 1:
                float(loss)
        float(loss)  # the last steps' work, queued: part of the run
        if way != "bare":
            loop.close()
        return args.steps / (time.perf_counter() - start)

    run("synced")  # compiles the step
    ways = ["bare", "unsynced", "synced"]
    rates = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in ways[r % 3:] + ways[:r % 3]:
            rates[way].append(run(way))
    figures = {f"steps_per_s_{w}": round(statistics.median(rates[w]), 1) for w in ways}
    figures["sync_call_idle_us"] = None  # synchronous execution: no sync is made
    sync = _sync_call(keras.backend.backend())
    if sync is not None:
        sync()
        start = time.perf_counter()
        for _ in range(1000):
            sync()
        figures["sync_call_idle_us"] = round((time.perf_counter() - start) * 1e3, 1)
    figures["ratio_steps_per_s_synced_over_unsynced"] = round(statistics.median(
        s / u for s, u in zip(rates["synced"], rates["unsynced"])), 3)
    figures["ratio_steps_per_s_synced_over_bare"] = round(statistics.median(
        s / b for s, b in zip(rates["synced"], rates["bare"])), 3)
    return figures, {w: [round(x, 1) for x in v] for w, v in rates.items()}


def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def length_cost(args):
    """Part 2: time outside the loop body per step, bare and watched, by length."""
    batch = np.zeros((8, 4), np.float32)

    def run(steps, watched):
        data = [batch] * steps
        loop = kg.watch(data, callbacks=[kg.GPUOscillationMonitor(nvml=False, verbose=0)]) \
            if watched else data
        outside, last = 0.0, None
        start = time.perf_counter()
        for _ in loop:
            now = time.thread_time()
            if last is not None:
                outside += now - last
            busy(0.001)
            last = time.thread_time()
        if watched:
            loop.close()
        return outside / (steps - 1), steps / (time.perf_counter() - start)

    figures, details = {}, {}
    for steps in args.lengths:
        rows = {True: [], False: []}
        for r in range(args.rounds_length):
            for watched in ((True, False) if r % 2 else (False, True)):
                rows[watched].append(run(steps, watched))
        extra = [(w[0] - b[0]) * 1e6 for w, b in zip(rows[True], rows[False])]
        ratio = [w[1] / b[1] for w, b in zip(rows[True], rows[False])]
        figures[f"hook_us_per_step_{steps}"] = round(statistics.median(extra), 1)
        figures[f"ratio_steps_per_s_watched_over_bare_{steps}"] = round(statistics.median(ratio), 3)
        details[steps] = {"hook_us_per_step": [round(x, 1) for x in extra],
                          "ratio": [round(x, 3) for x in ratio]}
        print(f"{steps:7d} steps: hooks {figures[f'hook_us_per_step_{steps}']:6.1f} us/step, "
              f"steps/s watched/bare {figures[f'ratio_steps_per_s_watched_over_bare_{steps}']}"
              f" (rounds: {details[steps]})", flush=True)
    return figures, details


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="sync-cost rounds (0: none)")
    parser.add_argument("--steps", type=int, default=300, help="steps per sync-cost run")
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's width")
    parser.add_argument("--tf-async", action="store_true",
                        help="TensorFlow: asynchronous eager execution")
    parser.add_argument("--lengths", type=int, nargs="*", default=[2000, 20000],
                        help="run lengths of the hook-cost part (none: skip it)")
    parser.add_argument("--rounds-length", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="lengths 2k, 20k and 100k, 3 rounds")
    add_out_argument(parser, "async_sync")
    args = parser.parse_args(argv)
    if args.full:
        args.lengths, args.rounds_length = [2000, 20000, 100000], 3
    backend = keras.backend.backend()
    if args.tf_async:
        if backend != "tensorflow":
            parser.error(f"--tf-async needs KERAS_BACKEND=tensorflow. Received: {backend}")
        import tensorflow as tf

        tf.config.experimental.set_synchronous_execution(False)
    mode = backend + (" (async eager)" if args.tf_async else "")
    figures, details = {}, {}
    if args.rounds:
        figures, details = sync_cost(args)
        print(f"{mode}: steps/s bare {figures['steps_per_s_bare']}, unsynced "
              f"{figures['steps_per_s_unsynced']}, synced {figures['steps_per_s_synced']}; "
              f"synced/unsynced {figures['ratio_steps_per_s_synced_over_unsynced']}, "
              f"synced/bare {figures['ratio_steps_per_s_synced_over_bare']}; the sync call "
              f"alone {figures['sync_call_idle_us']} us", flush=True)
    length_figures, length_details = length_cost(args)
    figures.update(length_figures)
    figures["backend"] = mode
    write_results(args.out, "async_sync", figures,
                  {"sync_rounds_steps_per_s": details, "length_rounds": length_details})
    return 0


if __name__ == "__main__":
    sys.exit(main())
