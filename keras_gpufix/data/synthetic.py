"""A generated LJSpeech-style corpus of speech-like audio (no downloads).

`make_synthetic_corpus(path, n_utterances)` writes `path/metadata.csv`
(`id|text|normalized_text`, one line per utterance) and `path/wavs/<id>.wav`
(16-bit PCM mono). The audio is a sequence of syllables: a glottal
pulse train with a gliding pitch through three formant resonances, an
optional noise burst (a fricative), and pauses between words. Each clip's duration
follows its transcript's length (about 14 characters per second, with
jitter), clipped to `[min_seconds, max_seconds]`, as in read speech.

`bad_files` appends one damaged or unusual utterance per named kind, with id
`bad_<kind>`, so that tests and demos can exercise the bad-input policy:

| kind            | what is written                                          |
|-----------------|----------------------------------------------------------|
| `stereo`        | 2-channel 16-bit PCM (handled: mixed down)               |
| `pcm8`          | 8-bit unsigned PCM (handled: converted)                  |
| `pcm24`         | 24-bit PCM (handled)                                     |
| `pcm32`         | 32-bit integer PCM (handled)                             |
| `float32`       | 32-bit IEEE float (handled)                              |
| `other_rate`    | 16-bit PCM at `sample_rate // 2` (handled: resampled)    |
| `truncated`     | header declares more audio than the file holds (skipped) |
| `not_wav`       | text bytes with a `.wav` name (skipped)                  |
| `empty_file`    | a 0-byte file (skipped)                                  |
| `empty_data`    | a valid header with an empty data chunk (skipped)        |
| `missing`       | a metadata line whose WAV does not exist (skipped)       |
| `empty_text`    | a whitespace-only transcript (skipped)                   |
| `invalid_utf8`  | a metadata line that is not UTF-8 (skipped)              |
| `too_long`      | a clip of `2 * max_seconds` (skipped when the builder's  |
|                 | `AudioConfig.max_seconds` is below it)                   |
| `duplicate_id`  | a second line reusing the first utterance's id (skipped) |
"""

import os
import struct

import numpy as np

__all__ = ["make_synthetic_corpus", "BAD_KINDS", "write_wav"]

BAD_KINDS = (
    "stereo",
    "pcm8",
    "pcm24",
    "pcm32",
    "float32",
    "other_rate",
    "truncated",
    "not_wav",
    "empty_file",
    "empty_data",
    "missing",
    "empty_text",
    "invalid_utf8",
    "too_long",
    "duplicate_id",
)

_WORDS = (
    "the of and to in a was he that his it with as for had by on which at "
    "be prisoner were from this but is not have all their been an they "
    "prisoners there or one who so would when upon into time other were "
    "them these two any more such only after court could under same man "
    "being about before great number new place made those first then "
    "newgate many officers king same law city chapter report commission "
    "evidence president secret service window building rifle motorcade "
    "oswald dallas morning street police station public life death"
).split()
_CHARS_PER_SECOND = 14.0


def write_wav(path, samples, sample_rate, sample_format="pcm16"):
    """Writes float samples in [-1, 1] as a WAV file.

    Args:
        path: file to write.
        samples: float array `(frames,)` or `(frames, channels)`.
        sample_rate: samples per second.
        sample_format: one of `"pcm8"`, `"pcm16"`, `"pcm24"`, `"pcm32"`,
            `"float32"`. Defaults to `"pcm16"`.
    """
    samples = np.clip(np.asarray(samples, np.float64), -1.0, 1.0)
    if samples.ndim == 1:
        samples = samples[:, None]
    channels = samples.shape[1]
    ints = {"pcm8": 8, "pcm16": 16, "pcm24": 24, "pcm32": 32}
    if sample_format in ints:
        tag, bits = 1, ints[sample_format]
        scale = 2.0 ** (bits - 1)
        values = np.clip(np.round(samples * scale), -scale, scale - 1).astype(np.int64)
        if bits == 8:
            data = (values + 128).astype(np.uint8).tobytes()
        else:
            data = values.astype("<i4").view(np.uint8).reshape(-1, 4)[:, : bits // 8].tobytes()
    elif sample_format == "float32":
        data, tag, bits = samples.astype("<f4").tobytes(), 3, 32
    else:
        raise ValueError(
            "`sample_format` must be one of pcm8, pcm16, pcm24, pcm32, float32. "
            f"Received: sample_format={sample_format!r}"
        )
    block_align = channels * bits // 8
    fmt = struct.pack(
        "<HHIIHH", tag, channels, sample_rate, sample_rate * block_align, block_align, bits
    )
    header = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    header += b"data" + struct.pack("<I", len(data))
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(header) + len(data)) + header + data)


def _sentence(rng, n_chars):
    words = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(_WORDS[rng.integers(len(_WORDS))])
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def _convolve(signal, response):
    size = len(signal) + len(response) - 1
    fft_size = 1 << (size - 1).bit_length()
    spectrum = np.fft.rfft(signal, fft_size) * np.fft.rfft(response, fft_size)
    return np.fft.irfft(spectrum, fft_size)[: len(signal)]


