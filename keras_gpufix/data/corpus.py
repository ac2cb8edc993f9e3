"""Speech corpora: LJSpeech folders or `(wav_path, text)` pairs, scanned fast.

`Corpus` reads the transcript list and then only the header of each WAV file
(RIFF chunks up to the start of the audio data), so every clip's sample rate,
channels, encoding and length are known before any decoding, and bad files
are found up front instead of as a TensorFlow error in the middle of an
epoch. Each problem is a *reason* string; `Corpus.scan(on_bad_input=...)`
either skips and reports the utterance or raises one `ValueError` naming the
file, the metadata line and the reason.

Problems and what happens (`converted` ones are handled, never skipped):

| problem                                   | outcome                            |
|-------------------------------------------|------------------------------------|
| stereo / multichannel                     | converted: mixed down to mono      |
| 8, 24, 32-bit PCM, float32/64, mu/A-law,  | converted: decoded to float32      |
| WAVE_FORMAT_EXTENSIBLE of those           |                                    |
| another sample rate                       | converted: resampled               |
| missing file, empty file, non-WAV bytes   | skipped / raised                   |
| truncated data chunk, empty data chunk    | skipped / raised                   |
| other encodings (ADPCM, ...)              | skipped / raised                   |
| empty or whitespace transcript            | skipped / raised                   |
| metadata line that is not UTF-8 or has no | skipped / raised                   |
| `|` separator                             |                                    |
| UTF-8 BOM, UTF-16 metadata.csv            | converted: read as text            |
| header row `id|text|...`                  | recognised and not read as a clip  |
| more than three columns                   | read; one warning names the lines  |
| duplicate id                              | later lines skipped / raised       |
| clip longer than `max_seconds`            | skipped / raised                   |
"""

import dataclasses
import os
import struct
import warnings

from keras_gpufix.exceptions import GpufixWarning

__all__ = ["Corpus", "Utterance", "WavInfo", "bad_input_error", "read_wav_header", "FORMAT_CODES"]

# Encodings the TF-native decoder in `audio.py` reads, keyed by
# (WAVE format tag, bits per sample); the value is the decoder branch.
FORMAT_CODES = {
    (1, 8): 0,  # unsigned 8-bit PCM
    (1, 16): 1,
    (1, 24): 2,
    (1, 32): 3,
    (3, 32): 4,  # IEEE float
    (3, 64): 5,
    (7, 8): 6,  # mu-law
    (6, 8): 7,  # A-law
}
_EXTENSIBLE = 0xFFFE
# How many bad items a raised error lists before giving the count.
_LISTED = 10


