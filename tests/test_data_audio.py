import dataclasses
import os
import re
import struct
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix.data import audio
from keras_gpufix.data.builder import SpeechDatasetBuilder
from keras_gpufix.data.corpus import read_wav_header
from keras_gpufix.data.synthetic import _speech, write_wav
from layer_checks import check_config_round_trip, check_dataset_function, check_layer

CONFIGS = {
    "default": audio.AudioConfig(),
    "htk_power2_short_window": audio.AudioConfig(
        mel_scale="htk", power=2.0, win_length=800, fmin=30.0, fmax=None, n_mels=64
    ),
    "16k_no_center": audio.AudioConfig(
        sample_rate=16000, n_fft=512, hop_length=160, win_length=400, fmax=None, center=False
    ),
}


def _decode_file(path):
    info = read_wav_header(path)
    contents = tf.io.read_file(path)
    return audio.decode_wav(contents, info.data_offset, info.data_bytes,
                            info.format_code, info.channels).numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_log_mel_matches_librosa(name):
    librosa = pytest.importorskip("librosa")
    config = CONFIGS[name]
    y = _speech(np.random.default_rng(1), 2.3, config.sample_rate).astype(np.float32)
    mel = librosa.feature.melspectrogram(
        y=y, sr=config.sample_rate, n_fft=config.n_fft, hop_length=config.hop_length,
        win_length=config.win_length, center=config.center, power=config.power,
        n_mels=config.n_mels, fmin=config.fmin, fmax=config.fmax,
        htk=config.mel_scale == "htk", norm="slaney",
    )
    expected = np.log(np.maximum(mel, config.log_floor)).T
    got = audio.log_mel(y, config).numpy()
    assert got.shape == expected.shape == (config.num_frames(len(y)), config.n_mels)
    assert np.max(np.abs(got - expected)) <= 1e-3


@pytest.mark.parametrize("mel_norm", ["slaney", None])
@pytest.mark.parametrize("mel_scale", ["slaney", "htk"])
def test_filterbank_matches_librosa(mel_scale, mel_norm):
    librosa = pytest.importorskip("librosa")
    config = audio.AudioConfig(mel_scale=mel_scale, fmin=55.0, mel_norm=mel_norm)
    expected = librosa.filters.mel(sr=config.sample_rate, n_fft=config.n_fft,
                                   n_mels=config.n_mels, fmin=config.fmin, fmax=config.fmax,
                                   htk=mel_scale == "htk", norm=mel_norm)
    np.testing.assert_allclose(audio.mel_filterbank(config), expected.T, atol=1e-7)


def test_xtts_style_front_end_matches_librosa():
    """RMS 0.1, HTK filterbank without area normalisation, ln(mel + 1e-6),
    min-max per utterance: the recipe's formula on librosa's mel."""
    librosa = pytest.importorskip("librosa")
    config = audio.AudioConfig(normalize="rms", rms_level=0.1, mel_scale="htk", mel_norm=None,
                               log="offset", log_offset=1e-6, feature_norm="minmax")
    y = 0.6 * _speech(np.random.default_rng(11), 1.7, config.sample_rate).astype(np.float32)
    y_rms = y * 0.1 / np.sqrt(np.mean(y.astype(np.float64) ** 2))
    mel = librosa.feature.melspectrogram(
        y=y_rms, sr=config.sample_rate, n_fft=config.n_fft, hop_length=config.hop_length,
        win_length=config.win_length, n_mels=config.n_mels, fmax=config.fmax, power=1.0,
        htk=True, norm=None)
    log_mel = np.log(mel + 1e-6).T
    expected = (log_mel - log_mel.min()) / (log_mel.max() - log_mel.min())
    got = audio.extract_features(y, config).numpy()
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= 1e-3
    assert (got.min(), got.max()) == (0.0, 1.0)
    assert config.padding_value == pytest.approx(np.log(1e-6))
    silent = audio.extract_features(np.zeros(4096, np.float32), config).numpy()
    assert np.all(np.isfinite(silent))


