"""A deliberately slow speech loader, for `keras-gpufix diagnose` to catch.

    keras-gpufix diagnose -- python examples/diagnose_slow_loader.py
    keras-gpufix diagnose -- python examples/diagnose_slow_loader_fixed.py

The pattern of many TTS/ASR repositories: every epoch, every clip is read and
turned into a log-mel spectrogram by Python (NumPy here; librosa in the wild)
inside `tf.numpy_function`, in a `map` without parallelism or prefetch, and
each batch is padded to its longest clip. The model is light, so the step
waits for the input: on a GPU that is the 2-40% utilisation swing.
`examples/diagnose_slow_loader_fixed.py` is the same training with the input
path of `kg.data.SpeechDatasetBuilder` (TF-native features computed once
into a cache, length buckets, prefetch); the model and `compile` are the
same.
"""

import argparse
import os
import wave

import keras
import numpy as np
import tensorflow as tf

import keras_gpufix as kg

CONFIG = kg.data.AudioConfig()  # 22050 Hz, n_fft 1024, hop 256, 80 Slaney mels
FILTERBANK = kg.data.mel_filterbank(CONFIG)  # (n_fft // 2 + 1, n_mels)


def corpus_dir(root):
    path = os.path.join(root, "corpus")
    if not os.path.exists(os.path.join(path, "metadata.csv")):
        kg.data.make_synthetic_corpus(path, 96, seed=0, min_seconds=1.0, max_seconds=4.0)
    return path


def read_metadata(path):
    with open(os.path.join(path, "metadata.csv"), encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("|") for line in f if line.strip()]
    return [os.path.join(path, "wavs", r[0] + ".wav") for r in rows]


def python_log_mel(path):
    """Read the WAV and compute the log-mel in Python, per clip, every epoch."""
    with wave.open(path.decode(), "rb") as f:
        audio = np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768
    audio = np.pad(audio, CONFIG.n_fft // 2, mode="constant")
    window = np.hanning(CONFIG.n_fft + 1)[:-1].astype(np.float32)
    frames = [audio[i:i + CONFIG.n_fft] * window
              for i in range(0, len(audio) - CONFIG.n_fft + 1, CONFIG.hop_length)]
    spectrum = np.abs(np.fft.rfft(np.stack(frames), axis=-1))
    return np.log(np.maximum(spectrum @ FILTERBANK, CONFIG.log_floor)).astype(np.float32)


def dataset(corpus, batch_size):
    def load(path):
        mel = tf.numpy_function(python_log_mel, [path], tf.float32)
        mel = tf.ensure_shape(mel, [None, CONFIG.n_mels])
        return mel, tf.cast(tf.shape(mel)[0], tf.float32) / 100.0  # target: duration

    paths = read_metadata(corpus)
    return tf.data.Dataset.from_tensor_slices(paths).shuffle(len(paths)).map(load) \
        .padded_batch(batch_size, padding_values=(float(np.log(CONFIG.log_floor)), 0.0))


def build_model():
    model = keras.Sequential([
        keras.Input((None, CONFIG.n_mels)),
        keras.layers.Conv1D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])
    model.compile("adam", "mse")
    return model


def parse_args(description):
    """The arguments both twins take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dir", default="runs/slow_loader", help="corpus (generated) and cache")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    return parser.parse_args()


def main():
    args = parse_args(__doc__.splitlines()[0])
    train = dataset(corpus_dir(args.dir), args.batch_size)
    build_model().fit(train, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
