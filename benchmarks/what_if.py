"""diagnose's what-if checked against the truth, on the held-out kinds of input.

    python benchmarks/what_if.py [--quick] [--cases ...] [--out PATH]
    (about 12 min on 2 loaded cores; --quick about 8)

For each case (a custom loop with a `tf.function` step, and `model.fit`,
each on four kinds of input):
1. `keras-gpufix diagnose --json --no-trace -- python benchmarks/what_if.py
   --child CASE` gives the prediction: `what_if.speedup_if_input_free`,
   its `speedup_range` and whether it is `known`;
2. the truth: the same script run plainly, with the same model and step
   run alternately on its real input and on a cached, prefetched in-memory copy of it
   (the same batches, read once before the timed runs), six pairs of runs
   in the order real, cached, cached, real, ...; the true speedup is the
   median over the pairs of the real run's mean cycle over the cached
   run's beside it (each timed by the script itself, the first cycles left
   out), its range the pairs' extremes.
Prints both side by side with the error, and writes them to `--out`
(default `benchmarks/results/what_if.json`). The goal: within 25%, or the
what-if says it does not know (`known` False).

Kinds of input:
- `cached`: a NumPy STFT per utterance in `tf.numpy_function` (the
  librosa-in-the-loader habit), `.cache()`d and read once before training,
  feeding a small model: the input is already free (true ~1.0; the what-if
  used to promise 1.17x-1.37x here);
- `input`: the same NumPy map, not cached, one call at a time: input-bound;
- `contention`: the same NumPy map with `num_parallel_calls=AUTOTUNE`
  feeding a heavier model: the input keeps up (its wait reads ~0), but its
  Python/NumPy work competes with the step for the cores;
- `compute`: precomputed features from memory (shuffle, batch, prefetch)
  feeding the heavier model: compute-bound (true ~1.0).
"""

import argparse
import json
import os
import statistics
import sys
import time

from _results import add_out_argument, run_stdout, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("cached", "input", "contention", "compute")
CASES = tuple(f"{loop}-{kind}" for kind in KINDS for loop in ("loop", "fit"))
SKIP = 5  # cycles left out at the start (trace, compile, pipeline start-up)
ROUNDS = 6  # pairs of a cached and a real run beside it, after the first real run


def _features(wave):
    """What a librosa loader does, in NumPy: a log-power STFT of one utterance."""
    import numpy as np

    frames = np.lib.stride_tricks.sliding_window_view(wave, 400)[::160]
    spec = np.abs(np.fft.rfft(frames * np.hanning(400), n=512))
    return np.log(spec[:, :80] ** 2 + 1e-6).astype("float32")


def _dataset(case, steps):
    import numpy as np
    import tensorflow as tf

    kind = case.split("-")[1]
    rng = np.random.default_rng(0)
    waves = rng.standard_normal((64, 16000)).astype("float32")  # 1 s at 16 kHz
    if kind == "compute":
        ds = tf.data.Dataset.from_tensor_slices(np.stack([_features(w) for w in waves]))
        ds = ds.shuffle(64).repeat()
    else:
        parallel = tf.data.AUTOTUNE if kind == "contention" else None
        ds = tf.data.Dataset.from_tensor_slices(waves).repeat().map(
            lambda w: tf.ensure_shape(tf.numpy_function(_features, [w], tf.float32), [98, 80]),
            num_parallel_calls=parallel)
    ds = ds.map(lambda f: (f, tf.reduce_mean(f, axis=[0, 1])[None]))
    ds = ds.batch(16, drop_remainder=True).take(steps)
    if kind == "cached":
        ds = ds.cache()
        for _ in ds:  # read once: training reads memory
            pass
    return ds.prefetch(2)


