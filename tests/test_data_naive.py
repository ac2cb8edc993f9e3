"""The naive loader: the baseline of the demo and benchmarks reads what the builder reads."""

import numpy as np
import pytest

from keras_gpufix.data import AudioConfig, SpeechDatasetBuilder, TextConfig
from keras_gpufix.data.naive import naive_dataset
from keras_gpufix.data.synthetic import make_synthetic_corpus


@pytest.mark.parametrize("audio", [
    AudioConfig(n_mels=20),
    AudioConfig(trim_top_db=20.0, normalize="peak", features="linear", feature_norm="utterance",
                pad_value=0.0),
], ids=["mel", "trim_linear_norm"])
def test_naive_batches_hold_the_builders_features_and_ids(tmp_path, audio):
    corpus = make_synthetic_corpus(str(tmp_path / "corpus"), 6, min_seconds=0.5, max_seconds=1.0)
    text = TextConfig()
    dataset, steps = naive_dataset(corpus, 3, audio, text, seed=0)
    assert steps == 2
    assert dataset.element_spec[1][0].shape.as_list() == [3, None, audio.num_features]
    naive, real = {}, []
    for (ids, text_len), (mel, mel_len) in dataset.take(steps):
        real.append(int(np.sum(mel_len)))
        for i in range(3):
            n = int(mel_len[i])
            naive[tuple(ids[i, :int(text_len[i])].numpy())] = mel[i, :n].numpy()
        padded = np.arange(mel.shape[1])[None, :] >= mel_len.numpy()[:, None]
        np.testing.assert_array_equal(mel.numpy()[padded], np.float32(audio.padding_value))
    # each batch's real frames reach the monitors (its padding is measured)
    assert dataset.input_probe.read(0, steps)[2].tolist() == real
    builder = SpeechDatasetBuilder(corpus, audio=audio, text=text, verbose=0)
    kg = {}
    for (ids, text_len), (mel, mel_len) in builder.build(batch_size=6, num_buckets=1,
                                                         shuffle=False):
        for i in range(int(ids.shape[0])):
            kg[tuple(ids[i, :int(text_len[i])].numpy())] = mel[i, :int(mel_len[i])].numpy()
    assert naive.keys() == kg.keys()
    for key, features in naive.items():
        assert features.shape == kg[key].shape
        np.testing.assert_allclose(features, kg[key], atol=2e-2)


def test_naive_needs_a_corpus_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata.csv"):
        naive_dataset(str(tmp_path), 2)


def test_naive_reads_stereo_8_and_32_bit_pcm_as_the_builder_does(tmp_path):
    audio, text = AudioConfig(n_mels=20), TextConfig()
    corpus = make_synthetic_corpus(str(tmp_path / "corpus"), 1, min_seconds=0.5,
                                   max_seconds=1.0, bad_files=("stereo", "pcm8", "pcm32"))
    dataset, steps = naive_dataset(corpus, 1, audio, text, seed=0)
    naive = {}
    for (ids, _), (mel, _) in dataset.take(steps):
        naive[tuple(ids[0].numpy())] = mel[0].numpy()
    builder = SpeechDatasetBuilder(corpus, audio=audio, text=text, verbose=0)
    assert not builder.report["skipped"]
    kg = {}
    for (ids, text_len), (mel, mel_len) in builder.build(batch_size=1, num_buckets=1,
                                                         shuffle=False):
        kg[tuple(ids[0, :int(text_len[0])].numpy())] = mel[0, :int(mel_len[0])].numpy()
    assert len(naive) == len(kg) == 4 and naive.keys() == kg.keys()
    for key, features in naive.items():
        np.testing.assert_allclose(features, kg[key], atol=2e-2)
