"""The builder without a cache against a hand-written TF loader, same features.

    python benchmarks/no_cache_loader.py [--utterances 300] [--rounds 3]

The hand-written loader is keras-io's CTC ASR input pipeline: per file
`tf.io.read_file`, `tf.audio.decode_wav`, `tf.signal.stft(256, 160, 384)`,
`|.| ** 0.5`, each frame normalised across frequency, `padded_batch(32)`,
AUTOTUNE map. The builder computes the same features
(`AudioConfig(n_fft=384, win_length=256, hop_length=160, center=False,
features="linear", power=0.5, log=None, feature_norm="frame")`, checked
against that code in `tests/test_data_audio.py`) in its pipeline every
epoch (`cache_dir=None`), `build(batch_size=32, num_buckets=8)`. Both read
the same generated 16 kHz 16-bit WAVs (1-6 s); the two loaders alternate
for `--rounds` epochs each and keep their best epoch (other work on a
shared machine slows both alike). A third row times the builder with the
log linear spectrogram (`log="floor"`, computed in float64 as librosa
does), the configuration a port uses when it keeps the builder's defaults.
Last, the cost of that precision alone: the builder's STFT magnitude
(`kg.data.audio._magnitude`, this configuration) of a 4 s clip in float32
(what `log=None` uses) and float64, in a `tf.function`, 200 calls each.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.data import audio as audio_lib  # noqa: E402
from keras_gpufix.data.synthetic import _speech, write_wav  # noqa: E402

__all__ = ["main"]

CTC = kg.data.AudioConfig(sample_rate=16000, n_fft=384, hop_length=160, win_length=256,
                          center=False, features="linear", power=0.5, log=None,
                          feature_norm="frame", pad_value=0.0)
LOG_LINEAR = kg.data.AudioConfig(sample_rate=16000, n_fft=384, hop_length=160, win_length=256,
                                 center=False, features="linear", pad_value=0.0)


def _keras_io_ctc_loader(paths, texts, batch_size):
    """keras-io's "Automatic Speech Recognition using CTC" input pipeline."""
    chars = list("abcdefghijklmnopqrstuvwxyz'?! ")
    char_to_num = tf.keras.layers.StringLookup(vocabulary=chars, oov_token="")

    def encode_single_sample(wav_file, label):
        audio, _ = tf.audio.decode_wav(tf.io.read_file(wav_file))
        audio = tf.cast(tf.squeeze(audio, axis=-1), tf.float32)
        spectrogram = tf.signal.stft(audio, frame_length=256, frame_step=160, fft_length=384)
        spectrogram = tf.math.pow(tf.abs(spectrogram), 0.5)
        means = tf.math.reduce_mean(spectrogram, 1, keepdims=True)
        stddevs = tf.math.reduce_std(spectrogram, 1, keepdims=True)
        spectrogram = (spectrogram - means) / (stddevs + 1e-10)
        label = char_to_num(tf.strings.unicode_split(tf.strings.lower(label), input_encoding="UTF-8"))
        return spectrogram, label

    dataset = tf.data.Dataset.from_tensor_slices((paths, texts))
    return (dataset.map(encode_single_sample, num_parallel_calls=tf.data.AUTOTUNE)
            .padded_batch(batch_size).prefetch(buffer_size=tf.data.AUTOTUNE))


def _stft_ms(dtype, calls=200):
    """Milliseconds per 4 s clip of the builder's STFT magnitude in `dtype`."""
    clip = tf.constant(np.random.default_rng(0).standard_normal(4 * 16000), tf.float32)
    magnitude = tf.function(lambda y: audio_lib._magnitude(y, CTC, dtype))
    magnitude(clip)
    start = time.perf_counter()
    for _ in range(calls):
        magnitude(clip)
    return 1e3 * (time.perf_counter() - start) / calls


def _epoch_seconds(dataset):
    start = time.perf_counter()
    count = sum(int(tf.shape(tf.nest.flatten(batch)[0])[0]) for batch in dataset)
    return time.perf_counter() - start, count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "no_cache_loader")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        pairs = []
        for i in range(args.utterances):
            path = os.path.join(folder, f"utt{i:05d}.wav")
            write_wav(path, _speech(rng, float(rng.uniform(1.0, 6.0)), 16000), 16000)
            pairs.append((path, "a transcript of the clip"))
        loaders = {
            "keras_io_ctc": _keras_io_ctc_loader([p for p, _ in pairs], [t for _, t in pairs],
                                                 args.batch_size),
            "builder_no_cache": kg.data.SpeechDatasetBuilder(pairs, audio=CTC, verbose=0).build(
                batch_size=args.batch_size, num_buckets=8, seed=0),
            "builder_no_cache_log_linear": kg.data.SpeechDatasetBuilder(
                pairs, audio=LOG_LINEAR, verbose=0).build(batch_size=args.batch_size,
                                                          num_buckets=8, seed=0),
        }
        best = {name: float("inf") for name in loaders}
        for name, dataset in loaders.items():  # warm up: traces, file cache
            _epoch_seconds(dataset)
        for _ in range(args.rounds):
            for name, dataset in loaders.items():
                seconds, count = _epoch_seconds(dataset)
                assert count == args.utterances, (name, count)
                best[name] = min(best[name], seconds)
    figures = {f"{name}_utterances_per_s": round(args.utterances / s, 1)
               for name, s in best.items()}
    ratio = best["keras_io_ctc"] / best["builder_no_cache"]
    figures["ratio_builder_no_cache_over_keras_io"] = round(ratio, 2)
    stft = {name: _stft_ms(dtype) for name, dtype in (("float32", tf.float32),
                                                      ("float64", tf.float64))}
    figures.update({f"stft_ms_per_4s_clip_{name}": round(ms, 2) for name, ms in stft.items()})
    print(f"{args.utterances} clips of 1-6 s, 16 kHz, batch {args.batch_size}, best of "
          f"{args.rounds} epochs each")
    for name, s in best.items():
        print(f"{name:<28} {args.utterances / s:8.1f} utt/s")
    print(f"builder without cache / keras-io CTC loader: {ratio:.2f}x")
    print(f"STFT magnitude of a 4 s clip: {stft['float32']:.2f} ms in float32, "
          f"{stft['float64']:.2f} ms in float64 ({stft['float64'] / stft['float32']:.2f}x)")
    write_results(args.out, "no_cache_loader", figures,
                  {"utterances": args.utterances, "batch_size": args.batch_size,
                   "rounds": args.rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
