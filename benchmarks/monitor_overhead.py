"""Overhead of StepTimer + GPUOscillationMonitor + RetracingMonitor on model.fit.

    python benchmarks/monitor_overhead.py [--rounds 11] [--steps 300] [--hidden 512]
        [--plain] [--quick] [--out PATH]

One compiled model, one in-memory instrumented dataset whose batches carry
a lengths column that the probe counts as real frames, as the `kg.data`
builder's do (so the monitors also compute `real_frames_per_s` and
`audio_seconds_per_s`); each round fits one epoch in each of three ways, in
rotating order:

- `none`: no callbacks, verbose=0. Keras then never waits for a step's
  results on the host (nothing reads the logs);
- `sync`: one callback that only overrides `on_train_batch_end`. Keras then
  converts the logs to numbers after every step, as it does for its default
  progress bar: this is the price of *any* per-step callback;
- `monitors`: StepTimer + GPUOscillationMonitor + RetracingMonitor, the
  recommended trio, sharing one step stream (one clock read and one input
  probe read per hook for the three).

With `--plain` the dataset is a plain `tf.data` pipeline (no kg.data call,
no lengths column), as README's first line has it: the monitors then put
fit's dataset through the input probe themselves (one sequential `map`
appended), and `monitors / sync` includes that probe's cost.

Reported: the median over rounds of steps/s ratios `monitors / sync` (what
the monitors add; goal >= 0.98) and `monitors / none` (including the
per-step sync, which is what makes a step's time real on a GPU). Because
wall-clock ratios on a shared machine swing by tens of percent between
rounds, the time spent inside the monitors' own hooks is also measured
directly (a clock around every hook call) and reported per step and as a
share of the fit's wall time: `1 - share` is the throughput ratio the hooks
alone allow.
"""

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402

HOOKS = ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end",
         "on_test_begin", "on_epoch_end", "on_train_end")


def clocked(callback, spent):
    """Wraps the callback's hooks so the time inside them adds to spent[0]."""
    for name in HOOKS:
        hook = getattr(callback, name)

        def timed(*args, _hook=hook, **kwargs):
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(callback, name, timed)
    return callback


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 steps")
    parser.add_argument("--plain", action="store_true",
                        help="a plain tf.data pipeline: the monitors instrument it themselves")
    add_out_argument(parser, "monitor_overhead")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 200

    rng = np.random.default_rng(0)
    x = rng.random((args.steps * args.batch_size, 128), dtype=np.float32)
    y = x[:, :1]
    lengths = rng.integers(100, 1000, len(x)).astype(np.int32)
    if args.plain:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).cache()
        ds = ds.prefetch(tf.data.AUTOTUNE)
    else:
        ds = kg.data.instrument(
            tf.data.Dataset.from_tensor_slices((x, y, lengths)).batch(args.batch_size).cache(),
            frames=lambda batch: batch[2], frames_per_second=22050 / 256,
        ).map(lambda x, y, lengths: (x, y)).prefetch(tf.data.AUTOTUNE)
    model = keras.Sequential([
        keras.Input((128,)),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile("adam", "mse", jit_compile=True)
    model.fit(ds, epochs=1, verbose=0)  # compile, fill the cache

    class Sync(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    ways = {
        "none": lambda: [],
        "sync": lambda: [Sync()],
        "monitors": lambda: [clocked(kg.StepTimer(), spent),
                             clocked(kg.GPUOscillationMonitor(verbose=0), spent),
                             clocked(kg.RetracingMonitor(verbose=0), spent)],
    }
    spent = [0.0]
    hook_share, hook_us, counted, waits = [], [], [], []

    def run(way):
        spent[0] = 0.0
        callbacks = ways[way]()
        start = time.perf_counter()
        model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
        elapsed = time.perf_counter() - start
        if way == "monitors":
            hook_share.append(spent[0] / elapsed)
            hook_us.append(spent[0] / args.steps * 1e6)
            summary = callbacks[0].summary()
            if not args.plain:  # a plain pipeline has no lengths: no real frames
                counted.append(summary["real_frames_per_s"] * summary["total_s"])
            waits.append(callbacks[1].report()["phases"]["input_wait"])
        return args.steps / elapsed

    vs_sync, vs_none = [], []
    names = list(ways)
    for r in range(args.rounds):
        order = names[r % 3:] + names[:r % 3]
        rates = {way: run(way) for way in order}
        vs_sync.append(rates["monitors"] / rates["sync"])
        vs_none.append(rates["monitors"] / rates["none"])
        print(f"round {r}: " + ", ".join(f"{w} {rates[w]:.1f}" for w in names)
              + f" steps/s; monitors/sync {vs_sync[-1]:.3f}, monitors/none {vs_none[-1]:.3f}")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, "
          f"TF {tf.__version__}, Keras {keras.__version__}, "
          f"devices {[d.device_type for d in tf.config.list_logical_devices()]}")
    print(f"median over {args.rounds} rounds of {args.steps} steps: monitors/sync "
          f"{statistics.median(vs_sync):.3f} (goal >= 0.98), monitors/none "
          f"{statistics.median(vs_none):.3f}")
    if counted:
        print(f"real frames counted by the monitors per epoch: {statistics.median(counted):.0f} "
              f"(the lengths column sums to {int(lengths.sum())})")
    print(f"input wait measured: {'not measured' if None in waits else f'{max(waits):.1%} at most'}"
          f" ({'plain tf.data' if args.plain else 'kg.data.instrument'})")
    share = statistics.median(hook_share)
    print(f"time inside the three callbacks' hooks: {statistics.median(hook_us):.1f} us/step, "
          f"{share:.2%} of fit wall time (goal <= 2%) -> the hooks allow a ratio of "
          f"{1 - share:.3f}")
    write_results(args.out, "monitor_overhead", {
        "hook_us_per_step": statistics.median(hook_us),
        "hook_share_of_fit_time": share,
        "ratio_steps_per_s_monitors_over_sync": statistics.median(vs_sync),
        "ratio_steps_per_s_monitors_over_none": statistics.median(vs_none),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "plain_pipeline": args.plain,
    }, details={"hook_share_per_round": hook_share, "monitors_over_sync_per_round": vs_sync})
    return 0


if __name__ == "__main__":
    sys.exit(main())
