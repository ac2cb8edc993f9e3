"""The naive speech loader: the baseline the demo and benchmarks measure against.

What most TTS repositories start from: read `metadata.csv`, then per clip a
`tf.numpy_function` that reads the WAV with Python's `wave` module and
computes the spectrogram with NumPy every epoch (frames, Hann window,
`np.fft.rfft`, the mel filterbank; the same steps as `librosa.load` and
`librosa.feature.melspectrogram`, and as them trimming, peak normalisation
or linear features where the `AudioConfig` asks; map with AUTOTUNE
parallelism), `padded_batch` (each batch padded to its longest clip, no
length buckets), `kg.data.instrument` (so the monitors see its input wait,
as `keras-gpufix diagnose` does for any dataset, and each batch's real frames:
how much of it is padding), prefetch. Features match
`kg.data.AudioConfig`'s (librosa-compatible filterbank, same log floor), so
the two paths train the same model on the same numbers; only the input path
differs.

It needs nothing beyond the package's own dependencies (NumPy, TensorFlow),
so `keras-gpufix demo` runs on a plain install. It reads 8-, 16- and 32-bit
integer PCM WAVs (what `wave` reads; several channels are averaged, another
rate is resampled linearly), as a training script built on `wave` does.
`keras-gpufix demo` and `benchmarks/end_to_end.py` use it.
"""

import os
import wave

import numpy as np

__all__ = ["naive_dataset"]

_PCM = {1: np.uint8, 2: np.int16, 4: np.int32}


def _read_wav(path, sample_rate):
    """float32 mono samples in [-1, 1] at `sample_rate` (`wave` + NumPy)."""
    with wave.open(path, "rb") as f:
        width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
        if width not in _PCM:
            raise ValueError(f"{path}: {8 * width}-bit PCM; the naive loader reads 8, 16 or "
                             "32-bit integer PCM")
        data = f.readframes(f.getnframes())
    usable = len(data) // (width * channels) * width * channels  # a truncated last frame
    y = np.frombuffer(data[:usable], _PCM[width]).astype(np.float32)
    y = (y - 128.0) / 128.0 if width == 1 else y / float(2 ** (8 * width - 1))
    y = y.reshape(-1, channels).mean(axis=1)
    if rate != sample_rate and len(y):
        n = int(round(len(y) * sample_rate / rate))
        y = np.interp(np.arange(n) * (rate / sample_rate), np.arange(len(y)), y)
    return y.astype(np.float32)


