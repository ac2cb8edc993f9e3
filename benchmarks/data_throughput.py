"""Input-path throughput: `kg.data.SpeechDatasetBuilder` against the usual loaders.

Measured side by side in one run on a generated LJSpeech-style corpus:

- naive: `tf.numpy_function` calling librosa (load + melspectrogram) per
  utterance, AUTOTUNE map, `padded_batch` (each batch padded to its longest
  clip), no cache: the common loader;
- compute limit: a bare Python loop of `kg.data.log_mel` (tf.signal STFT +
  mel matmul, one `tf.function`) over the same audio, decoded in memory
  beforehand;
- the builder: cold (empty cache: the cache build alone, and end to end:
  scan, parallel feature computation and cache write, `build()`, one
  epoch), warm (a new builder on the same cache: time to the
  first batch, then one epoch) and without cache (features computed in the
  pipeline every epoch).

Prints utterances/s, the ratios against the goals of issue 4, padding
efficiency and distinct batch shapes per epoch. Other processes on the
machine change absolute figures; the ratios come from the same run.

Usage:

    python benchmarks/data_throughput.py --utterances 1000
"""

import argparse
import os
import platform
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.data.corpus import Corpus  # noqa: E402

AUTOTUNE = tf.data.AUTOTUNE


def _epoch(dataset):
    """Iterates one epoch; returns (seconds, utterances, shapes, real, padded)."""
    start = time.perf_counter()
    count, shapes, real, padded = 0, set(), 0, 0
    for (ids, _), (mel, mel_len) in dataset:
        count += int(mel.shape[0])
        shapes.add((tuple(ids.shape), tuple(mel.shape)))
        real += int(tf.reduce_sum(mel_len))
        padded += int(mel.shape[0] * mel.shape[1])
    return time.perf_counter() - start, count, shapes, real, padded


def naive_dataset(utterances, config, batch_size):
    import librosa

    def features(path):
        y, _ = librosa.load(path.decode(), sr=config.sample_rate)
        mel = librosa.feature.melspectrogram(
            y=y, sr=config.sample_rate, n_fft=config.n_fft, hop_length=config.hop_length,
            win_length=config.win_length, center=config.center, power=config.power,
            n_mels=config.n_mels, fmin=config.fmin, fmax=config.fmax, norm="slaney",
            htk=config.mel_scale == "htk",
        )
        return np.log(np.maximum(mel, config.log_floor)).T.astype(np.float32)

    def load(path, text):
        mel = tf.numpy_function(features, [path], tf.float32)
        mel = tf.ensure_shape(mel, [None, config.n_mels])
        ids = tf.strings.unicode_decode(tf.strings.lower(text), "UTF-8")
        return (ids, tf.shape(ids)[0]), (mel, tf.shape(mel)[0])

    paths = [u.path for u in utterances]
    texts = [u.text for u in utterances]
    return (tf.data.Dataset.from_tensor_slices((paths, texts))
            .shuffle(len(paths), seed=0)
            .map(load, num_parallel_calls=AUTOTUNE)
            .padded_batch(batch_size)
            .prefetch(AUTOTUNE))