def test_ctc_asr_front_end_matches_the_recipe_tf_code():
    """keras-io CTC ASR: |tf.signal.stft(256, 160, 384)| ** 0.5, no log, each
    frame normalised across frequency. Its frames hold 256 samples from the
    frame start; the builder centres the 256-sample window in n_fft=384, so
    its frame t is the recipe's frame t of the clip 64 samples later."""
    config = audio.AudioConfig(sample_rate=16000, n_fft=384, hop_length=160, win_length=256,
                               center=False, features="linear", power=0.5, log=None,
                               feature_norm="frame", pad_value=0.0)
    y = _speech(np.random.default_rng(12), 1.3, 16000).astype(np.float32)
    spectrogram = tf.signal.stft(y[64:], frame_length=256, frame_step=160, fft_length=384)
    spectrogram = tf.math.pow(tf.abs(spectrogram), 0.5)
    means = tf.math.reduce_mean(spectrogram, 1, keepdims=True)
    stddevs = tf.math.reduce_std(spectrogram, 1, keepdims=True)
    expected = ((spectrogram - means) / (stddevs + 1e-10)).numpy()
    got = audio.extract_features(y, config).numpy()
    assert got.shape == (config.num_frames(len(y)), 193)
    assert np.max(np.abs(got - expected[: len(got)])) <= 1e-3
    assert config.padding_value == 0.0


def test_slaney_and_htk_differ():
    slaney = audio.mel_filterbank(audio.AudioConfig(mel_scale="slaney"))
    htk = audio.mel_filterbank(audio.AudioConfig(mel_scale="htk"))
    assert np.abs(slaney - htk).max() > 1e-3


def test_log_mel_batched_equals_unbatched_and_floor():
    config = CONFIGS["16k_no_center"]
    rng = np.random.default_rng(0)
    batch = np.stack([_speech(rng, 0.5, 16000), np.zeros(8000)]).astype(np.float32)
    out = audio.log_mel(batch, config).numpy()
    for i in range(2):
        np.testing.assert_allclose(out[i], audio.log_mel(batch[i], config).numpy(), atol=1e-5)
    np.testing.assert_allclose(out[1], np.log(config.log_floor), atol=1e-6)


@pytest.mark.parametrize(
    "sample_format, tolerance",
    [("pcm8", 1 / 127), ("pcm16", 1 / 32767), ("pcm24", 1e-6), ("pcm32", 1e-7), ("float32", 1e-7)],
)
def test_decode_every_bit_depth(tmp_path, sample_format, tolerance):
    clip = np.linspace(-0.9, 0.9, 1001)
    path = str(tmp_path / "clip.wav")
    write_wav(path, clip, 16000, sample_format=sample_format)
    np.testing.assert_allclose(_decode_file(path), clip, atol=tolerance + 1e-7)


def test_pcm16_decode_equals_tf_audio_decode_wav(tmp_path):
    path = str(tmp_path / "clip.wav")
    write_wav(path, _speech(np.random.default_rng(2), 0.4, 16000), 16000)
    expected, rate = tf.audio.decode_wav(tf.io.read_file(path))
    assert int(rate) == 16000
    np.testing.assert_array_equal(_decode_file(path), expected.numpy()[:, 0])


def test_stereo_is_mixed_down(tmp_path):
    path = str(tmp_path / "stereo.wav")
    left, right = np.full(100, 0.5), np.full(100, -0.1)
    write_wav(path, np.stack([left, right], axis=1), 16000)
    np.testing.assert_allclose(_decode_file(path), 0.2, atol=1e-4)


def _write_raw(path, tag, bits, data, channels=1, extensible=False):
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, 8000, 8000 * block, block, bits)
    if extensible:
        guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt += struct.pack("<HHI", 22, bits, 4) + struct.pack("<H", tag) + guid_tail
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"LIST" + struct.pack("<I", 4) + b"INFO"
    body += b"data" + struct.pack("<I", len(data)) + data
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)


@pytest.mark.parametrize("law, tag", [("ulaw", 7), ("alaw", 6)])
def test_g711_decoding_matches_audioop(tmp_path, law, tag):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    codes = bytes(range(256))
    linear = getattr(audioop, f"{law}2lin")(codes, 2)
    expected = np.frombuffer(linear, "<i2") / 32768.0
    path = str(tmp_path / f"{law}.wav")
    _write_raw(path, tag, 8, codes)
    np.testing.assert_allclose(_decode_file(path), expected, atol=1e-7)


def test_extensible_float64_and_extra_chunks(tmp_path):
    clip = np.linspace(-1, 1, 64)
    path = str(tmp_path / "ext.wav")
    _write_raw(path, 3, 64, clip.astype("<f8").tobytes(), extensible=True)
    info = read_wav_header(path)
    assert (info.format_tag, info.bits, info.frames) == (3, 64, 64)
    np.testing.assert_allclose(_decode_file(path), clip, atol=1e-7)


