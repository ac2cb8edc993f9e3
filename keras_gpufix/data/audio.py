"""TF-native WAV decoding, resampling and librosa-compatible speech features.

`log_mel(waveform, config)` returns `ln(max(mel, log_floor))` laid out
`(frames, n_mels)` (or `ln(mel + log_offset)`, or `mel` itself: `log`),
where `mel` is what `librosa.feature.melspectrogram(y, sr=sample_rate,
n_fft=n_fft, hop_length=hop_length, win_length=win_length, center=center,
power=power, n_mels=n_mels, fmin=fmin, fmax=fmax, htk=(mel_scale == "htk"),
norm=mel_norm)` computes: a periodic Hann window of `win_length` centred in
`n_fft`, zero padding of `n_fft // 2` on both sides when `center`, the
magnitude raised to `power`, and a triangular filterbank on the Slaney
(default, what HiFi-GAN vocoders expect) or HTK mel scale, area-normalised
(`mel_norm="slaney"`, default) or with peak 1 (`mel_norm=None`, as
torchaudio's and the XTTS recipe's filterbanks).

`extract_features(waveform, config)` is what the dataset builder caches
for one utterance, all in TF ops: leading/trailing silence trimmed as
`librosa.effects.trim(y, top_db=trim_top_db, frame_length=n_fft,
hop_length=hop_length)` does (`trim_top_db`, after cropping to
`max_seconds` with `on_too_long="crop"`), peak or RMS normalisation (`normalize`), the
log-mel above or the log linear spectrogram `ln(max(|librosa.stft(y,
...)| ** power, log_floor))` with `n_fft // 2 + 1` bins
(`features="linear"`), then feature normalisation (`feature_norm`: per bin
over the utterance, per frame across frequency, or min-max to [0, 1]).
`feature_frames` gives its frame count without computing it.

`decode_wav(contents, info...)` reads the audio data chunk that
`corpus.read_wav_header` located with `tf.io.decode_raw`, so 8/16/24/32-bit
PCM, 32/64-bit float, mu-law, A-law and WAVE_FORMAT_EXTENSIBLE files all
decode in the graph (`tf.audio.decode_wav` reads only 16-bit PCM), and mixes
channels down to mono. `resample` converts a clip whose rate differs from
`AudioConfig.sample_rate` by band-limited FFT resampling; the builder calls
it where features are computed (at cache time when there is a cache).

`LogMelSpectrogram` is a Keras layer with the same log-mel maths, so
features can also be computed on the GPU inside the model.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from keras_gpufix.data.audio_config import AudioConfig

__all__ = [
    "AudioConfig",
    "crop",
    "extract_features",
    "feature_frames",
    "log_linear",
    "log_mel",
    "mel_filterbank",
    "trim_bounds",
    "decode_wav",
    "resample",
    "resampled_length",
    "LogMelSpectrogram",
]


# Added to a standard deviation or range before dividing by it (feature_norm).
_EPSILON = 1e-10


def _hz_to_mel(hz, htk):
    hz = np.asarray(hz, np.float64)
    if htk:
        return 2595.0 * np.log10(1.0 + hz / 700.0)
    linear = hz / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, linear)


def _mel_to_hz(mel, htk):
    mel = np.asarray(mel, np.float64)
    if htk:
        return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)
    linear = mel * (200.0 / 3)
    log_part = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log_part, linear)


def mel_filterbank(config: AudioConfig) -> np.ndarray:
    """The mel filterbank, `(n_fft // 2 + 1, n_mels)` float32.

    Same weights as `librosa.filters.mel(sr=sample_rate, n_fft=n_fft,
    n_mels=n_mels, fmin=fmin, fmax=fmax, htk=(mel_scale == "htk"),
    norm=mel_norm)`, transposed.
    """
    htk = config.mel_scale == "htk"
    fmax = config.sample_rate / 2 if config.fmax is None else config.fmax
    fft_freqs = np.fft.rfftfreq(config.n_fft, 1.0 / config.sample_rate)
    mels = np.linspace(_hz_to_mel(config.fmin, htk), _hz_to_mel(fmax, htk), config.n_mels + 2)
    edges = _mel_to_hz(mels, htk)
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    if config.mel_norm == "slaney":
        weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.T.astype(np.float32)


def _window(config, dtype=tf.float32):
    win_length = config.win_length or config.n_fft
    window = tf.signal.hann_window(win_length, periodic=True, dtype=dtype)
    left = (config.n_fft - win_length) // 2
    return tf.pad(window, [[left, config.n_fft - win_length - left]])


def _magnitude(waveform, config, dtype=tf.float32):
    """`|STFT| ** power`, float32 `(..., frames, n_fft // 2 + 1)` (librosa's stft).

    `dtype=tf.float64` windows and transforms in double precision, as
    librosa does: float32 FFT rounding reaches ~1e-3 relative error in
    bins far below a frame's peak, which the mel filterbank's sums average
    out but a linear spectrogram keeps.
    """
    if config.center:
        pad = config.n_fft // 2
        rank = len(waveform.shape)
        waveform = tf.pad(waveform, [[0, 0]] * (rank - 1) + [[pad, pad]])
    frames = tf.signal.frame(tf.cast(waveform, dtype), config.n_fft, config.hop_length)
    spectrum = tf.signal.rfft(frames * _window(config, dtype), fft_length=[config.n_fft])
    # |z| ** power from |z| ** 2, not tf.math.abs: on CPU the complex abs
    # (hypot) costs more than the FFT itself (benchmarks/spectrogram_magnitude.py);
    # the same values to rounding at these magnitudes.
    squared = tf.math.square(tf.math.real(spectrum)) + tf.math.square(tf.math.imag(spectrum))
    if config.power == 2.0:
        magnitude = squared
    elif config.power == 1.0:
        magnitude = tf.math.sqrt(squared)
    elif config.power == 0.5:  # keras-io CTC ASR's |z| ** 0.5: two square roots beat tf.math.pow
        magnitude = tf.math.sqrt(tf.math.sqrt(squared))
    else:
        magnitude = tf.math.pow(squared, config.power / 2.0)
    return tf.cast(magnitude, tf.float32)


def _log(spectrogram, config):
    """The log form of `config.log` (`spectrogram` float32 or float64)."""
    if config.log == "floor":
        return tf.math.log(tf.math.maximum(spectrogram, config.log_floor))
    if config.log == "offset":
        return tf.math.log(spectrogram + config.log_offset)
    return spectrogram


def log_mel(waveform, config: AudioConfig, filterbank: np.ndarray | None = None) -> tf.Tensor:
    """Log-mel features of a waveform (`config.log`'s form), librosa-compatible.

    Args:
        waveform: float tensor `(..., samples)` at `config.sample_rate`.
        config: an `AudioConfig` (its `features`, trimming and
            normalisation options are not applied here: see
            `extract_features`).
        filterbank: a precomputed `mel_filterbank(config)` (a constant is
            built otherwise).

    Returns:
        float32 tensor `(..., frames, n_mels)` with
        `frames == config.num_frames(samples)`.
    """
    waveform = tf.convert_to_tensor(waveform, tf.float32)
    if filterbank is None:
        filterbank = mel_filterbank(config)
    mel = tf.tensordot(_magnitude(waveform, config), tf.constant(filterbank), axes=1)
    return _log(mel, config)


def log_linear(waveform, config: AudioConfig) -> tf.Tensor:
    """Log linear spectrogram of a waveform, librosa-compatible.

    `ln(max(|STFT| ** power, log_floor))` (or `config.log`'s form) where the STFT is
    `librosa.stft(y, n_fft=n_fft, hop_length=hop_length,
    win_length=win_length, center=center)` (periodic Hann window, zero
    padding), computed in double precision as librosa does (in single
    precision with `log=None`, where no log magnifies the rounding of
    faint bins).

    Args:
        waveform: float tensor `(..., samples)` at `config.sample_rate`.
        config: an `AudioConfig` (its `features`, trimming and
            normalisation options are not applied here: see
            `extract_features`).

    Returns:
        float32 tensor `(..., frames, n_fft // 2 + 1)` with
        `frames == config.num_frames(samples)`.
    """
    waveform = tf.convert_to_tensor(waveform, tf.float32)
    # The log of bins far below a frame's peak needs float64 (see `_magnitude`);
    # without a log float32's rounding stays ~1e-7 of the peak, and costs half.
    dtype = tf.float32 if config.log is None else tf.float64
    return _log(_magnitude(waveform, config, dtype), config)


def trim_bounds(waveform, config: AudioConfig) -> tuple[tf.Tensor, tf.Tensor]:
    """Where a clip's sound starts and ends, as `librosa.effects.trim` finds it.

    Frames of `n_fft` samples every `hop_length` (zero-padded by
    `n_fft // 2` on both sides) whose RMS is more than `trim_top_db` dB
    below the loudest frame's are silence; the clip keeps the samples from
    the first loud frame's start to the last loud frame's end, like
    `librosa.effects.trim(y, top_db=trim_top_db, frame_length=n_fft,
    hop_length=hop_length)[1]`. With `center=False` the kept span is
    widened to one frame (`n_fft` samples) where the clip has that many, so
    a trimmed clip still yields a feature frame.

    Args:
        waveform: float32 `(samples,)`.
        config: an `AudioConfig` with `trim_top_db` set.

    Returns:
        `(start, end)`: int32 scalars, `0 <= start <= end <= samples`.
    """
    waveform = tf.convert_to_tensor(waveform, tf.float32)
    n_fft, hop = config.n_fft, config.hop_length
    samples = tf.shape(waveform)[0]
    padded = tf.pad(waveform, [[n_fft // 2, n_fft // 2]])
    # Mean square of every frame, pooled (no framed copy of the clip).
    power = tf.nn.avg_pool1d(tf.square(padded)[None, :, None], n_fft, hop, "VALID")[0, :, 0]
    count = tf.shape(power)[0]
    floor = 1e-10  # librosa's amin ** 2
    ratio = tf.maximum(power, floor) / tf.maximum(tf.reduce_max(power), floor)
    loud = 10.0 * tf.math.log(ratio) / math.log(10.0) > -float(config.trim_top_db)
    index = tf.range(count)
    last = tf.reduce_max(tf.where(loud, index, -1))
    end = tf.minimum(samples, (last + 1) * hop)
    start = tf.minimum(tf.reduce_min(tf.where(loud, index, count)) * hop, end)
    if not config.center:
        end = tf.maximum(end, tf.minimum(samples, start + n_fft))
        start = tf.minimum(start, tf.maximum(0, end - n_fft))
    return start, end


def crop(waveform, config: AudioConfig) -> tf.Tensor:
    """The first `max_seconds` of a clip with `on_too_long="crop"`, else the clip.

    Args:
        waveform: float32 `(samples,)` at `config.sample_rate`.
        config: an `AudioConfig`.

    Returns:
        float32 `(min(samples, config.max_samples),)`.
    """
    waveform = tf.convert_to_tensor(waveform, tf.float32)
    if config.on_too_long == "crop":
        waveform = waveform[:config.max_samples]
    return waveform


def _kept_span(waveform, config, bounds=None):
    """The clip cropped to `max_seconds` (`crop`), then trimmed
    (`trim_top_db`, at `bounds` of the cropped clip when given)."""
    waveform = crop(waveform, config)
    if config.trim_top_db is not None:
        start, end = trim_bounds(waveform, config) if bounds is None else bounds
        waveform = waveform[start:end]
    return waveform


def _prepare_waveform(waveform, config, bounds=None):
    """The kept span (`_kept_span`), peak or RMS normalised (`normalize`)."""
    waveform = _kept_span(waveform, config, bounds)
    if config.normalize is not None:
        if config.normalize == "peak":
            level, target = tf.reduce_max(tf.abs(waveform)), 1.0
        else:
            level, target = tf.sqrt(tf.reduce_mean(tf.square(waveform))), config.rms_level
        waveform = waveform * (target / tf.where(level > 0.0, level, target))
    return waveform


def extract_features(waveform, config: AudioConfig, bounds=None) -> tf.Tensor:
    """The features the dataset builder computes (and caches) for one clip.

    In order: cropping (`on_too_long="crop"`), silence trimming
    (`trim_top_db`), peak or RMS normalisation (`normalize`),
    `log_mel` or `log_linear` (`features`, `log`), feature normalisation
    (`feature_norm`); see `AudioConfig`.

    Args:
        waveform: float32 `(samples,)` at `config.sample_rate`.
        config: an `AudioConfig`.
        bounds: `(start, end)` that `trim_bounds(crop(waveform, config),
            config)` gave for this clip, to trim there without finding them again (the
            builder keeps them from its pass without a cache). Defaults to
            None (found here when `trim_top_db` is set).

    Returns:
        float32 `(frames, config.num_features)` with
        `frames == feature_frames(waveform, config)`.
    """
    waveform = _prepare_waveform(waveform, config, bounds)
    features = (log_mel if config.features == "mel" else log_linear)(waveform, config)
    if config.feature_norm in ("utterance", "frame"):
        axis = 0 if config.feature_norm == "utterance" else 1
        mean, variance = tf.nn.moments(features, axes=[axis], keepdims=True)
        features = (features - mean) / (tf.sqrt(variance) + _EPSILON)
    elif config.feature_norm == "minmax":
        low, high = tf.reduce_min(features), tf.reduce_max(features)
        features = (features - low) / (high - low + _EPSILON)
    return features


def feature_frames(waveform, config: AudioConfig) -> tf.Tensor:
    """Frames `extract_features` returns for a clip, without computing them.

    Equals `config.num_frames(samples)` of the kept samples (cropped to
    `max_seconds` with `on_too_long="crop"`); with `trim_top_db` it
    depends on the clip's content (`trim_bounds`).

    Args:
        waveform: float32 `(samples,)` at `config.sample_rate`.
        config: an `AudioConfig`.

    Returns:
        int32 scalar.
    """
    samples = tf.shape(_kept_span(waveform, config))[0]
    if config.center:
        samples += 2 * (config.n_fft // 2)
    return tf.maximum(0, 1 + (samples - config.n_fft) // config.hop_length)


def _g711_tables():
    codes = np.arange(256)
    inverted = ~codes & 0xFF
    exponent = (inverted >> 4) & 7
    magnitude = ((((inverted & 0x0F) << 3) + 0x84) << exponent) - 0x84
    mu_law = np.where(inverted & 0x80, -magnitude, magnitude) / 32768.0
    toggled = codes ^ 0x55
    exponent = (toggled >> 4) & 7
    mantissa = (toggled & 0x0F) << 4
    magnitude = np.where(exponent == 0, mantissa + 8, (mantissa + 0x108) << np.maximum(exponent - 1, 0))
    a_law = np.where(toggled & 0x80, magnitude, -magnitude) / 32768.0
    return mu_law.astype(np.float32), a_law.astype(np.float32)


_MU_LAW, _A_LAW = _g711_tables()


def _int24(data):
    bytes3 = tf.reshape(tf.cast(tf.io.decode_raw(data, tf.uint8), tf.int32), [-1, 3])
    value = bytes3[:, 0] + bytes3[:, 1] * 256 + bytes3[:, 2] * 65536
    value = tf.where(value >= 2**23, value - 2**24, value)
    return tf.cast(value, tf.float32) / 2.0**23


def decode_wav(contents, data_offset, data_bytes, format_code, channels) -> tf.Tensor:
    """Decodes the audio data chunk of WAV bytes to mono float32 in [-1, 1].

    Args:
        contents: scalar string tensor, the whole file.
        data_offset, data_bytes: where the data chunk is (from
            `corpus.read_wav_header`; `data_bytes` a multiple of the frame
            size).
        format_code: `WavInfo.format_code` (encoding and bit depth).
        channels: channels in the file; they are averaged.

    Returns:
        float32 tensor `(frames,)`.
    """
    data = tf.strings.substr(contents, tf.cast(data_offset, tf.int32), tf.cast(data_bytes, tf.int32))

    def raw(dtype, scale):
        return lambda: tf.cast(tf.io.decode_raw(data, dtype, little_endian=True), tf.float32) / scale

    def table(values):
        return lambda: tf.gather(tf.constant(values), tf.cast(tf.io.decode_raw(data, tf.uint8), tf.int32))

    branches = [
        lambda: (tf.cast(tf.io.decode_raw(data, tf.uint8), tf.float32) - 128.0) / 128.0,
        raw(tf.int16, 32768.0),
        lambda: _int24(data),
        raw(tf.int32, 2.0**31),
        raw(tf.float32, 1.0),
        raw(tf.float64, 1.0),
        table(_MU_LAW),
        table(_A_LAW),
    ]
    samples = tf.switch_case(tf.cast(format_code, tf.int32), branches)
    samples = tf.reshape(samples, [-1, tf.cast(channels, tf.int32)])
    return tf.reduce_mean(samples, axis=1)


def resampled_length(num_samples, rate_in, rate_out):
    """Samples after `resample`: `round(num_samples * rate_out / rate_in)`."""
    return (num_samples * rate_out + rate_in // 2) // rate_in


def resample(waveform, rate_in, rate_out) -> tf.Tensor:
    """Band-limited FFT resampling of a mono clip (`scipy.signal.resample`).

    Args:
        waveform: float32 `(samples,)`.
        rate_in, rate_out: integer sample rates (tensors or ints).

    Returns:
        float32 `(resampled_length(samples, rate_in, rate_out),)`; the input
        itself when the rates are equal.
    """
    waveform = tf.convert_to_tensor(waveform, tf.float32)
    rate_in = tf.cast(rate_in, tf.int64)
    rate_out = tf.cast(rate_out, tf.int64)

    def convert():
        n = tf.shape(waveform, out_type=tf.int64)[0]
        n_out = resampled_length(n, rate_in, rate_out)
        spectrum = tf.signal.rfft(waveform)
        bins = n_out // 2 + 1
        spectrum = spectrum[: tf.minimum(bins, n // 2 + 1)]
        spectrum = tf.pad(spectrum, [[0, bins - tf.shape(spectrum, out_type=tf.int64)[0]]])
        out = tf.signal.irfft(spectrum, fft_length=tf.cast(n_out, tf.int32)[None])
        return out * tf.cast(n_out, tf.float32) / tf.cast(n, tf.float32)

    return tf.cond(tf.equal(rate_in, rate_out), lambda: waveform, convert)


_LAYER_FIELDS = ("sample_rate", "n_fft", "hop_length", "win_length", "n_mels", "fmin", "fmax",
                 "power", "mel_scale", "center", "log_floor", "mel_norm", "log", "log_offset")


@keras.saving.register_keras_serializable(package="keras_gpufix")
class LogMelSpectrogram(keras.layers.Layer):
    """Keras layer: waveforms `(batch, samples)` -> log-mel `(batch, frames, n_mels)`.

    The same maths as `kg.data.log_mel`, so features can be computed on the
    accelerator inside the model instead of in the input pipeline. Computes
    in float32 whatever the global dtype policy (half precision STFTs lose
    the low-energy bands); cast the output if the model runs in float16.

    Args:
        sample_rate: as in `AudioConfig`, with the same default; likewise
            `n_fft`, `hop_length`, `win_length`, `n_mels`, `fmin`, `fmax`,
            `power`, `mel_scale`, `center`, `log_floor`, `mel_norm`, `log`
            and `log_offset`.
        **kwargs: standard layer arguments.

    Example:

    >>> layer = kg.data.LogMelSpectrogram(n_mels=80)
    >>> layer(tf.zeros([2, 22050])).shape
    TensorShape([2, 87, 80])
    """

    def __init__(self, **kwargs):
        fields = {name: kwargs.pop(name) for name in _LAYER_FIELDS if name in kwargs}
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.config = AudioConfig(**fields)
        for name in _LAYER_FIELDS:
            setattr(self, name, getattr(self.config, name))
        self._filterbank = mel_filterbank(self.config)

    @classmethod
    def from_audio_config(cls, config: AudioConfig, **kwargs) -> "LogMelSpectrogram":
        """The layer for an `AudioConfig`'s log-mel (`max_seconds`,
        `on_too_long`, `rms_level` and `pad_value` do not apply to it).

        Raises:
            ValueError: the config asks for what the layer does not do on a
                batch (trimming, normalisation, linear features).
        """
        unsupported = {name: getattr(config, name)
                       for name in ("trim_top_db", "normalize", "feature_norm")
                       if getattr(config, name) is not None}
        if config.features != "mel":
            unsupported["features"] = config.features
        if unsupported:
            received = ", ".join(f"{k}={v!r}" for k, v in unsupported.items())
            raise ValueError(
                "LogMelSpectrogram computes log-mel features of whole batches; it does not "
                "trim, normalise or compute linear spectrograms. Use the builder's features "
                "(kg.data.extract_features) for these, or leave them at their defaults. "
                f"Received: {received}"
            )
        return cls(**{name: getattr(config, name) for name in _LAYER_FIELDS}, **kwargs)

    def call(self, inputs):
        return log_mel(tf.cast(inputs, tf.float32), self.config, self._filterbank)

    def compute_output_shape(self, input_shape):
        samples = input_shape[-1]
        frames = None if samples is None else self.config.num_frames(samples)
        return tuple(input_shape[:-1]) + (frames, self.n_mels)

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _LAYER_FIELDS})
        return config