def _model(case):
    import keras

    width = 128 if case.split("-")[1] in ("contention", "compute") else 64
    return keras.Sequential([
        keras.Input((98, 80)), keras.layers.Conv1D(width, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(width, 5, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def child(case, steps, truth):
    """Runs `case` once on its real input; with `truth`, then alternately on a cached copy.

    Prints `{"real_ms": [...], "cached_ms": [...]}` (mean steady cycle of each run) as
    its last line. Alternating real and cached runs in one process keeps a
    change in the machine's load from reading as a speedup.
    """
    import keras
    import tensorflow as tf

    real = _dataset(case, steps)
    # the same batches, in memory (read once before the timed runs), prefetched: input free
    cached = real.cache().prefetch(2)
    if truth:
        for _ in cached:
            pass
    model = _model(case)
    if case.startswith("fit"):
        model.compile("adam", "mse", jit_compile=True)

        def run(ds):
            begins = []

            class Clock(keras.callbacks.Callback):
                def on_train_batch_begin(self, batch, logs=None):
                    begins.append(time.perf_counter())

            model.fit(ds, epochs=1, verbose=0, callbacks=[Clock()])
            return begins + [time.perf_counter()]
    else:
        opt = keras.optimizers.Adam()
        loss_fn = keras.losses.MeanSquaredError()

        @tf.function(jit_compile=True)
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        def run(ds):
            begins = []
            for x, y in ds:
                begins.append(time.perf_counter())
                train_step(x, y)
            return begins + [time.perf_counter()]

    def cycle_ms(begins):
        return 1000 * statistics.fmean([b - a for a, b in zip(begins, begins[1:])][SKIP:])

    out = {"real_ms": [cycle_ms(run(real))], "cached_ms": []}
    for i in range(ROUNDS if truth else 0):  # real, cached, cached, real, real, ...
        for ds, key in ((cached, "cached_ms"), (real, "real_ms"))[::1 if i % 2 else -1]:
            out[key].append(cycle_ms(run(ds)))
    print(json.dumps(out))


def _run(command):
    """The last stdout line of `command`, as JSON."""
    return json.loads(run_stdout(command).strip().splitlines()[-1])


def measure(case, steps):
    """(diagnose's report, true speedup, its range, real and cached cycle ms) of one case.

    The truth is the median over the pairs of a real run and the cached run
    beside it (real, cached, cached, real, ...: on a shared machine whose
    load changes from second to second, each pair sees the same load) of
    real cycle / cached cycle; its range is the pairs' extremes. The first
    real run (it compiles) is left out.
    """
    me = [sys.executable, os.path.relpath(os.path.abspath(__file__), ROOT), "--child", case,
          "--steps", str(steps)]
    report = _run([sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
                   "--", *me])
    runs = _run([*me, "--truth"])
    pairs = sorted(r / c for r, c in zip(runs["real_ms"][1:], runs["cached_ms"]))
    return (report, statistics.median(pairs), (pairs[0], pairs[-1]),
            statistics.median(runs["real_ms"][1:]), statistics.median(runs["cached_ms"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per run")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="the cases to run (default: all)")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--truth", action="store_true", help=argparse.SUPPRESS)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    add_out_argument(parser, "what_if")
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 100)
    if args.child:
        child(args.child, steps, args.truth)
        return 0
    figures, details = {}, {}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} "
          "cores", flush=True)
    for case in args.cases:
        report, truth, (true_low, true_high), real, cached = measure(case, steps)
        predicted = report.get("what_if") or {}
        z = predicted.get("speedup_if_input_free")
        low, high = predicted.get("speedup_range") or (None, None)
        known = bool(z) and predicted.get("known", True)
        error = abs(z - truth) / truth if z else None
        key = case.replace("-", "_")
        figures[f"{key}_predicted_speedup_if_input_free"] = z and round(z, 3)
        figures[f"{key}_predicted_known"] = known
        figures[f"{key}_true_speedup_cached_over_real"] = round(truth, 3)
        figures[f"{key}_true_range_low"] = round(true_low, 3)
        figures[f"{key}_true_range_high"] = round(true_high, 3)
        figures[f"{key}_error_fraction"] = error and round(error, 3)
        details[case] = {"what_if": predicted, "verdict": report.get("verdict"),
                         "input_wait": (report.get("fits") or [{}])[0].get("monitor", {}).get(
                             "input_wait"),
                         "real_cycle_ms": real, "cached_cycle_ms": cached}
        span = f"{low or 0:.2f}-{high or float('inf'):.2f}"
        print(f"{case:15} predicted {z or float('nan'):5.2f}x ({span}, "
              f"{'known' if known else 'does not know'})  true {truth:5.2f}x "
              f"({true_low:.2f}-{true_high:.2f})  "
              f"(real {real:6.1f} ms vs cached {cached:6.1f} ms per batch)  "
              f"error {100 * (error or float('nan')):5.1f}%  verdict {report.get('verdict')} "
              f"[{predicted.get('method')}]", flush=True)
    errors = [figures[f"{c.replace('-', '_')}_error_fraction"] for c in args.cases
              if figures[f"{c.replace('-', '_')}_predicted_known"]]
    figures["max_error_fraction_known"] = max(errors) if errors else None
    figures["cases_known"] = len(errors)
    figures["cases_within_25_percent_or_unknown"] = sum(
        1 for c in args.cases if not figures[f"{c.replace('-', '_')}_predicted_known"]
        or figures[f"{c.replace('-', '_')}_error_fraction"] <= 0.25)
    figures["cases"] = len(args.cases)
    details["steps_per_run"] = steps
    write_results(args.out, "what_if", figures, details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