def test_resample_length_and_content():
    rate_in, rate_out = 16000, 22050
    t = np.arange(16000) / rate_in
    tone = np.sin(2 * np.pi * 440.0 * t).astype(np.float32)
    out = audio.resample(tone, rate_in, rate_out).numpy()
    assert len(out) == audio.resampled_length(16000, rate_in, rate_out) == 22050
    t_out = np.arange(len(out)) / rate_out
    expected = np.sin(2 * np.pi * 440.0 * t_out)
    assert np.max(np.abs(out[1000:-1000] - expected[1000:-1000])) < 1e-3
    same = audio.resample(tone, 16000, 16000).numpy()
    np.testing.assert_array_equal(same, tone)


def test_resampled_features_match_native_rate():
    config = audio.AudioConfig(sample_rate=22050)
    t_in, t_ref = np.arange(11025) / 11025, np.arange(22050) / 22050
    chord = lambda t: sum(0.2 * np.sin(2 * np.pi * f * t) for f in (220.0, 660.0, 1500.0))
    resampled = audio.resample(chord(t_in).astype(np.float32), 11025, 22050)
    got = audio.log_mel(resampled, config).numpy()
    ref = audio.log_mel(chord(t_ref).astype(np.float32), config).numpy()
    assert got.shape == ref.shape
    loud = ref[5:-5] > np.log(1e-2)  # bands with energy, away from the edges
    assert np.max(np.abs(got[5:-5][loud] - ref[5:-5][loud])) < 0.05


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_mels": 0}, "`n_mels` must be an integer >= 1. Received: n_mels=0"),
        ({"win_length": 2048}, "`win_length` must be between 1 and `n_fft`"),
        ({"fmax": 20000.0}, "fmax <= sample_rate / 2"),
        ({"mel_scale": "bark"}, "`mel_scale` must be"),
        ({"log_floor": 0.0}, "`log_floor` must be > 0"),
        ({"max_seconds": -1}, "`max_seconds` must be > 0"),
    ],
)
def test_audio_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        audio.AudioConfig(**kwargs)


def test_num_frames_matches_log_mel():
    for config in CONFIGS.values():
        for samples in (config.n_fft - 1, config.n_fft, 12345):
            waveform = np.zeros(samples, np.float32)
            assert audio.log_mel(waveform, config).shape[0] == config.num_frames(samples)


def test_layer_checks_and_saved_model(tmp_path):
    config = dataclasses.replace(CONFIGS["16k_no_center"], n_mels=40)
    layer = audio.LogMelSpectrogram.from_audio_config(config)
    waves = np.random.default_rng(3).uniform(-0.5, 0.5, (3, 4000)).astype(np.float32)
    out = check_layer(layer, waves)
    np.testing.assert_allclose(out, audio.log_mel(waves, config).numpy(), atol=1e-5)
    assert audio.LogMelSpectrogram.from_config(layer.get_config()).config == layer.config

    inputs = keras.Input((4000,))
    model = keras.Model(inputs, keras.layers.Dense(3)(audio.LogMelSpectrogram(n_mels=40)(inputs)))
    assert model.output_shape == (None, audio.AudioConfig().num_frames(4000), 3)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_allclose(restored(waves).numpy(), model(waves).numpy(), atol=1e-5)


def test_layer_is_float32_under_mixed_precision():
    waves = np.random.default_rng(4).uniform(-0.5, 0.5, (2, 3200)).astype(np.float32)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        mixed = audio.LogMelSpectrogram(n_mels=40)
        assert mixed(waves).dtype == tf.float32
    finally:
        keras.config.set_dtype_policy(previous)


def test_layer_refuses_options_it_does_not_apply():
    with pytest.raises(ValueError, match=r"Received: trim_top_db=20, features='linear'"):
        audio.LogMelSpectrogram.from_audio_config(
            audio.AudioConfig(trim_top_db=20, features="linear"))
    layer = audio.LogMelSpectrogram.from_audio_config(audio.AudioConfig(pad_value=0.0, n_mels=32))
    assert layer.n_mels == 32


# --- trimming, normalisation, linear features (issue 14 item 3) ---

