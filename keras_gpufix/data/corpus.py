"""Speech corpora: LJSpeech folders, JSON Lines manifests or pairs, scanned fast.

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
| manifest line that is not a JSON object,  | skipped / raised                   |
| lacks `audio_filepath` / `text`, or has a |                                    |
| field of the wrong type                   |                                    |
| NaN or infinite samples (float WAVs), or  | skipped / raised                   |
| samples far outside [-1, 1] (peak > 1e6)  |                                    |
| UTF-8 BOM, UTF-16 metadata.csv            | converted: read as text            |
| header row `id|text|...`                  | recognised and not read as a clip  |
| the same id in two corpora (`concat`)     | kept: ids prefixed by the source   |
| more than three columns                   | read; one warning names the lines  |
| duplicate id                              | later lines skipped / raised       |
| clip longer than `max_seconds`            | skipped / raised                   |
"""

import array
import dataclasses
import hashlib
import json
import os
import struct

import numpy as np
import tensorflow as tf

from keras_gpufix.exceptions import warn

__all__ = ["Corpus", "Utterance", "Utterances", "WavInfo", "bad_input_error", "read_wav_header",
           "FORMAT_CODES"]

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
    """One kept utterance: id, transcript, file facts, header and labels.

    `speaker`, `language` and `duration` (seconds, as the manifest says)
    are None when the corpus does not give them.
    """

    id: str
    path: str
    text: str
    line: int
    size: int
    mtime_ns: int
    info: WavInfo
    speaker: str = None
    language: str = None
    duration: float = None


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


# Float samples beyond this (full scale is 1.0) are a broken file; below it the
# features cannot overflow (|STFT| <= n_fft x peak, squared, stays far below float32's max).
_MAX_FLOAT_PEAK = 1e6


def _float_samples_problem(path, info) -> "str | None":
    """Why a float WAV's samples cannot make finite features, or None (PCM cannot fail)."""
    if info.format_tag != 3:
        return None
    dtype = np.dtype("<f4" if info.bits == 32 else "<f8")
    samples = np.fromfile(path, dtype, count=info.frames * info.channels, offset=info.data_offset)
    if not np.isfinite(samples).all():
        return "NaN or infinite samples in the audio; re-export or remove the file"
    peak = float(np.abs(samples).max())
    if peak > _MAX_FLOAT_PEAK:
        return (f"float samples far outside [-1, 1] (peak {peak:.3g}): the features would not "
                "be finite; re-export the file with samples in [-1, 1] or remove it")
    return None


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


