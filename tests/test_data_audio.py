import dataclasses
import os
import struct
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix.data import audio
from keras_gpufix.data.corpus import read_wav_header
from keras_gpufix.data.synthetic import _speech, write_wav

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


@pytest.mark.parametrize("mel_scale", ["slaney", "htk"])
def test_filterbank_matches_librosa(mel_scale):
    librosa = pytest.importorskip("librosa")
    config = audio.AudioConfig(mel_scale=mel_scale, fmin=55.0)
    expected = librosa.filters.mel(sr=config.sample_rate, n_fft=config.n_fft,
                                   n_mels=config.n_mels, fmin=config.fmin, fmax=config.fmax,
                                   htk=mel_scale == "htk", norm="slaney")
    np.testing.assert_allclose(audio.mel_filterbank(config), expected.T, atol=1e-7)


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


def test_layer_matches_function_and_round_trips(tmp_path):
    config = dataclasses.replace(CONFIGS["16k_no_center"], n_mels=40)
    layer = audio.LogMelSpectrogram.from_audio_config(config)
    waves = np.random.default_rng(3).uniform(-0.5, 0.5, (2, 4000)).astype(np.float32)
    np.testing.assert_allclose(layer(waves).numpy(), audio.log_mel(waves, config).numpy(), atol=1e-5)
    clone = audio.LogMelSpectrogram.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    assert clone.config == layer.config

    inputs = keras.Input((4000,))
    model = keras.Model(inputs, keras.layers.Dense(3)(audio.LogMelSpectrogram(n_mels=40)(inputs)))
    assert model.output_shape == (None, audio.AudioConfig().num_frames(4000), 3)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_allclose(restored(waves).numpy(), model(waves).numpy(), atol=1e-5)


def test_layer_inside_tf_data_and_float32_under_mixed_precision():
    layer = audio.LogMelSpectrogram(sample_rate=16000, n_fft=512, hop_length=160,
                                    win_length=400, n_mels=40, fmax=None)
    waves = np.random.default_rng(4).uniform(-0.5, 0.5, (4, 3200)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(waves).batch(2).map(layer)
    out = np.concatenate([x.numpy() for x in ds])
    np.testing.assert_allclose(out, layer(waves).numpy(), atol=1e-5)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        mixed = audio.LogMelSpectrogram(n_mels=40)
        assert mixed(waves).dtype == tf.float32
    finally:
        keras.config.set_dtype_policy(previous)
