"""diagnose's what-if checked against the truth, on an input-bound and a compute-bound loop.

    python benchmarks/what_if.py [--quick] [--out PATH]   (about 3 min on 2 cores; --quick 1.5)

For each case (a custom loop with a `tf.function` step, and `model.fit`;
each with a slow input and with a heavy step):
1. `keras-gpufix diagnose --json --no-trace -- python benchmarks/what_if.py
   --child CASE` gives the prediction: `what_if.speedup_if_input_free`;
2. the truth: the same script run plainly, with the same model and step
   run alternately on its real input and on a cached in-memory copy of it
   (the same batches, read once before the timed runs), three times each;
   the true speedup is the fastest real run's mean cycle over the fastest
   cached run's (each timed by the script itself, the first cycles left out).
Prints both and the error, and writes them to `--out` (default
`benchmarks/results/what_if.json`). The goal: within 25%.

Cases: `input` — a NumPy STFT per utterance in `tf.numpy_function` (the
librosa-in-the-loader habit) feeding a small model; `compute` — log-mel
features in TF ops (parallel map, prefetch) feeding a model whose step
takes most of the time, so the input competes with the step for the cores.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("loop-input", "loop-compute", "fit-input", "fit-compute")
SKIP = 5  # cycles left out at the start (trace, compile, pipeline start-up)
ROUNDS = 3  # cached and real runs, alternated, after the first real run


def _dataset(case, steps):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    waves = rng.standard_normal((64, 16000)).astype("float32")  # 1 s at 16 kHz

    def numpy_features(wave):  # what a librosa loader does, in NumPy
        frames = np.lib.stride_tricks.sliding_window_view(wave, 400)[::160]
        spec = np.abs(np.fft.rfft(frames * np.hanning(400), n=512))
        return np.log(spec[:, :80] ** 2 + 1e-6).astype("float32")

    def tf_features(wave):
        spec = tf.abs(tf.signal.stft(wave, 400, 160, fft_length=512))
        return tf.math.log(tf.square(spec[:, :80]) + 1e-6)

    ds = tf.data.Dataset.from_tensor_slices(waves).repeat()
    if case.endswith("input"):
        ds = ds.map(lambda w: tf.ensure_shape(
            tf.numpy_function(numpy_features, [w], tf.float32), [98, 80]))
        batch = 16
    else:
        ds = ds.map(tf_features, num_parallel_calls=tf.data.AUTOTUNE)
        batch = 32
    ds = ds.map(lambda f: (f, tf.reduce_mean(f, axis=[0, 1])[None]))
    return ds.batch(batch, drop_remainder=True).take(steps).prefetch(2)


def _model(case):
    import keras

    width = 64 if case.endswith("input") else 128
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
    cached = real.cache()  # the same batches, in memory, read once before the timed runs
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
    for _ in range(ROUNDS if truth else 0):
        out["cached_ms"].append(cycle_ms(run(cached)))
        out["real_ms"].append(cycle_ms(run(real)))
    print(json.dumps(out))


def _run(command):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(case, steps):
    """(prediction dict, true speedup, real and cached cycle ms) of one case.

    The truth is the fastest real cycle over the fastest cached cycle (on a
    shared machine the fastest run is the least disturbed one, as `timeit`
    takes the best); the first real run (it compiles) is left out.
    """
    me = [sys.executable, os.path.relpath(os.path.abspath(__file__), ROOT), "--child", case,
          "--steps", str(steps)]
    report = _run([sys.executable, "-m", "keras_gpufix", "diagnose", "--json", "--no-trace",
                   "--", *me])
    runs = _run([*me, "--truth"])
    real = min(runs["real_ms"][1:])
    cached = min(runs["cached_ms"])
    return report["what_if"] or {}, real / cached, real, cached


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per run")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="the cases to run (default: all)")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--truth", action="store_true", help=argparse.SUPPRESS)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_out_argument, write_results

    add_out_argument(parser, "what_if")
    args = parser.parse_args(argv)
    steps = args.steps or (40 if args.quick else 80)
    if args.child:
        child(args.child, steps, args.truth)
        return 0
    figures, details = {}, {}
    for case in args.cases:
        predicted, truth, real, cached = measure(case, steps)
        z = predicted.get("speedup_if_input_free")
        error = abs(z - truth) / truth if z else None
        key = case.replace("-", "_")
        figures[f"{key}_predicted_speedup_if_input_free"] = z and round(z, 3)
        figures[f"{key}_true_speedup_cached_over_real"] = round(truth, 3)
        figures[f"{key}_error_fraction"] = error and round(error, 3)
        details[case] = {"what_if": predicted, "real_cycle_ms": real, "cached_cycle_ms": cached}
        print(f"{case:13} predicted {z or float('nan'):6.2f}x  true {truth:6.2f}x "
              f"(real {real:6.1f} ms vs cached {cached:6.1f} ms per batch)  "
              f"error {100 * (error or float('nan')):5.1f}%  "
              f"[input {predicted.get('input_batches_per_s') or 0:.1f}/s, "
              f"step {predicted.get('step_batches_per_s') or 0:.1f}/s, "
              f"bound {predicted.get('bound')}]", flush=True)
    errors = [v for k, v in figures.items() if k.endswith("error_fraction") and v is not None]
    figures["max_error_fraction"] = max(errors) if errors else None
    details["steps_per_run"] = steps
    write_results(args.out, "what_if", figures, details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