@dataclasses.dataclass(frozen=True)
class WavInfo:
    """What a WAV header says: enough to decode without parsing it again."""

    sample_rate: int
    channels: int
    bits: int
    format_tag: int
    frames: int
    data_offset: int
    data_bytes: int

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate

    @property
    def format_code(self) -> int:
        return FORMAT_CODES[(self.format_tag, self.bits)]


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One kept utterance: id, transcript, file facts and header."""

    id: str
    path: str
    text: str
    line: int
    size: int
    mtime_ns: int
    info: WavInfo


def read_wav_header(path) -> WavInfo:
    """Reads a WAV file's header (never its audio data).

    Args:
        path: the WAV file.

    Returns:
        A `WavInfo`.

    Raises:
        ValueError: with the reason when the file is not a readable WAV
            (empty, not RIFF/WAVE, truncated, no audio, unsupported encoding).
        OSError: when the file cannot be opened.
    """
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError("empty file (0 bytes)")
    with open(path, "rb") as f:
        riff = f.read(12)
        if len(riff) < 12 or riff[:4] != b"RIFF" or riff[8:12] != b"WAVE":
            raise ValueError("not a WAV file (no RIFF/WAVE header)")
        fmt = None
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                raise ValueError("truncated WAV: no data chunk" if fmt else "no fmt chunk")
            chunk_id, chunk_size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if chunk_id == b"fmt ":
                body = f.read(chunk_size + (chunk_size & 1))
                if len(body) < 16:
                    raise ValueError("truncated WAV: fmt chunk too short")
                fmt = body
            elif chunk_id == b"data":
                data_offset = f.tell()
                break
            else:
                f.seek(chunk_size + (chunk_size & 1), os.SEEK_CUR)
    if fmt is None:
        raise ValueError("no fmt chunk before the data chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE:
        if len(fmt) < 26:
            raise ValueError("WAVE_FORMAT_EXTENSIBLE header without a sub-format")
        tag = struct.unpack("<H", fmt[24:26])[0]
    if channels < 1 or rate < 1 or block_align != channels * bits // 8 or bits % 8:
        raise ValueError(
            f"invalid fmt chunk (channels={channels}, sample_rate={rate}, "
            f"bits={bits}, block_align={block_align})"
        )
    if (tag, bits) not in FORMAT_CODES:
        raise ValueError(
            f"unsupported WAV encoding (format tag {tag:#06x}, {bits} bits); "
            "convert it to PCM, e.g. `ffmpeg -i in.wav -c:a pcm_s16le out.wav`"
        )
    available = size - data_offset
    declared = struct.unpack("<I", chunk[4:])[0]
    if declared == 0xFFFFFFFF:  # streamed writers that never patched the size
        declared = available
    if declared > available:
        raise ValueError(
            f"truncated WAV: the header declares {declared} bytes of audio, "
            f"the file holds {available}"
        )
    frames = declared // block_align
    if frames == 0:
        raise ValueError("no audio samples (empty data chunk)")
    return WavInfo(rate, channels, bits, tag, frames, data_offset, frames * block_align)


def bad_input_error(source, skipped) -> ValueError:
    """The one error of `on_bad_input="raise"`: all bad utterances at once.

    Args:
        source: where the utterances came from (a metadata file, ...).
        skipped: dicts with keys `id`, `path`, `line`, `reason`.

    Returns:
        A `ValueError` listing the first bad utterances, their count and
        where the full list is.
    """
    listed = "; ".join(
        f"line {item['line']} (id {item['id']!r}, file {item['path']}): {item['reason']}"
        for item in skipped[:_LISTED]
    )
    more = f" ... and {len(skipped) - _LISTED} more" if len(skipped) > _LISTED else ""
    return ValueError(
        f"Bad input in {source}, {len(skipped)} utterance(s): {listed}{more}. "
        'Fix or remove them, or pass on_bad_input="skip" to skip them; the full '
        "list is then in builder.report['skipped'] (`keras-gpufix cache build --json`)."
    )


class Corpus:
    """A list of utterances with their WAV headers, and what was skipped.

    Build one with `Corpus.from_ljspeech(path)` (a folder with
    `metadata.csv` lines `id|text|normalized_text` and `wavs/<id>.wav`) or
    `Corpus.from_pairs([(wav_path, text), ...])`, then call `scan()`.
    `SpeechDatasetBuilder` does both for you.

    Args:
        records: list of `(id, wav_path, text, line)`; `text` is None for a
            line that could not be read, with the reason in `problems`.
        source: where the records came from (named in error messages).
        problems: dict `line -> reason` for lines rejected while parsing.

    Example:

    >>> corpus = Corpus.from_ljspeech("data/LJSpeech-1.1")
    >>> kept, skipped = corpus.scan(on_bad_input="skip", max_seconds=12.0)
    """

    def __init__(self, records, source, problems=None):
        self.records = list(records)
        self.source = str(source)
        self.problems = dict(problems or {})

    @classmethod
    def from_ljspeech(cls, path, use_normalized=True) -> "Corpus":
        """Reads `path/metadata.csv`; WAVs are `path/wavs/<id>.wav`.

        Args:
            path: the corpus folder.
            use_normalized: take the third column (LJSpeech's normalised
                text, numbers spelled out) when it is present and not
                empty. Defaults to True.
        """
        metadata = os.path.join(path, "metadata.csv")
        if os.path.isdir(metadata):
            raise ValueError(
                f"`corpus` must hold a metadata.csv file, but {metadata} is a folder. "
                f"Received: corpus={path!r}"
            )
        if not os.path.isfile(metadata):
            raise ValueError(
                f"`corpus` must be a folder with metadata.csv, a list of "
                f"(wav_path, text) pairs or a Corpus. Received: corpus={path!r} "
                f"({metadata} does not exist)"
            )
        with open(metadata, "rb") as f:
            data = f.read()
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            data = data.decode("utf-16").encode("utf-8")
        data = data.removeprefix(b"\xef\xbb\xbf")
        records, problems, extra = [], {}, []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            raw = raw.rstrip(b"\r")
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                uid = raw.split(b"|")[0].decode("utf-8", "replace")
                problems[number] = f"metadata line is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                records.append((uid, os.path.join(path, "wavs", uid + ".wav"), None, number))
                continue
            if not records and [f.strip().lower() for f in line.split("|")[:2]] == ["id", "text"]:
                continue
            fields = line.split("|")
            if len(fields) < 2:
                problems[number] = "metadata line has no `|` separator (expected id|text|normalized_text)"
                records.append((fields[0], os.path.join(path, "wavs", fields[0] + ".wav"), None, number))
                continue
            if len(fields) > 3:
                extra.append(number)
            text = fields[1]
            if use_normalized and len(fields) > 2 and fields[2].strip():
                text = fields[2]
            uid = fields[0]
            records.append((uid, os.path.join(path, "wavs", uid + ".wav"), text, number))
        if extra:
            listed = ", ".join(map(str, extra[:_LISTED])) + (" ..." if len(extra) > _LISTED else "")
            warnings.warn(
                f"{metadata}: {len(extra)} line(s) have more than three `|` columns "
                f"(lines {listed}); only id|text|normalized_text were read and the "
                "rest of each line was ignored.",
                GpufixWarning,
                stacklevel=2,
            )
        return cls(records, metadata, problems)

    @classmethod
    def from_pairs(cls, pairs) -> "Corpus":
        """Uses a list of `(wav_path, text)`; ids are the file stems and
        `line` is the 1-based position in the list."""
        records = []
        for number, pair in enumerate(pairs, start=1):
            wav_path, text = pair
            uid = os.path.splitext(os.path.basename(str(wav_path)))[0]
            records.append((uid, str(wav_path), text, number))
        return cls(records, "the list of (wav_path, text) pairs")

    def scan(self, on_bad_input="skip", max_seconds=None):
        """Reads every WAV header and sorts utterances into kept and skipped.

        Args:
            on_bad_input: `"skip"` to drop and report bad utterances, or
                `"raise"` to raise one error listing all of them. Defaults
                to `"skip"`.
            max_seconds: clips longer than this are bad. Defaults to None
                (no limit).

        Returns:
            `(kept, skipped)`: a list of `Utterance` in corpus order, and a
            list of dicts with keys `id`, `path`, `line`, `reason`.

        Raises:
            ValueError: with `on_bad_input="raise"`, listing the first bad
                utterances (file, metadata line, reason), their count and
                the fix.
        """
        if on_bad_input not in ("skip", "raise"):
            raise ValueError(
                f'`on_bad_input` must be "skip" or "raise". Received: on_bad_input={on_bad_input!r}'
            )
        kept, skipped, seen = [], [], {}
        for uid, path, text, line in self.records:
            reason, info, stat = self.problems.get(line), None, None
            if reason is None and uid in seen:
                reason = f"duplicate id {uid!r} (first at line {seen[uid]})"
            if reason is None and (not isinstance(text, str) or not text.strip()):
                reason = "empty or whitespace-only transcript"
            if reason is None:
                try:
                    stat = os.stat(path)
                    info = read_wav_header(path)
                except FileNotFoundError:
                    reason = "missing file"
                except (OSError, ValueError) as exc:
                    reason = str(exc)
            if reason is None and max_seconds is not None and info.seconds > max_seconds:
                reason = f"clip of {info.seconds:.2f} s is longer than max_seconds={max_seconds}"
            if reason is not None:
                skipped.append({"id": uid, "path": path, "line": line, "reason": reason})
                continue
            seen[uid] = line
            kept.append(Utterance(uid, os.path.abspath(path), text, line,
                                  stat.st_size, stat.st_mtime_ns, info))
        if skipped and on_bad_input == "raise":
            raise bad_input_error(self.source, skipped)
        return kept, skipped