SR = 16000
SMALL = audio.AudioConfig(sample_rate=SR, n_fft=512, hop_length=160, win_length=400, n_mels=40,
                          fmax=None)


def _planted(rng, lead_s, speech_s, tail_s, floor=1e-4):
    """Speech with planted leading/trailing near-silence (a noise floor)."""
    speech = _speech(rng, speech_s, SR)
    return np.concatenate([floor * rng.standard_normal(int(lead_s * SR)), speech,
                           floor * rng.standard_normal(int(tail_s * SR))]).astype(np.float32)


@pytest.mark.parametrize("top_db", [20, 40, 60])
@pytest.mark.parametrize("center", [True, False])
def test_trim_within_two_frames_of_librosa(top_db, center):
    librosa = pytest.importorskip("librosa")
    config = dataclasses.replace(SMALL, trim_top_db=top_db, center=center)
    rng = np.random.default_rng(top_db)
    for lead, tail in ((0.6, 0.3), (0.05, 0.9), (0.0, 0.0)):
        y = _planted(rng, lead, 1.2, tail)
        _, (ref_start, ref_end) = librosa.effects.trim(
            y, top_db=top_db, frame_length=config.n_fft, hop_length=config.hop_length)
        start, end = (int(v) for v in audio.trim_bounds(y, config))
        assert abs(start - ref_start) <= 2 * config.hop_length
        assert abs(end - ref_end) <= 2 * config.hop_length
        assert start >= int(lead * SR) - 2 * config.hop_length  # the planted silence went
        assert end <= len(y) - int(tail * SR) + 2 * config.hop_length + config.n_fft
        expected_frames = config.num_frames(ref_end - ref_start)
        features = audio.extract_features(y, config).numpy()
        assert abs(len(features) - expected_frames) <= 2
        assert len(features) == int(audio.feature_frames(y, config))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("power", [1.0, 2.0])
