import os
import re

import numpy as np
import pytest

from keras_gpufix.data.corpus import Corpus, read_wav_header
from keras_gpufix.exceptions import GpufixWarning
from keras_gpufix.data.synthetic import BAD_KINDS, make_synthetic_corpus, write_wav

SKIPPED = {
    "truncated": "truncated WAV: the header declares",
    "not_wav": "not a WAV file",
    "empty_file": "empty file",
    "empty_data": "no audio samples",
    "missing": "missing file",
    "empty_text": "empty or whitespace-only transcript",
    "invalid_utf8": "not valid UTF-8",
    "too_long": "longer than max_seconds=1.0",
    "duplicate_id": "duplicate id 'LJ000-0000' (first at line 1)",
}
HANDLED = sorted(set(BAD_KINDS) - set(SKIPPED))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus")
    return make_synthetic_corpus(path, 6, sample_rate=8000, min_seconds=0.2, max_seconds=0.6,
                       bad_files=BAD_KINDS)


def test_make_corpus_is_ljspeech_shaped_and_reproducible(tmp_path):
    first = make_synthetic_corpus(tmp_path / "a", 5, seed=3, min_seconds=0.5, max_seconds=2.0)
    second = make_synthetic_corpus(tmp_path / "b", 5, seed=3, min_seconds=0.5, max_seconds=2.0)
    lines = open(os.path.join(first, "metadata.csv"), encoding="utf-8").read().splitlines()
    assert len(lines) == 5
    for line in lines:
        uid, text, normalized = line.split("|")
        assert re.fullmatch(r"LJ\d{3}-\d{4}", uid) and text == normalized
        info = read_wav_header(os.path.join(first, "wavs", uid + ".wav"))
        assert (info.sample_rate, info.channels, info.bits) == (22050, 1, 16)
        assert 0.5 <= info.seconds <= 2.0
        with open(os.path.join(first, "wavs", uid + ".wav"), "rb") as a, \
                open(os.path.join(second, "wavs", uid + ".wav"), "rb") as b:
            assert a.read() == b.read()


def test_durations_follow_transcript_length(tmp_path):
    path = make_synthetic_corpus(tmp_path, 40, seed=1, sample_rate=8000, min_seconds=1.0, max_seconds=10.0)
    corpus = Corpus.from_ljspeech(path)
    kept, _ = corpus.scan()
    seconds = [u.info.seconds for u in kept]
    chars = [len(u.text) for u in kept]
    assert np.corrcoef(seconds, chars)[0, 1] > 0.9
    assert min(seconds) < 4 and max(seconds) > 6


def test_header_scan(corpus_dir):
    wavs = os.path.join(corpus_dir, "wavs")
    assert read_wav_header(os.path.join(wavs, "bad_stereo.wav")).channels == 2
    assert read_wav_header(os.path.join(wavs, "bad_pcm24.wav")).bits == 24
    info = read_wav_header(os.path.join(wavs, "bad_float32.wav"))
    assert (info.format_tag, info.bits) == (3, 32)
    assert read_wav_header(os.path.join(wavs, "bad_other_rate.wav")).sample_rate == 4000
    info = read_wav_header(os.path.join(wavs, "LJ000-0001.wav"))
    assert info.data_offset == 44 and info.data_bytes == 2 * info.frames


def test_unsupported_encoding_names_the_fix(tmp_path):
    path = str(tmp_path / "adpcm.wav")
    write_wav(path, np.zeros(10), 8000)
    data = bytearray(open(path, "rb").read())
    data[20:22] = (2).to_bytes(2, "little")  # format tag 2: MS ADPCM
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"unsupported WAV encoding \(format tag 0x0002.*ffmpeg"):
        read_wav_header(path)


def test_skip_reports_every_bad_kind(corpus_dir):
    kept, skipped = Corpus.from_ljspeech(corpus_dir).scan("skip", max_seconds=1.0)
    by_id = {s["id"]: s for s in skipped}
    assert {u.id for u in kept} == {f"LJ000-{i:04d}" for i in range(6)} | {f"bad_{k}" for k in HANDLED}
    for kind, reason in SKIPPED.items():
        uid = "LJ000-0000" if kind == "duplicate_id" else f"bad_{kind}"
        entry = by_id[uid]
        assert reason in entry["reason"], (kind, entry)
        assert entry["path"].endswith(".wav") and entry["line"] > 6
    assert len(skipped) == len(SKIPPED)


