"""`AudioConfig`: how waveforms become features; its checks need no TensorFlow
(`keras-gpufix validate` runs them without importing it)."""

import dataclasses
import math

import numpy as np

__all__ = ["AudioConfig"]


FEATURES = ("mel", "linear")
NORMALIZE = (None, "peak", "rms")
FEATURE_NORM = (None, "utterance", "frame", "minmax")
MEL_NORM = ("slaney", None)
LOG = ("floor", "offset", None)
ON_TOO_LONG = ("skip", "crop")


def _is_number(value):
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """How waveforms become features (log-mel or log linear spectrogram).

    Every field is part of the feature cache's fingerprint: changing any of
    them computes a new cache entry.

    Args:
        sample_rate: rate of the features; other files are resampled.
            Defaults to 22050.
        n_fft: FFT size, also the frame length of silence trimming.
            Defaults to 1024.
        hop_length: samples between frames (of the features and of silence
            trimming). Defaults to 256.
        win_length: Hann window length (<= `n_fft`, centred in it); None
            means `n_fft`. Defaults to 1024.
        n_mels: mel bands. Defaults to 80.
        fmin: lowest filter edge in Hz. Defaults to 0.0.
        fmax: highest filter edge in Hz (<= `sample_rate / 2`); None means
            `sample_rate / 2`. Defaults to 8000.0.
        power: exponent of the magnitude (1.0 magnitude, 2.0 power).
            Defaults to 1.0.
        mel_scale: `"slaney"` (librosa's default) or `"htk"`. Defaults to
            `"slaney"`.
        center: pad `n_fft // 2` zeros on both sides so frame `t` is centred
            on sample `t * hop_length`. Defaults to True.
        mel_norm: `"slaney"` divides each mel filter by its bandwidth
            (librosa's default); None keeps peak-1 triangles (HTK,
            torchaudio's default, the XTTS recipe). Defaults to `"slaney"`.
        log: the log form. `"floor"`: `ln(max(spectrogram, log_floor))`;
            `"offset"`: `ln(spectrogram + log_offset)` (XTTS-style
            recipes); None: no log, the spectrogram itself (keras-io's CTC
            ASR uses `|STFT| ** 0.5`: `power=0.5`). Defaults to `"floor"`.
        log_floor: the floor of `log="floor"`. Defaults to 1e-5.
        log_offset: the offset of `log="offset"`. Defaults to 1e-6.
        max_seconds: the longest clip; what happens to longer ones is
            `on_too_long`. Defaults to None (no limit).
        on_too_long: `"skip"`: clips longer than `max_seconds` are bad
            input (skipped or raised, `on_bad_input`); `"crop"`: they keep
            their first `max_seconds` (before trimming, so the length the
            WAV header gives decides, as for skipping), so batch shapes
            stay bounded, and `builder.report["cropped"]` lists them.
            Defaults to `"skip"`.
        trim_top_db: trim leading and trailing frames quieter than this
            many dB below the loudest frame, as `librosa.effects.trim(y,
            top_db=trim_top_db, frame_length=n_fft, hop_length=hop_length)`
            (recipes often use 20 to 60). None keeps the whole clip.
            Defaults to None.
        normalize: `"peak"` scales each clip (after trimming) so its largest
            absolute sample is 1.0; `"rms"` so its root mean square is
            `rms_level` (silent clips are left alone); None keeps the
            levels. Defaults to None.
        rms_level: the target RMS of `normalize="rms"`. Defaults to 0.1.
        features: `"mel"` (`n_mels` log-mel bands) or `"linear"` (the log of
            `|STFT| ** power`, `n_fft // 2 + 1` bins, as ASR models on
            spectrograms use). Defaults to `"mel"`.
        pad_value: the value of padded feature frames in batches; None
            means silence: `ln(log_floor)`, `ln(log_offset)`, or 0.0 with
            `log=None`. Recipes that normalise features usually pad with
            0.0. Defaults to None.
        feature_norm: `"utterance"` subtracts from each feature bin its mean
            over the utterance's frames and divides by its standard
            deviation (+1e-10); `"frame"` does so for each frame across its
            bins (keras-io's CTC ASR); `"minmax"` maps each utterance to
            [0, 1]: `(x - min) / (max - min + 1e-10)` over all its values.
            Statistics come from the real frames only, never from padding.
            None keeps the log features. Defaults to None.
    """

    sample_rate: int = 22050
    n_fft: int = 1024
    hop_length: int = 256
    win_length: int | None = 1024
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = 8000.0
    power: float = 1.0
    mel_scale: str = "slaney"
    center: bool = True
    log_floor: float = 1e-5
    max_seconds: float | None = None
    trim_top_db: float | None = None
    normalize: str | None = None
    rms_level: float = 0.1
    features: str = "mel"
    pad_value: float | None = None
    feature_norm: str | None = None
    mel_norm: str | None = "slaney"
    log: str | None = "floor"
    log_offset: float = 1e-6
    on_too_long: str = "skip"

    def __post_init__(self):
        for name in ("sample_rate", "n_fft", "hop_length", "n_mels"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
        win_length = self.win_length
        if win_length is not None and not (
                isinstance(win_length, (int, np.integer)) and not isinstance(win_length, bool)
                and 1 <= win_length <= self.n_fft):
            raise ValueError(
                "`win_length` must be between 1 and `n_fft`. "
                f"Received: win_length={self.win_length}, n_fft={self.n_fft}"
            )
        for name in ("fmin", "fmax", "power", "max_seconds"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value)) and (
                    value is not None or name in ("fmin", "power")):
                raise ValueError(f"`{name}` must be a finite number"
                                 f"{'' if name in ('fmin', 'power') else ' or None'}. "
                                 f"Received: {name}={value!r}")
        nyquist = self.sample_rate / 2
        fmax = nyquist if self.fmax is None else self.fmax
        if not 0 <= self.fmin < fmax <= nyquist:
            raise ValueError(
                "`fmin` and `fmax` must satisfy 0 <= fmin < fmax <= sample_rate / 2. "
                f"Received: fmin={self.fmin}, fmax={self.fmax}, sample_rate={self.sample_rate}"
            )
        if self.mel_scale not in ("slaney", "htk"):
            raise ValueError(
                f'`mel_scale` must be "slaney" or "htk". Received: mel_scale={self.mel_scale!r}'
            )
        if self.power <= 0:
            raise ValueError(f"`power` must be > 0. Received: power={self.power}")
        for name in ("log_floor", "log_offset", "rms_level"):
            value = getattr(self, name)
            if not (_is_number(value) and 0 < value < math.inf):
                raise ValueError(f"`{name}` must be > 0. Received: {name}={value!r}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"`max_seconds` must be > 0. Received: max_seconds={self.max_seconds}")
        if self.trim_top_db is not None and not (_is_number(self.trim_top_db)
                                                 and 0 < self.trim_top_db < math.inf):
            raise ValueError(
                "`trim_top_db` must be a number of dB > 0 (e.g. 20 or 60), or None to keep "
                f"the whole clip. Received: trim_top_db={self.trim_top_db!r}"
            )
        for name, allowed in (("normalize", NORMALIZE), ("features", FEATURES),
                              ("feature_norm", FEATURE_NORM), ("mel_norm", MEL_NORM),
                              ("log", LOG), ("on_too_long", ON_TOO_LONG)):
            value = getattr(self, name)
            if value not in allowed:
                choices = " or ".join("None" if a is None else f'"{a}"' for a in allowed)
                raise ValueError(f"`{name}` must be {choices}. Received: {name}={value!r}")
        if self.pad_value is not None and not (_is_number(self.pad_value)
                                               and math.isfinite(self.pad_value)):
            raise ValueError(
                "`pad_value` must be a finite number (e.g. 0.0), or None for silence "
                f"(ln(log_floor)). Received: pad_value={self.pad_value!r}"
            )
        if self.on_too_long == "crop" and self.max_seconds is None:
            raise ValueError(
                '`on_too_long="crop"` needs `max_seconds` (the length to crop to). '
                f"Received: on_too_long={self.on_too_long!r}, max_seconds=None"
            )

    @property
    def num_features(self) -> int:
        """Feature bins per frame: `n_mels`, or `n_fft // 2 + 1` for `"linear"`."""
        return self.n_mels if self.features == "mel" else self.n_fft // 2 + 1

    @property
    def padding_value(self) -> float:
        """What padded feature frames hold: `pad_value`, or silence
        (`ln(log_floor)`, `ln(log_offset)`, or 0.0 with `log=None`)."""
        if self.pad_value is not None:
            return float(self.pad_value)
        return {"floor": math.log(self.log_floor), "offset": math.log(self.log_offset),
                None: 0.0}[self.log]

    @property
    def max_samples(self) -> int | None:
        """Samples of `max_seconds` at `sample_rate` (None without a limit)."""
        return None if self.max_seconds is None else int(round(self.max_seconds * self.sample_rate))

    @property
    def frames_per_second(self) -> float:
        """Feature frames per second of audio: `sample_rate / hop_length`."""
        return self.sample_rate / self.hop_length

    def num_frames(self, num_samples):
        """Frames of a clip of `num_samples` (before trimming, an upper bound):
        an int, or an int64 array for an array of sample counts."""
        if self.center:
            num_samples = num_samples + 2 * (self.n_fft // 2)
        frames = 1 + (num_samples - self.n_fft) // self.hop_length
        return np.maximum(frames, 0) if isinstance(frames, np.ndarray) else max(frames, 0)