def _speech(rng, seconds, sample_rate):
    """Syllables: a glottal pulse train through formant resonances, noise, pauses."""
    n = max(1, int(round(seconds * sample_rate)))
    out = np.zeros(n, np.float64)
    pos = int(0.05 * sample_rate)
    f0_base = rng.uniform(95.0, 210.0)
    response_t = np.arange(int(0.025 * sample_rate)) / sample_rate
    while pos < n - int(0.05 * sample_rate):
        length = min(int(rng.uniform(0.12, 0.3) * sample_rate), n - pos)
        t = np.arange(length) / sample_rate
        f0 = f0_base * (1.0 + 0.08 * rng.standard_normal()) * (1.0 + 0.15 * t)
        pulses = np.diff(np.floor(np.cumsum(f0) / sample_rate), prepend=0.0)
        response = np.zeros_like(response_t)
        for low, high, bandwidth in ((300, 900, 80), (900, 2300, 120), (2300, 3200, 180)):
            freq = min(rng.uniform(low, high), 0.45 * sample_rate)
            response += np.exp(-np.pi * bandwidth * response_t) * np.sin(2 * np.pi * freq * response_t)
        syllable = _convolve(pulses, response) * np.sin(np.pi * np.arange(length) / length) ** 0.7
        if rng.random() < 0.35:
            burst = min(length, int(0.06 * sample_rate))
            noise = np.diff(rng.standard_normal(burst + 1)) * 0.3 * np.abs(syllable).max()
            syllable[:burst] += noise * np.hanning(burst)
        out[pos : pos + length] += syllable
        pos += length
        if rng.random() < 0.3:
            pos += int(rng.uniform(0.05, 0.25) * sample_rate)
    out /= max(np.max(np.abs(out)), 1e-9)
    return 0.5 * out + 3e-4 * rng.standard_normal(n)


def make_synthetic_corpus(
    path,
    n_utterances,
    seed=0,
    sample_rate=22050,
    min_seconds=1.0,
    max_seconds=10.0,
    bad_files=(),
):
    """Writes an LJSpeech-style corpus of synthetic speech-like audio.

    Args:
        path: directory to create (parents too); `metadata.csv` and `wavs/`
            are written inside it.
        n_utterances: number of good utterances (`LJ000-0000`, ...).
        seed: seed of the generator; the same arguments give the same files.
            Defaults to 0.
        sample_rate: sample rate of the WAV files. Defaults to 22050.
        min_seconds: shortest clip. Defaults to 1.0.
        max_seconds: longest clip. Defaults to 10.0.
        bad_files: kinds from `BAD_KINDS` (see the module docstring); each
            adds one utterance with id `bad_<kind>`. Defaults to none.

    Returns:
        The corpus directory as a string.

    Example:

    >>> corpus = make_synthetic_corpus("/tmp/corpus", 100, max_seconds=4.0)
    >>> builder = kg.data.SpeechDatasetBuilder(corpus)
    """
    if n_utterances < 1:
        raise ValueError(f"`n_utterances` must be >= 1. Received: n_utterances={n_utterances}")
    if not 0 < min_seconds <= max_seconds:
        raise ValueError(
            "`min_seconds` must be > 0 and <= `max_seconds`. "
            f"Received: min_seconds={min_seconds}, max_seconds={max_seconds}"
        )
    unknown = sorted(set(bad_files) - set(BAD_KINDS))
    if unknown:
        raise ValueError(f"`bad_files` must be kinds from {BAD_KINDS}. Received: {unknown}")
    rng = np.random.default_rng(seed)
    wavs = os.path.join(path, "wavs")
    os.makedirs(wavs, exist_ok=True)
    lines = []
    mean_seconds = (min_seconds + max_seconds) / 2
    spread = max_seconds - min_seconds
    for i in range(n_utterances):
        uid = f"LJ{i // 10000:03d}-{i % 10000:04d}"
        target = np.clip(rng.beta(2.2, 1.6) * spread + min_seconds, min_seconds, max_seconds)
        text = _sentence(rng, max(3, int(target * _CHARS_PER_SECOND)))
        seconds = float(np.clip(len(text) / _CHARS_PER_SECOND * rng.uniform(0.9, 1.1),
                                min_seconds, max_seconds))
        write_wav(os.path.join(wavs, uid + ".wav"), _speech(rng, seconds, sample_rate), sample_rate)
        lines.append(f"{uid}|{text}|{text}".encode())
    for kind in bad_files:
        uid = f"bad_{kind}"
        wav_path = os.path.join(wavs, uid + ".wav")
        text = _sentence(rng, int(mean_seconds * _CHARS_PER_SECOND))
        clip = _speech(rng, min_seconds, sample_rate)
        if kind == "stereo":
            write_wav(wav_path, np.stack([clip, 0.5 * clip], axis=1), sample_rate)
        elif kind in ("pcm8", "pcm24", "pcm32", "float32"):
            write_wav(wav_path, clip, sample_rate, sample_format=kind)
        elif kind == "other_rate":
            write_wav(wav_path, _speech(rng, min_seconds, sample_rate // 2), sample_rate // 2)
        elif kind == "truncated":
            write_wav(wav_path, clip, sample_rate)
            with open(wav_path, "r+b") as f:
                f.truncate(os.path.getsize(wav_path) // 2)
        elif kind == "not_wav":
            with open(wav_path, "wb") as f:
                f.write(b"this is not audio, just text with a .wav name\n" * 20)
        elif kind == "empty_file":
            open(wav_path, "wb").close()
        elif kind == "empty_data":
            write_wav(wav_path, np.zeros(0), sample_rate)
        elif kind == "too_long":
            write_wav(wav_path, _speech(rng, 2 * max_seconds, sample_rate), sample_rate)
        elif kind in ("empty_text", "invalid_utf8", "duplicate_id"):
            write_wav(wav_path, clip, sample_rate)
        if kind == "empty_text":
            text = "   "
        if kind == "invalid_utf8":
            lines.append(uid.encode() + b"|caf\xe9 au lait|caf\xe9 au lait")
        elif kind == "duplicate_id":
            first = lines[0].split(b"|")[0]
            lines.append(first + f"|{text}|{text}".encode())
        else:
            lines.append(f"{uid}|{text}|{text}".encode())
    with open(os.path.join(path, "metadata.csv"), "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return str(path)