def test_linear_features_match_librosa(name, power):
    librosa = pytest.importorskip("librosa")
    config = dataclasses.replace(CONFIGS[name], features="linear", power=power)
    y = _speech(np.random.default_rng(5), 2.1, config.sample_rate).astype(np.float32)
    stft = librosa.stft(y, n_fft=config.n_fft, hop_length=config.hop_length,
                        win_length=config.win_length, center=config.center, window="hann")
    expected = np.log(np.maximum(np.abs(stft) ** power, config.log_floor)).T
    got = audio.extract_features(y, config).numpy()
    assert got.shape == expected.shape == (config.num_frames(len(y)), config.n_fft // 2 + 1)
    assert config.num_features == config.n_fft // 2 + 1
    assert np.max(np.abs(got - expected)) <= 1e-3
    batch = audio.log_linear(np.stack([y, y[::-1]]), config).numpy()
    np.testing.assert_allclose(batch[0], got, atol=1e-5)


def test_trimmed_normalised_linear_features_match_librosa():
    librosa = pytest.importorskip("librosa")
    config = dataclasses.replace(SMALL, trim_top_db=30, normalize="peak", features="linear")
    y = 0.3 * _planted(np.random.default_rng(6), 0.5, 1.0, 0.4)
    trimmed, _ = librosa.effects.trim(y, top_db=30, frame_length=config.n_fft,
                                      hop_length=config.hop_length)
    trimmed = librosa.util.normalize(trimmed)
    stft = librosa.stft(trimmed, n_fft=config.n_fft, hop_length=config.hop_length,
                        win_length=config.win_length)
    expected = np.log(np.maximum(np.abs(stft), config.log_floor)).T
    got = audio.extract_features(y, config).numpy()
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= 1e-3


def test_known_trim_bounds_give_the_same_features_and_are_where_it_trims():
    config = dataclasses.replace(SMALL, trim_top_db=30, features="linear")
    y = 0.3 * _planted(np.random.default_rng(6), 0.5, 1.0, 0.4)
    start, end = (int(b) for b in audio.trim_bounds(y, config))
    assert 0 < start < end < len(y)  # the planted silence is found
    np.testing.assert_array_equal(audio.extract_features(y, config, (start, end)).numpy(),
                                  audio.extract_features(y, config).numpy())
    whole = dataclasses.replace(config, trim_top_db=None)
    np.testing.assert_array_equal(audio.extract_features(y, config, (0, len(y))).numpy(),
                                  audio.extract_features(y, whole).numpy())


def test_peak_normalisation_and_silence():
    config = dataclasses.replace(SMALL, normalize="peak")
    y = 0.05 * _speech(np.random.default_rng(7), 0.8, SR).astype(np.float32)
    np.testing.assert_allclose(audio.extract_features(y, config).numpy(),
                               audio.extract_features(y / np.abs(y).max(), SMALL).numpy(),
                               atol=1e-4)
    silent = np.zeros(SR // 2, np.float32)
    out = audio.extract_features(silent, config).numpy()
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np.log(config.log_floor), atol=1e-6)


@pytest.mark.parametrize("features", ["mel", "linear"])
def test_utterance_feature_norm(features):
    config = dataclasses.replace(SMALL, features=features, feature_norm="utterance")
    y = _speech(np.random.default_rng(8), 1.0, SR).astype(np.float32)
    out = audio.extract_features(y, config).numpy()
    raw = audio.extract_features(y, dataclasses.replace(config, feature_norm=None)).numpy()
    assert out.shape == raw.shape == (config.num_frames(len(y)), config.num_features)
    varying = raw.std(axis=0) > 1e-3
    np.testing.assert_allclose(out.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(out.std(axis=0)[varying], 1.0, atol=1e-3)
    expected = (raw - raw.mean(axis=0)) / (raw.std(axis=0) + 1e-10)
    np.testing.assert_allclose(out[:, varying], expected[:, varying], atol=1e-3)


def test_extract_features_in_graph_and_tf_data():
    config = dataclasses.replace(SMALL, trim_top_db=30, normalize="peak", features="linear",
                                 feature_norm="utterance")
    rng = np.random.default_rng(9)
    clips = [_planted(rng, 0.3, 0.6, 0.2), _planted(rng, 0.1, 0.9, 0.5)]
    outputs = check_dataset_function(
        lambda y: (audio.extract_features(y, config), audio.feature_frames(y, config)), clips,
        atol=1e-4)
    for features, frames in outputs:
        assert features.shape == (frames, config.num_features)


def test_audio_config_round_trip_and_derived_values():
    config = dataclasses.replace(SMALL, trim_top_db=25.0, normalize="peak", features="linear",
                                 pad_value=0.0, feature_norm="utterance", max_seconds=None)
    check_config_round_trip(config)
    check_config_round_trip(audio.AudioConfig())
    assert audio.AudioConfig().padding_value == pytest.approx(np.log(1e-5))
    assert config.padding_value == 0.0
    assert (SMALL.num_features, config.num_features) == (40, 257)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"trim_top_db": 0}, "`trim_top_db` must be a number of dB > 0 (e.g. 20 or 60), or None "
                             "to keep the whole clip. Received: trim_top_db=0"),
        ({"trim_top_db": "20"}, "Received: trim_top_db='20'"),
        ({"normalize": "lufs"}, '`normalize` must be None or "peak" or "rms". '
                                "Received: normalize='lufs'"),
        ({"rms_level": 0}, "`rms_level` must be > 0. Received: rms_level=0"),
        ({"mel_norm": "area"}, '`mel_norm` must be "slaney" or None. Received: mel_norm=\'area\''),
        ({"log": "log10"}, '`log` must be "floor" or "offset" or None. Received: log=\'log10\''),
        ({"log_offset": -1e-6}, "`log_offset` must be > 0. Received: log_offset=-1e-06"),
        ({"on_too_long": "crop"}, '`on_too_long="crop"` needs `max_seconds`'),
        ({"on_too_long": "truncate", "max_seconds": 1.0},
         '`on_too_long` must be "skip" or "crop". Received: on_too_long=\'truncate\''),
        ({"features": "mfcc"}, '`features` must be "mel" or "linear". Received: features=\'mfcc\''),
        ({"feature_norm": "global"}, '`feature_norm` must be None or "utterance"'),
        ({"pad_value": float("nan")}, "`pad_value` must be a finite number (e.g. 0.0), or None "
                                      "for silence (ln(log_floor)). Received: pad_value=nan"),
        ({"pad_value": True}, "Received: pad_value=True"),
    ],
)
def test_new_audio_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        audio.AudioConfig(**kwargs)


# --- the builder with the new options: lengths, padding, cache fingerprint ---

