"""STFT magnitude: `tf.math.abs` of the complex spectrum against `sqrt(re**2 + im**2)`.

`kg.data`'s spectrograms (`_magnitude` in `keras_gpufix/data/audio.py`)
take `|STFT| ** power` from the squared magnitude. This benchmark times,
side by side in one run, the whole magnitude of `--clips` clips of
`--seconds` seconds (pad, frame, Hann window, rfft, magnitude, cast), in
float32 (the log-mel path) and float64 (the log linear path, librosa
parity), with the two ways of taking the magnitude (the builder's own
`_magnitude`, and the same steps ending in `tf.math.abs`), one clip per
`tf.function` call as the dataset builder computes them. Each way keeps its
best of `--rounds` interleaved rounds; prints CPU ms per clip (process time,
all threads), the ratio, and the largest relative difference of the two
results.

Usage:

    python benchmarks/spectrogram_magnitude.py
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402

from keras_gpufix.data import audio as audio_lib  # noqa: E402

__all__ = ["main"]


def magnitude_with_abs(waveform, config, dtype):
    """`|STFT|` of one clip as `audio._magnitude` computed it before: the
    same pad, frames, window and rfft, then the complex `tf.math.abs`."""
    pad = config.n_fft // 2
    frames = tf.signal.frame(tf.cast(tf.pad(waveform, [[pad, pad]]), dtype), config.n_fft,
                             config.hop_length)
    spectrum = tf.signal.rfft(frames * audio_lib._window(config, dtype), fft_length=[config.n_fft])
    return tf.cast(tf.math.abs(spectrum), tf.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    add_out_argument(parser, "spectrogram_magnitude")
    args = parser.parse_args(argv)
    config = audio_lib.AudioConfig()
    rng = np.random.default_rng(0)
    samples = int(args.seconds * config.sample_rate)
    clips = [tf.constant((0.1 * rng.standard_normal(samples)).astype(np.float32))
             for _ in range(args.clips)]
    ways = {(dtype.name, use_abs): tf.function(
                lambda w, d=dtype, f=(magnitude_with_abs if use_abs else audio_lib._magnitude):
                    f(w, config, d),
                input_signature=[tf.TensorSpec([None], tf.float32)])
            for dtype in (tf.float32, tf.float64) for use_abs in (True, False)}
    best = {key: float("inf") for key in ways}
    for _ in range(args.rounds):
        for key, fn in ways.items():
            fn(clips[0]).numpy()
            start = time.process_time()
            for clip in clips:
                fn(clip).numpy()
            best[key] = min(best[key], (time.process_time() - start) * 1e3 / len(clips))
    figures = {}
    print(f"{args.clips} clips of {args.seconds} s, n_fft {config.n_fft}, hop {config.hop_length}")
    for dtype in ("float32", "float64"):
        with_abs, with_squares = best[(dtype, True)], best[(dtype, False)]
        a, b = ways[(dtype, True)](clips[0]).numpy(), ways[(dtype, False)](clips[0]).numpy()
        difference = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-30)))
        print(f"{dtype}: tf.math.abs {with_abs:.3f} CPU ms/clip, sqrt of squares "
              f"{with_squares:.3f}: {with_abs / with_squares:.2f}x faster; largest relative "
              f"difference {difference:.1e}")
        figures.update({
            f"{dtype}_abs_cpu_ms_per_clip": round(with_abs, 3),
            f"{dtype}_squares_cpu_ms_per_clip": round(with_squares, 3),
            f"{dtype}_ratio_abs_over_squares": round(with_abs / with_squares, 2),
            f"{dtype}_max_relative_difference": difference,
        })
    write_results(args.out, "spectrogram_magnitude", figures,
                  {"clips": args.clips, "seconds": args.seconds, "rounds": args.rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
