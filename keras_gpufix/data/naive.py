"""The naive speech loader: the baseline the demo and benchmarks measure against.

What most TTS repositories start from: read `metadata.csv`, then per clip a
`tf.numpy_function` calling `librosa.load` and
`librosa.feature.melspectrogram` every epoch (`librosa.effects.trim`,
`librosa.util.normalize` and `librosa.stft` where the `AudioConfig` asks for
trimming, peak normalisation or linear features; map with AUTOTUNE
parallelism), `padded_batch` (each batch padded to its longest clip, no
length buckets), `kg.data.instrument` (so the monitors see its input
wait, as `keras-gpufix diagnose` does for any dataset), prefetch. Features match `kg.data.AudioConfig`'s
(librosa-compatible filterbank, same log floor), so the two paths train
the same model on the same numbers; only the input path differs.

`keras-gpufix demo` and `benchmarks/end_to_end.py` use it. It needs
librosa (`pip install librosa`, or the `parity` / `test` extras).
"""

import os

__all__ = ["naive_dataset"]


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
        `kg.data.instrument`, so the monitors measure its input wait.

    Raises:
        ImportError: librosa is not installed.
        FileNotFoundError: `corpus` has no `metadata.csv`.
    """
    try:
        import librosa
    except ImportError:
        raise ImportError("The naive loader needs librosa: pip install librosa "
                          "(or: pip install keras-gpufix[parity])") from None
    import numpy as np
    import tensorflow as tf

    from keras_gpufix.data.audio import AudioConfig
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

    def load(path, sentence):
        y, _ = librosa.load(path.decode(), sr=audio.sample_rate)
        if audio.trim_top_db is not None:
            y, _ = librosa.effects.trim(y, top_db=audio.trim_top_db, frame_length=audio.n_fft,
                                        hop_length=audio.hop_length)
        if audio.normalize == "peak":
            y = librosa.util.normalize(y)
        if audio.features == "mel":
            spectrogram = librosa.feature.melspectrogram(
                y=y, sr=audio.sample_rate, n_fft=audio.n_fft, hop_length=audio.hop_length,
                win_length=audio.win_length, center=audio.center, power=audio.power,
                n_mels=audio.n_mels, fmin=audio.fmin, fmax=audio.fmax, norm="slaney",
                htk=audio.mel_scale == "htk")
        else:
            spectrogram = np.abs(librosa.stft(
                y, n_fft=audio.n_fft, hop_length=audio.hop_length, win_length=audio.win_length,
                center=audio.center)) ** audio.power
        features = np.log(np.maximum(spectrogram, audio.log_floor)).T.astype(np.float32)
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
    return instrument(ds).prefetch(tf.data.AUTOTUNE), steps