def compute_limit(utterances, config):
    """Seconds for a bare loop of log_mel over the audio, decoded beforehand."""
    waves = []
    for u in utterances:
        contents = tf.io.read_file(u.path)
        waves.append(kg.data.audio.decode_wav(contents, u.info.data_offset, u.info.data_bytes,
                                              u.info.format_code, u.info.channels))
    filterbank = kg.data.mel_filterbank(config)
    step = tf.function(lambda w: kg.data.log_mel(w, config, filterbank),
                       input_signature=[tf.TensorSpec([None], tf.float32)])
    step(waves[0]).numpy()  # trace once
    start = time.perf_counter()
    for wave in waves:
        step(wave).numpy()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-buckets", type=int, default=8)
    parser.add_argument("--workdir", default=None, help="kept when given; a temp dir otherwise")
    args = parser.parse_args(argv)

    workdir = args.workdir or tempfile.mkdtemp(prefix="kg_bench_")
    corpus = os.path.join(workdir, "corpus")
    cache_dir = os.path.join(workdir, "cache")
    config = kg.data.AudioConfig()
    try:
        start = time.perf_counter()
        if not os.path.exists(os.path.join(corpus, "metadata.csv")):
            kg.data.make_synthetic_corpus(corpus, args.utterances, seed=0)
        print(f"corpus: {args.utterances} utterances in {time.perf_counter() - start:.1f} s "
              f"({corpus})")
        shutil.rmtree(cache_dir, ignore_errors=True)
        utterances, _ = Corpus.from_ljspeech(corpus).scan()
        n = len(utterances)
        seconds = sum(u.info.seconds for u in utterances)

        naive_s, naive_n, naive_shapes, naive_real, naive_padded = _epoch(
            naive_dataset(utterances, config, args.batch_size))
        limit_s = compute_limit(utterances, config)

        start = time.perf_counter()
        cold = kg.data.SpeechDatasetBuilder(corpus, audio=config, cache_dir=cache_dir, verbose=0)
        scan_s = time.perf_counter() - start
        cold.prepare()
        cache_s = time.perf_counter() - start - scan_s
        cold_ds = cold.build(args.batch_size, args.num_buckets, seed=0)
        epoch_s, cold_n, cold_shapes, _, _ = _epoch(cold_ds)
        cold_s = time.perf_counter() - start
        assert cold.report["cache"] == "miss"

        start = time.perf_counter()
        warm = kg.data.SpeechDatasetBuilder(corpus, audio=config, cache_dir=cache_dir, verbose=0)
        warm_ds = warm.build(args.batch_size, args.num_buckets, seed=0)
        next(iter(warm_ds))
        first_batch = time.perf_counter() - start
        warm_s, warm_n, warm_shapes, warm_real, warm_padded = _epoch(warm_ds)
        assert warm.report["cache"] == "hit"

        nocache = kg.data.SpeechDatasetBuilder(corpus, audio=config, verbose=0)
        nocache_s, nocache_n, _, _, _ = _epoch(nocache.build(args.batch_size, args.num_buckets, seed=0))
        assert naive_n == cold_n == warm_n == nocache_n == n

        rate = lambda s: n / s  # noqa: E731
        print(f"machine: {platform.machine()} {os.cpu_count()} CPU cores, TensorFlow "
              f"{tf.__version__}, GPUs: {len(tf.config.list_physical_devices('GPU'))}")
        print(f"audio: {seconds / 3600:.2f} h in {n} utterances, batch {args.batch_size}, "
              f"{args.num_buckets} buckets")
        print()
        print(f"{'loader':44s} {'utt/s':>8s} {'seconds':>8s}")
        rows = [
            ("naive (numpy_function + librosa, pad to max)", naive_s),
            ("compute limit (bare tf.signal log-mel loop)", limit_s),
            ("builder, cold: cache build (features)", cache_s),
            ("builder, cold: scan+cache build+1st epoch", cold_s),
            ("builder, warm cache (one epoch)", warm_s),
            ("builder, no cache (features every epoch)", nocache_s),
        ]
        for name, s in rows:
            print(f"{name:44s} {rate(s):8.1f} {s:8.2f}")
        print()
        ratios = [
            ("cold cache build / naive", naive_s / cache_s, ">= 5"),
            ("cold cache build / compute limit", limit_s / cache_s, ">= 0.8"),
            ("cold end-to-end / naive", naive_s / cold_s, ">= 5"),
            ("cold end-to-end / compute limit", limit_s / cold_s, ">= 0.8"),
            ("warm builder / naive", naive_s / warm_s, "(info)"),
            ("no-cache builder / naive", naive_s / nocache_s, "(info)"),
        ]
        for name, value, goal in ratios:
            print(f"{name:44s} {value:8.2f}x  goal {goal}")
        print(f"{'cold: scan, build()+1st epoch seconds':44s} {scan_s:8.2f} {epoch_s:8.2f}")
        print(f"{'warm start: time to first batch':44s} {first_batch:8.2f} s  goal <= 2 s "
              f"for 1,000 utterances")
        print(f"{'padding efficiency, builder':44s} {warm_real / warm_padded:8.3f}   goal >= 0.90 "
              f"(report: {warm.report['padding_efficiency']})")
        print(f"{'padding efficiency, naive pad-to-max':44s} {naive_real / naive_padded:8.3f}")
        print(f"{'distinct batch shapes/epoch, builder':44s} {len(warm_shapes):8d}   goal <= "
              f"{args.num_buckets + 1} (cold epoch: {len(cold_shapes)})")
        print(f"{'distinct batch shapes/epoch, naive':44s} {len(naive_shapes):8d}")
        print(f"bucket boundaries (frames): {warm.report['bucket_boundaries']}")
        print(f"text boundaries (ids): {warm.report['text_boundaries']}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