def _frames(y, n_fft, hop_length, center):
    if center:
        y = np.pad(y, n_fft // 2)
    if len(y) < n_fft:
        return np.zeros((0, n_fft), y.dtype)
    return np.lib.stride_tricks.sliding_window_view(y, n_fft)[::hop_length]


def _trim(y, top_db, n_fft, hop_length):
    """`librosa.effects.trim(y, top_db, frame_length=n_fft, hop_length)[0]`."""
    power = np.mean(_frames(y, n_fft, hop_length, True) ** 2, axis=1)
    if not len(power):
        return y
    db = 10.0 * np.log10(np.maximum(power, 1e-10) / max(power.max(), 1e-10))
    loud = np.flatnonzero(db > -top_db)
    if not len(loud):
        return y[:0]
    end = min(len(y), (loud[-1] + 1) * hop_length)
    return y[min(loud[0] * hop_length, end):end]


def _spectrogram(y, audio, window):
    """`|STFT| ** power`, `(frames, n_fft // 2 + 1)` (`librosa.stft`'s framing)."""
    frames = _frames(y.astype(np.float64), audio.n_fft, audio.hop_length, audio.center)
    return np.abs(np.fft.rfft(frames * window, axis=1)) ** audio.power


def naive_dataset(corpus, batch_size, audio=None, text=None, seed=0, drop_remainder=True):
    """The naive `tf.data` pipeline over an LJSpeech-style corpus folder.

    Every row of `metadata.csv` (`id|text|normalized text`) is read as
    it is, bad files included (no scan): the loader most training scripts
    begin with.

    Args:
        corpus: corpus folder with `metadata.csv` and `wavs/`.
        batch_size: utterances per batch.
        audio: `kg.data.AudioConfig` for the features. Defaults to
            `AudioConfig()`.
        text: `kg.data.TextConfig` whose vocabulary maps characters to ids
            (others dropped). Defaults to `TextConfig()`.
        seed: shuffle seed. Defaults to 0.
        drop_remainder: drop the last, smaller batch. Defaults to True.

    Returns:
        `(dataset, batches_per_epoch)`: the dataset yields
        `((ids, text_len), (mel, mel_len))` batches (int32 `[B, T]`,
        int32 `[B]`, float32 `[B, F, audio.num_features]` padded with
        `audio.padding_value`, int32 `[B]`) and went through
        `kg.data.instrument` (its frames: `mel_len`; `dataset.input_probe`),
        so the monitors measure its input wait and its padding.

    Raises:
        FileNotFoundError: `corpus` has no `metadata.csv`.
    """
    import tensorflow as tf

    from keras_gpufix.data.audio import AudioConfig, mel_filterbank
    from keras_gpufix.data.input_probe import instrument
    from keras_gpufix.data.text import TextConfig

    audio = audio or AudioConfig()
    text = text or TextConfig()
    metadata = os.path.join(corpus, "metadata.csv")
    if not os.path.isfile(metadata):
        raise FileNotFoundError(f"`corpus` must be a folder with metadata.csv. "
                                f"Received: corpus={corpus!r}")
    with open(metadata, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("|") for line in f if line.strip()]
    paths = [os.path.join(corpus, "wavs", r[0] + ".wav") for r in rows]
    texts = [r[-1] for r in rows]
    table = {c: i + 1 for i, c in enumerate(text.vocabulary)}
    win_length = audio.win_length or audio.n_fft
    left = (audio.n_fft - win_length) // 2
    window = np.zeros(audio.n_fft)
    window[left:left + win_length] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win_length)
                                                        / win_length)  # periodic Hann
    filterbank = mel_filterbank(audio) if audio.features == "mel" else None

    def load(path, sentence):
        y = _read_wav(path.decode(), audio.sample_rate)
        if audio.trim_top_db is not None:
            y = _trim(y, audio.trim_top_db, audio.n_fft, audio.hop_length)
        if audio.normalize == "peak" and len(y) and np.abs(y).max() > 0:
            y = y / np.abs(y).max()
        spectrogram = _spectrogram(y, audio, window)
        if filterbank is not None:
            spectrogram = spectrogram @ filterbank
        features = np.log(np.maximum(spectrogram, audio.log_floor)).astype(np.float32)
        if audio.feature_norm == "utterance":
            features = (features - features.mean(0)) / (features.std(0) + 1e-10)
        ids = np.array([table[c] for c in sentence.decode().lower() if c in table], np.int32)
        return ids, np.int32(len(ids)), features, np.int32(len(features))

    def tf_load(path, sentence):
        ids, text_len, mel, mel_len = tf.numpy_function(
            load, [path, sentence], [tf.int32, tf.int32, tf.float32, tf.int32])
        ids.set_shape([None])
        text_len.set_shape([])
        mel.set_shape([None, audio.num_features])
        mel_len.set_shape([])
        return (ids, text_len), (mel, mel_len)

    ds = tf.data.Dataset.from_tensor_slices((paths, texts))
    ds = ds.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
    ds = ds.map(tf_load, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.padded_batch(batch_size, drop_remainder=drop_remainder,
                         padding_values=((0, 0), (audio.padding_value, 0)))
    steps = len(paths) // batch_size if drop_remainder else -(-len(paths) // batch_size)
    ds = instrument(ds, frames=lambda batch: batch[1][1],
                    frames_per_second=audio.frames_per_second)
    out = ds.prefetch(tf.data.AUTOTUNE)
    out.input_probe = ds.input_probe
    return out, steps