@pytest.mark.parametrize("kind", sorted(SKIPPED))
def test_raise_names_file_line_and_reason(tmp_path, kind):
    path = make_synthetic_corpus(tmp_path, 2, sample_rate=8000, min_seconds=0.2, max_seconds=0.6,
                       bad_files=[kind])
    with pytest.raises(ValueError) as info:
        Corpus.from_ljspeech(path).scan("raise", max_seconds=1.0)
    message = str(info.value)
    assert "metadata.csv, 1 utterance(s): line 3 (id " in message
    assert ".wav" in message and 'on_bad_input="skip"' in message
    assert SKIPPED[kind].split(" (")[0] in message


def test_from_pairs(tmp_path):
    good = str(tmp_path / "good.wav")
    write_wav(good, np.zeros(800), 8000)
    corpus = Corpus.from_pairs([(good, "hello"), (str(tmp_path / "gone.wav"), "bye")])
    kept, skipped = corpus.scan()
    assert [u.id for u in kept] == ["good"] and kept[0].line == 1
    assert skipped == [{"id": "gone", "path": str(tmp_path / "gone.wav"), "line": 2,
                        "reason": "missing file"}]


def test_metadata_without_separator_and_unnormalized_column(tmp_path):
    write_wav(str(tmp_path / "a.wav"), np.zeros(800), 8000)
    os.makedirs(tmp_path / "wavs")
    os.replace(tmp_path / "a.wav", tmp_path / "wavs" / "a.wav")
    (tmp_path / "metadata.csv").write_text("a|Dr. 1|\nno separator here\n", encoding="utf-8")
    kept, skipped = Corpus.from_ljspeech(tmp_path).scan()
    assert kept[0].text == "Dr. 1"  # empty third column: the raw text is used
    assert skipped[0]["line"] == 2 and "no `|` separator" in skipped[0]["reason"]


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="metadata.csv does not exist"):
        Corpus.from_ljspeech(tmp_path)
    with pytest.raises(ValueError, match='`on_bad_input` must be "skip" or "raise"'):
        Corpus([], "x").scan(on_bad_input="ignore")


def _metadata_variant(tmp_path, data):
    path = make_synthetic_corpus(tmp_path, 3, sample_rate=8000, min_seconds=0.2, max_seconds=0.4)
    lines = open(os.path.join(path, "metadata.csv"), encoding="utf-8").read().splitlines()
    with open(os.path.join(path, "metadata.csv"), "wb") as f:
        f.write(data(lines))
    return path, [line.split("|")[0] for line in lines]


@pytest.mark.parametrize("encode", [
    lambda lines: b"\xef\xbb\xbf" + "\n".join(lines).encode("utf-8"),
    lambda lines: "\n".join(lines).encode("utf-16"),
    lambda lines: "\r\n".join(["id|text|normalized_text"] + lines).encode("utf-8"),
], ids=["utf8_bom", "utf16", "header_row"])
def test_real_world_metadata_keeps_every_utterance(tmp_path, encode):
    path, ids = _metadata_variant(tmp_path, encode)
    kept, skipped = Corpus.from_ljspeech(path).scan(on_bad_input="raise")
    assert [u.id for u in kept] == ids and skipped == []


def test_extra_columns_are_read_and_named_once(tmp_path):
    path, ids = _metadata_variant(
        tmp_path, lambda lines: "\n".join(line + "|spk|x" for line in lines).encode("utf-8"))
    with pytest.warns(GpufixWarning, match=r"3 line\(s\) have more than three .*lines 1, 2, 3\)"):
        corpus = Corpus.from_ljspeech(path)
    kept, _ = corpus.scan()
    assert [u.id for u in kept] == ids and all(u.text.strip() and "spk" not in u.text for u in kept)


def test_metadata_folder_is_named_as_a_folder(tmp_path):
    os.makedirs(tmp_path / "metadata.csv")
    with pytest.raises(ValueError, match=r"metadata.csv is a folder"):
        Corpus.from_ljspeech(tmp_path)


def test_raise_mode_lists_all_bad_items_once(tmp_path):
    path = make_synthetic_corpus(tmp_path, 2, sample_rate=8000, min_seconds=0.2, max_seconds=0.4)
    with open(os.path.join(path, "metadata.csv"), "a", encoding="utf-8") as f:
        f.writelines(f"gone{i}|text {i}|text {i}\n" for i in range(12))
    with pytest.raises(ValueError) as info:
        Corpus.from_ljspeech(path).scan(on_bad_input="raise")
    message = str(info.value)
    assert "12 utterance(s)" in message and "... and 2 more" in message
    assert all(f"'gone{i}'" in message for i in range(10)) and "'gone10'" not in message
    assert message.count("missing file") == 10 and "builder.report['skipped']" in message