def _corpus(tmp_path, count=4):
    rng = np.random.default_rng(10)
    pairs, clips = [], {}
    for i in range(count):
        path = str(tmp_path / f"utt{i}.wav")
        write_wav(path, _planted(rng, 0.2 + 0.1 * i, 0.4 + 0.15 * i, 0.3), SR)
        text = f"utterance number {'abcdefgh'[i] * (i + 1)}"
        pairs.append((path, text))
        clips[text] = _decode_file(path)
    return pairs, clips


def _features_by_text(builder, dataset):
    """`{transcript: (real frames, padded frames)}` over one epoch."""
    alphabet = builder.text.vocabulary
    out = {}
    for (ids, text_len), (feats, feats_len) in dataset:
        for i in range(len(text_len)):
            text = "".join(alphabet[j - 1] for j in ids[i, : text_len[i]].numpy())
            out[text] = (feats[i, : feats_len[i]].numpy(), feats[i, feats_len[i]:].numpy())
    return out


def _check_epoch(builder, clips, config):
    got = _features_by_text(builder, builder.build(batch_size=2, num_buckets=2, seed=0))
    assert sorted(got) == sorted(clips)
    for text, (real, padded) in got.items():
        expected = audio.extract_features(clips[text], config).numpy()
        assert real.shape == expected.shape
        np.testing.assert_allclose(real, expected, atol=1e-4)
        np.testing.assert_array_equal(padded, np.full(padded.shape, config.padding_value,
                                                      np.float32))


CHANGED = {"trim_top_db": 30.0, "normalize": "peak", "features": "linear", "pad_value": 0.0,
           "feature_norm": "utterance"}


def test_every_audio_option_changes_the_fingerprint(tmp_path):
    pairs, _ = _corpus(tmp_path, count=2)
    changed = dict(CHANGED, sample_rate=22050, n_fft=1024, hop_length=256, win_length=256,
                   n_mels=32, fmin=20.0, fmax=4000.0, power=2.0, mel_scale="htk", center=False,
                   log_floor=1e-6, max_seconds=30.0, rms_level=0.2, mel_norm=None,
                   log="offset", log_offset=1e-5, on_too_long="crop")
    assert set(changed) == {f.name for f in dataclasses.fields(audio.AudioConfig)}
    small = dataclasses.replace(SMALL, max_seconds=60.0)
    base = SpeechDatasetBuilder(pairs, audio=small, verbose=0).fingerprint()
    seen = {base}
    for name, value in changed.items():
        config = dataclasses.replace(small, **{name: value})
        key = SpeechDatasetBuilder(pairs, audio=config, verbose=0).fingerprint()
        assert key not in seen, name
        seen.add(key)


def test_cache_never_serves_stale_features_when_an_option_changes(tmp_path):
    pairs, clips = _corpus(tmp_path)
    cache_dir = tmp_path / "cache"
    first = SpeechDatasetBuilder(pairs, audio=SMALL, cache_dir=cache_dir, verbose=0)
    _check_epoch(first, clips, SMALL)
    assert first.report["cache"] == "miss"
    config = SMALL
    for name, value in CHANGED.items():
        config = dataclasses.replace(config, **{name: value})
        builder = SpeechDatasetBuilder(pairs, audio=config, cache_dir=cache_dir, verbose=0)
        _check_epoch(builder, clips, config)
        assert builder.report["cache"] == "miss", name
    again = SpeechDatasetBuilder(pairs, audio=SMALL, cache_dir=cache_dir, verbose=0)
    _check_epoch(again, clips, SMALL)
    assert again.report["cache"] == "hit"


def test_trimmed_lengths_with_and_without_cache(tmp_path):
    pairs, clips = _corpus(tmp_path)
    config = dataclasses.replace(SMALL, trim_top_db=30.0, pad_value=-1.0)
    untrimmed = SpeechDatasetBuilder(pairs, audio=SMALL, verbose=0)
    for cache_dir in (None, tmp_path / "cache"):
        builder = SpeechDatasetBuilder(pairs, audio=config, cache_dir=cache_dir, verbose=0)
        _check_epoch(builder, clips, config)
        full = untrimmed.build(batch_size=2, num_buckets=2, seed=0)
        before = sum(int(tf.reduce_sum(n)) for _, (_, n) in full)
        after = sum(int(tf.reduce_sum(n)) for _, (_, n) in builder.build(2, 2, seed=0))
        assert after < before - 4 * len(pairs)  # the planted silence is gone
        assert max(builder.report["bucket_boundaries"]) < max(untrimmed.report["bucket_boundaries"])
