"""Fixed batch size against batches by audio budget (`build(batch_frames=)`).

    python benchmarks/batch_frames.py [--utterances 400] [--batch-size 8] [--epochs 4]

A generated corpus (16 kHz, clips of 0.5-8 s, log-normal like read speech)
is cached once; then, side by side in one run, the same model trains on
`build(batch_size=B)` and on `build(batch_frames=B x longest clip's
frames, batch_multiple=...)`: the same largest batch (so the same peak
memory), but the short buckets carry as many frames as the long ones. The
model is a small Conv1D stack over the log-mel frames (its cost grows with
the padded frames, as a speech model's does), `jit_compile=True`; the first
epoch compiles every bucket shape and is not timed, then the two layouts
alternate epoch by epoch (other work on a shared machine slows both alike)
and each keeps its best epoch. Prints and writes utterances/s, steps per
epoch, mean batch size, padded-frame efficiency and distinct shapes.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.data.synthetic import _speech, write_wav  # noqa: E402

__all__ = ["main"]

SAMPLE_RATE = 16000
AUDIO = kg.data.AudioConfig(sample_rate=SAMPLE_RATE, n_fft=512, hop_length=160, win_length=400,
                            n_mels=40, fmax=None)


def _corpus(folder, count, seed):
    """`count` (wav_path, text) pairs, 0.5-8 s log-normal around 2.5 s."""
    rng = np.random.default_rng(seed)
    seconds = np.clip(rng.lognormal(np.log(2.5), 0.6, count), 0.5, 8.0)
    pairs = []
    for i, length in enumerate(seconds):
        path = os.path.join(folder, f"utt{i:05d}.wav")
        write_wav(path, _speech(rng, float(length), SAMPLE_RATE), SAMPLE_RATE)
        pairs.append((path, "a short transcript " * int(1 + length)))
    return pairs


def _model():
    inputs = keras.Input((None, AUDIO.n_mels))
    x = keras.layers.Conv1D(128, 5, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv1D(128, 5, padding="same", activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(AUDIO.n_mels)(x))
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    return model


def _layout(builder, **build_kwargs):
    dataset = builder.build(num_buckets=6, seed=0, **build_kwargs)
    report = builder.report
    sizes = report["batch_sizes"]
    return {
        "dataset": dataset.map(lambda inputs, targets: (targets[0], targets[0])),
        "model": _model(),
        "steps": report["batches_per_epoch"],
        "mean_batch": report["utterances"] / report["batches_per_epoch"],
        "padding_efficiency": report["padding_efficiency"],
        "distinct_shapes": report["distinct_shapes"],
        "batch_sizes": sizes,
        "best_s": float("inf"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batch-multiple", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs of each layout")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "batch_frames")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        pairs = _corpus(folder, args.utterances, args.seed)
        builder = kg.data.SpeechDatasetBuilder(pairs, audio=AUDIO,
                                               cache_dir=os.path.join(folder, "cache"),
                                               verbose=0)
        layouts = {"fixed": _layout(builder, batch_size=args.batch_size)}
        budget = args.batch_size * builder.report["bucket_boundaries"][-1]
        layouts["batch_frames"] = _layout(builder, batch_frames=budget,
                                          batch_multiple=args.batch_multiple)
        for layout in layouts.values():  # compile every bucket shape
            layout["model"].fit(layout["dataset"], epochs=1, verbose=0)
        for _ in range(args.epochs):
            for layout in layouts.values():
                start = time.perf_counter()
                layout["model"].fit(layout["dataset"], epochs=1, verbose=0)
                layout["best_s"] = min(layout["best_s"], time.perf_counter() - start)
    count = builder.report["utterances"]
    print(f"{count} clips of 0.5-8 s (16 kHz, 40 mels), 6 buckets; fixed batch {args.batch_size} "
          f"vs batch_frames={budget} (= {args.batch_size} x the longest clip's frames), "
          f"batch_multiple={args.batch_multiple}")
    print(f"{'layout':<13} {'utt/s':>8} {'steps':>6} {'mean batch':>11} {'real frames':>12} "
          f"{'shapes':>7}  batch sizes")
    figures = {}
    for name, layout in layouts.items():
        rate = count / layout["best_s"]
        print(f"{name:<13} {rate:>8.1f} {layout['steps']:>6} {layout['mean_batch']:>11.1f} "
              f"{layout['padding_efficiency']:>12.3f} {layout['distinct_shapes']:>7}  "
              f"{layout['batch_sizes']}")
        figures.update({
            f"{name}_utterances_per_s": round(rate, 1),
            f"{name}_steps_per_epoch": layout["steps"],
            f"{name}_mean_batch": round(layout["mean_batch"], 2),
            f"{name}_padding_efficiency": layout["padding_efficiency"],
            f"{name}_distinct_shapes": layout["distinct_shapes"],
        })
    ratio = figures["batch_frames_utterances_per_s"] / figures["fixed_utterances_per_s"]
    figures["speedup_batch_frames_over_fixed"] = round(ratio, 2)
    print(f"batch_frames trains {ratio:.2f}x the utterances/s of a fixed batch, "
          f"{layouts['fixed']['steps'] / layouts['batch_frames']['steps']:.2f}x fewer steps")
    write_results(args.out, "batch_frames", figures,
                  {"utterances": count, "batch_size": args.batch_size, "batch_frames": budget,
                   "batch_multiple": args.batch_multiple, "epochs": args.epochs,
                   "batch_sizes": {n: layout["batch_sizes"] for n, layout in layouts.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