def _read_lines(path):
    """`(line_number, bytes)` of a text file's non-empty lines.

    A UTF-8 BOM is dropped and a UTF-16 file (with BOM) is read as text.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        data = data.decode("utf-16").encode("utf-8")
    data = data.removeprefix(b"\xef\xbb\xbf")
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if raw.strip():
            yield number, raw


def _check_file(path, argument, what):
    if os.path.isdir(path):
        raise ValueError(f"`{argument}` must be {what}, but {path} is a folder. Received: {argument}={path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"`{argument}` must be {what}. Received: {argument}={path!r} ({path} does not exist)")


class _Strings:
    """Many strings as one UTF-8 buffer and int64 offsets: no Python object each."""

    def __init__(self, data: bytes, ends):
        self.data = data
        self.offsets = np.concatenate([[0], np.asarray(ends, np.int64)])

    def raw(self, index) -> bytes:
        return self.data[self.offsets[index]:self.offsets[index + 1]]

    def __getitem__(self, index) -> str:
        return self.raw(index).decode("utf-8", "surrogatepass")

    def lookup(self, rows):
        """`indices -> strings`: the strings of `rows[indices]` (a tensor of
        any shape), cut from one constant buffer in TF ops (no tf.string
        element per utterance is held)."""
        buffer = tf.constant(self.data)
        starts = tf.constant(self.offsets[rows])
        lengths = tf.constant(self.offsets[rows + 1] - self.offsets[rows])
        return lambda indices: tf.strings.substr(buffer, tf.gather(starts, indices),
                                                 tf.gather(lengths, indices))


_STRINGS = ("id", "path", "text")
_LABELS = ("speaker", "language")


class _Columns:
    """Utterances added one by one into columns (`Corpus`'s storage)."""

    def __init__(self):
        self.buffers = {key: (bytearray(), array.array("q")) for key in _STRINGS}
        self.line = array.array("q")
        self.duration = array.array("d")
        self.labels = {key: ({}, array.array("i")) for key in _LABELS}
        self.reasons = {}

    def __len__(self):
        return len(self.line)

    def add(self, id, path, text, line, reason=None, duration=None, speaker=None, language=None):
        if reason is not None:
            self.reasons[len(self.line)] = reason
        values = {"id": str(id), "path": os.path.abspath(str(path)),
                  "text": text if isinstance(text, str) else ""}
        for key, value in values.items():
            data, ends = self.buffers[key]
            data += value.encode("utf-8", "surrogatepass")
            ends.append(len(data))
        self.line.append(int(line))
        self.duration.append(np.nan if duration is None else float(duration))
        for key, value in (("speaker", speaker), ("language", language)):
            codes, column = self.labels[key]
            column.append(-1 if value is None else codes.setdefault(value, len(codes)))


def _label_table(names, codes, table, key):
    """`(table, codes)`: `names` (local code per name) mapped onto `table`, or
    onto their sorted list when `table` is None (None when there is no name)."""
    if table is None:
        table = sorted(names) or None
    mapping = np.full(len(names) + 1, -1, np.int32)  # index -1: no label
    position = {name: i for i, name in enumerate(table or ())}
    for name, code in names.items():
        if name not in position:
            raise ValueError(f"`{key}s` must list every {key} of the corpus. "
                             f"Received: {key}s={table!r:.200}, which lacks {name!r}")
        mapping[code] = position[name]
    return table, mapping[np.asarray(codes, np.int64)]


class Corpus:
    """A list of utterances with their WAV headers, and what was skipped.

    Build one with `Corpus.from_ljspeech(path)` (a folder with
    `metadata.csv` lines `id|text|normalized_text` and `wavs/<id>.wav`),
    `Corpus.from_manifest(path)` (JSON Lines, one utterance a line) or
    `Corpus.from_pairs([(wav_path, text), ...])`; combine corpora with
    `Corpus.concat`, hold out a validation set with `split`, then call
    `scan()`. `SpeechDatasetBuilder` scans for you.

    The utterances are held in columns (ids, paths and transcripts as UTF-8
    buffers, numbers as NumPy arrays), not one Python object each: a
    million utterances cost well under 1 KB each (`benchmarks/corpus_scale.py`).
    Paths are made absolute when the corpus is made.

    Args:
        records: list of dicts with keys `id`, `path`, `text`, `line` and,
            when known, `speaker`, `language`, `duration`; a line that
            could not be read has a `reason` instead of a usable text.
        source: where the records came from (named in error messages).
        name: short name of the source, the prefix of its ids in `concat`.
            Defaults to the file name of `source` without extension.
        speakers: the speaker table (speaker id `i` is `speakers[i]`).
            Defaults to the sorted distinct speakers of `records` (None
            when there is none); `split` passes the whole corpus's table on,
            so train and validation use the same ids.
        languages: the language table, like `speakers`.

    Example:

    >>> corpus = Corpus.from_manifest("data/train.jsonl")
    >>> train, val = corpus.split(0.05)
    >>> kept, skipped = train.scan(on_bad_input="skip", max_seconds=12.0)
    """

    def __init__(self, records, source, name=None, speakers=None, languages=None):
        if isinstance(records, _Columns):
            columns = records
        else:
            columns = _Columns()
            for record in records:
                columns.add(**{k: record.get(k) for k in ("id", "path", "text", "line", "reason",
                                                          "duration", "speaker", "language")})
        self.source = str(source)
        self.name = name or os.path.splitext(os.path.basename(self.source))[0]
        self.strings = {key: _Strings(bytes(data), ends)
                        for key, (data, ends) in columns.buffers.items()}
        self.lines = np.frombuffer(columns.line, np.int64).copy()
        self.durations = np.frombuffer(columns.duration, np.float64).copy()
        self.speakers, self.speaker_codes = _label_table(*columns.labels["speaker"], speakers,
                                                         "speaker")
        self.languages, self.language_codes = _label_table(*columns.labels["language"], languages,
                                                           "language")
        self.reasons = columns.reasons

    def __len__(self):
        return len(self.lines)

    @property
    def ids(self) -> list:
        """The utterance ids, in corpus order (bad lines included)."""
        return [self.strings["id"][i] for i in range(len(self))]

    def _rows_into(self, columns, rows, prefix=""):
        """Adds this corpus's `rows` to `columns` (ids prefixed by `prefix`)."""
        for i in rows:
            duration = self.durations[i]
            columns.add(prefix + self.strings["id"][i], self.strings["path"][i],
                        self.strings["text"][i], self.lines[i], self.reasons.get(i),
                        None if np.isnan(duration) else duration,
                        *(None if codes[i] < 0 else table[codes[i]] for codes, table in (
                            (self.speaker_codes, self.speakers),
                            (self.language_codes, self.languages))))

    @classmethod
    def from_path(cls, path) -> "Corpus":
        """A `.jsonl` / `.json` file through `from_manifest`, a folder through `from_ljspeech`."""
        path = os.fspath(path)
        if path.endswith((".jsonl", ".json")):
            return cls.from_manifest(path)
        return cls.from_ljspeech(path)

    @classmethod
    def from_ljspeech(cls, path, metadata="metadata.csv", use_normalized=True) -> "Corpus":
        """Reads `path/<metadata>`; WAVs are `path/wavs/<id>.wav`.

        Args:
            path: the corpus folder.
            metadata: the transcript file, relative to `path` (e.g.
                `"metadata_train.csv"`) or absolute. Defaults to
                `"metadata.csv"`.
            use_normalized: take the third column (LJSpeech's normalised
                text, numbers spelled out) when it is present and not
                empty. Defaults to True.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ValueError(f"`corpus` folder {path} does not exist: check the path. "
                             f"Received: corpus={path!r}")
        metadata = os.path.join(path, metadata)
        if os.path.isdir(metadata):
            raise ValueError(
                f"`corpus` must hold a {os.path.basename(metadata)} file, but {metadata} is a folder. "
                f"Received: corpus={path!r}"
            )
        if not os.path.isfile(metadata):
            raise ValueError(
                f"`corpus` must be a folder with {os.path.basename(metadata)}, a JSON Lines "
                f"manifest, a list of (wav_path, text) pairs or a Corpus. Received: "
                f"corpus={path!r} ({metadata} does not exist)"
            )
        columns, extra = _Columns(), []

        def record(uid, text, number, reason=None):
            columns.add(uid, os.path.join(path, "wavs", uid + ".wav"), text, number, reason)

        for number, raw in _read_lines(metadata):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                record(raw.split(b"|")[0].decode("utf-8", "replace"), None, number,
                       f"metadata line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            fields = line.split("|")
            if not len(columns) and [f.strip().lower() for f in fields[:2]] == ["id", "text"]:
                continue
            if len(fields) < 2:
                record(fields[0], None, number,
                       "metadata line has no `|` separator (expected id|text|normalized_text)")
                continue
            if len(fields) > 3:
                extra.append(number)
            text = fields[2] if use_normalized and len(fields) > 2 and fields[2].strip() else fields[1]
            record(fields[0], text, number)
        if extra:
            listed = ", ".join(map(str, extra[:_LISTED])) + (" ..." if len(extra) > _LISTED else "")
            warn(
                f"{metadata}: {len(extra)} line(s) have more than three `|` columns "
                f"(lines {listed}); only id|text|normalized_text were read and the "
                "rest of each line was ignored."
            )
        return cls(columns, metadata, name=os.path.basename(os.path.normpath(path)))

    @classmethod
    def from_manifest(cls, path) -> "Corpus":
        """Reads a JSON Lines manifest, NeMo's convention: one object a line.

        Keys: `audio_filepath` (absolute, or relative to the manifest's
        folder) and `text` are required; `id` (defaults to the file stem),
        `duration` (seconds), `speaker` and `language` are optional.
        A line that is not such an object is bad input, named by its line
        number.

        Args:
            path: the `.jsonl` / `.json` manifest file.
        """
        path = os.fspath(path)
        _check_file(path, "manifest", "a JSON Lines file")
        folder = os.path.dirname(os.path.abspath(path))
        columns = _Columns()
        for number, raw in _read_lines(path):
            record, reason = {"id": f"line-{number}", "path": path, "text": None, "line": number}, None
            try:
                item = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                item, reason = None, f"manifest line is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            except json.JSONDecodeError as exc:
                item, reason = None, f"manifest line is not valid JSON ({exc.msg} at column {exc.colno})"
            if item is not None:
                reason = _manifest_problem(item)
            if item is not None and reason is None:
                audio = os.path.join(folder, item["audio_filepath"])
                record.update(
                    id=str(item.get("id", os.path.splitext(os.path.basename(audio))[0])),
                    path=audio, text=item["text"], duration=item.get("duration"),
                    speaker=None if item.get("speaker") is None else str(item["speaker"]),
                    language=item.get("language"),
                )
            elif isinstance(item, dict) and isinstance(item.get("audio_filepath"), str):
                record.update(path=os.path.join(folder, item["audio_filepath"]))
            columns.add(**record, reason=reason)
        return cls(columns, path)

    @classmethod
    def from_pairs(cls, pairs) -> "Corpus":
        """Uses a list of `(wav_path, text)`; ids are the file stems and
        `line` is the 1-based position in the list."""
        columns = _Columns()
        for number, pair in enumerate(pairs, start=1):
            wav_path, text = pair
            uid = os.path.splitext(os.path.basename(str(wav_path)))[0]
            columns.add(uid, wav_path, text, number)
        return cls(columns, "the list of (wav_path, text) pairs", name="pairs")

    @classmethod
    def concat(cls, corpora) -> "Corpus":
        """Joins corpora; every id becomes `<name>/<id>` so none is dropped.

        `name` is each corpus's `name` (its folder or manifest stem), with
        `-2`, `-3`, ... added when two corpora have the same one. Speaker
        and language tables are merged (the same name is the same id).

        Args:
            corpora: a list of `Corpus`.
        """
        corpora = list(corpora)
        if not corpora or not all(isinstance(c, Corpus) for c in corpora):
            raise ValueError(f"`corpora` must be a non-empty list of Corpus. Received: corpora={corpora!r:.200}")
        columns, names = _Columns(), []
        for corpus in corpora:
            name, count = corpus.name, 1
            while name in names:
                count += 1
                name = f"{corpus.name}-{count}"
            names.append(name)
            corpus._rows_into(columns, range(len(corpus)), prefix=f"{name}/")
        return cls(columns, " + ".join(c.source for c in corpora), name="+".join(names))

    def split(self, val_fraction, seed=0) -> tuple:
        """Splits into `(train, val)` by hashing each id with `seed`.

        Each utterance goes to `val` when `sha256(seed, id)` falls below
        `val_fraction`, so the split is disjoint, complete, repeatable, and
        adding utterances never moves the others. Both parts keep this
        corpus's speaker and language tables.

        Args:
            val_fraction: share of utterances held out, in (0, 1).
            seed: another seed gives another split. Defaults to 0.
        """
        if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction` must be between 0 and 1. Received: val_fraction={val_fraction!r}")
        held_out = np.array([
            int.from_bytes(hashlib.sha256(f"{seed}\0".encode() + self.strings["id"].raw(i))
                           .digest()[:8], "big") / 2**64 < val_fraction
            for i in range(len(self))
        ], bool)
        parts = []
        for rows, which in ((np.flatnonzero(~held_out), "train"),
                            (np.flatnonzero(held_out), "validation")):
            columns = _Columns()
            self._rows_into(columns, rows)
            parts.append(Corpus(columns, f"{self.source} ({which} split)", self.name,
                                self.speakers, self.languages))
        return tuple(parts)

    def scan(self, on_bad_input="skip", max_seconds=None):
        """Reads every WAV header and sorts utterances into kept and skipped.

        Float WAVs are also read whole, to find NaN, infinite or absurdly large
        (peak > 1e6) samples.

        Args:
            on_bad_input: `"skip"` to drop and report bad utterances, or
                `"raise"` to raise one error listing all of them. Defaults
                to `"skip"`.
            max_seconds: clips longer than this are bad. Defaults to None
                (no limit).

        Returns:
            `(kept, skipped)`: the kept `Utterances` in corpus order (a
            sequence of `Utterance`, held in columns), and a list of dicts
            with keys `id`, `path`, `line`, `reason`.

        Raises:
            ValueError: with `on_bad_input="raise"`, listing the first bad
                utterances (file, metadata line, reason), their count and
                the fix.
        """
        if on_bad_input not in ("skip", "raise"):
            raise ValueError(
                f'`on_bad_input` must be "skip" or "raise". Received: on_bad_input={on_bad_input!r}'
            )
        count = len(self)
        facts = np.zeros((count, len(_FACTS)), np.int64)
        problems = {}
        for i in range(count):
            reason = self.reasons.get(i)
            if reason is None and not self.strings["text"][i].strip():
                reason = "empty or whitespace-only transcript"
            if reason is None:
                path = self.strings["path"][i]
                try:
                    stat = os.stat(path)
                    info = read_wav_header(path)
                    reason = _float_samples_problem(path, info)
                except FileNotFoundError:
                    reason = "missing file"
                except (OSError, ValueError) as exc:
                    reason = str(exc)
            if reason is None and max_seconds is not None and info.seconds > max_seconds:
                reason = f"clip of {info.seconds:.2f} s is longer than max_seconds={max_seconds}"
            if reason is None:
                facts[i] = [stat.st_size, stat.st_mtime_ns] + [
                    getattr(info, name) for name in _FACTS[2:]]
            else:
                problems[i] = reason
        self._mark_duplicates(problems)
        kept = np.ones(count, bool)
        kept[list(problems)] = False
        rows = np.flatnonzero(kept)
        skipped = [{"id": self.strings["id"][i], "path": self.strings["path"][i],
                    "line": int(self.lines[i]), "reason": problems[i]} for i in sorted(problems)]
        if skipped and on_bad_input == "raise":
            raise bad_input_error(self.source, skipped)
        return Utterances(self, rows, facts[rows]), skipped

    def _mark_duplicates(self, problems):
        """A later line with the id of a kept one is a duplicate (whatever
        else is wrong with it, unless the line itself could not be read)."""
        hashes = np.fromiter((hash(self.strings["id"].raw(i)) for i in range(len(self))),
                             np.int64, len(self))
        order = np.lexsort((np.arange(len(self)), hashes))
        same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
        groups = {}
        for position in same:  # rows sharing a hash: compare the ids themselves
            for row in order[position:position + 2]:
                groups.setdefault(self.strings["id"].raw(row), set()).add(int(row))
        for uid, rows in groups.items():
            rows = sorted(rows)
            first = next((r for r in rows if r not in problems), None)
            if first is None:
                continue
            for row in rows:
                if row > first and row not in self.reasons:
                    problems[row] = (f"duplicate id {uid.decode('utf-8')!r} "
                                     f"(first at line {self.lines[first]})")


# Integer facts of each kept utterance: its file's size and mtime, then its WAV header.
_FACTS = ("size", "mtime_ns", "sample_rate", "channels", "bits", "format_tag", "frames",
          "data_offset", "data_bytes")


class Utterances:
    """The kept utterances of a `Corpus.scan`, in columns; a sequence of `Utterance`.

    `utterances[i]` makes the `Utterance` of one; `column(name)` gives a
    NumPy column of all of them (`line`, `duration`, `speaker` and
    `language` codes, or a `WavInfo` / file fact: `size`, `mtime_ns`,
    `sample_rate`, `channels`, `bits`, `format_tag`, `format_code`,
    `frames`, `data_offset`, `data_bytes`); `string(name, i)` one string
    (`id`, `path`, `text`) and `lookup(name)` a TF function from indices to
    those strings; `take(indices)` a subset.

    Args:
        corpus: the `Corpus` scanned.
        rows: int64 row of each kept utterance in `corpus`.
        facts: int64 `(len(rows), len(_FACTS))`.
    """

    def __init__(self, corpus, rows, facts):
        self.corpus = corpus
        self.rows = np.asarray(rows, np.int64)
        self.facts = facts

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index) -> Utterance:
        row, strings, corpus = self.rows[index], self.corpus.strings, self.corpus
        facts = dict(zip(_FACTS, (int(v) for v in self.facts[index])))
        labels = [None if codes[row] < 0 else table[codes[row]] for codes, table in (
            (corpus.speaker_codes, corpus.speakers), (corpus.language_codes, corpus.languages))]
        duration = corpus.durations[row]
        return Utterance(strings["id"][row], strings["path"][row], strings["text"][row],
                         int(corpus.lines[row]), facts.pop("size"), facts.pop("mtime_ns"),
                         WavInfo(**facts), *labels, None if np.isnan(duration) else float(duration))

    def column(self, name) -> np.ndarray:
        if name == "format_code":  # WavInfo.format_code of each
            tags, bits = self.column("format_tag"), self.column("bits")
            codes = np.zeros(len(self), np.int64)
            for (tag, size), code in FORMAT_CODES.items():
                codes[(tags == tag) & (bits == size)] = code
            return codes
        if name in _FACTS:
            return self.facts[:, _FACTS.index(name)]
        return {"line": self.corpus.lines, "duration": self.corpus.durations,
                "speaker": self.corpus.speaker_codes,
                "language": self.corpus.language_codes}[name][self.rows]

    def string(self, name, index) -> str:
        return self.corpus.strings[name][self.rows[index]]

    def lookup(self, name):
        """`indices -> string tensor` of `name` (`id`, `path`, `text`), in TF ops."""
        return self.corpus.strings[name].lookup(self.rows)

    def take(self, indices) -> "Utterances":
        indices = np.asarray(indices, np.int64)
        return Utterances(self.corpus, self.rows[indices], self.facts[indices])

    def digest(self) -> str:
        """SHA-256 of every id, path, transcript, file size and mtime, in order."""
        digest = hashlib.sha256()
        for name in _STRINGS:
            strings = self.corpus.strings[name]
            for row in self.rows:
                digest.update(strings.raw(row) + b"\0")
        digest.update(np.ascontiguousarray(self.facts[:, :2]).tobytes())
        return digest.hexdigest()


def _manifest_problem(item):
    """Why a parsed manifest line is not a usable utterance, or None."""
    if not isinstance(item, dict):
        return f"manifest line is not a JSON object (got {type(item).__name__})"
    for key in ("audio_filepath", "text"):
        if not isinstance(item.get(key), str):
            return f"manifest line has no `{key}` string"
    for key, types in (("id", (str, int)), ("speaker", (str, int)), ("language", (str,)),
                       ("duration", (int, float))):
        value = item.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            return f"manifest field `{key}` must be {' or '.join(t.__name__ for t in types)}, got {value!r:.40}"
    return None
