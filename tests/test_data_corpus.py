import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

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
    with pytest.warns(GpufixWarning,
                      match=r"3 line\(s\) have more than three .*lines 1, 2, 3\)") as caught:
        corpus = Corpus.from_ljspeech(path)
    assert caught[0].filename == __file__
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


def _tone(seconds, rate=8000, freq=220.0):
    t = np.arange(int(seconds * rate)) / rate
    return 0.3 * np.sin(2 * np.pi * freq * t)


def _manifest_corpus(folder, name="train.jsonl", lines=None):
    """A two-speaker manifest with relative and absolute paths, plus bad lines."""
    os.makedirs(os.path.join(folder, "audio", "p1"), exist_ok=True)
    os.makedirs(os.path.join(folder, "audio", "p2"), exist_ok=True)
    good = []
    for i in range(6):
        speaker = "p1" if i % 2 else "p2"
        rel = os.path.join("audio", speaker, f"u{i}.wav")
        write_wav(os.path.join(folder, rel), _tone(0.2 + 0.05 * i), 8000)
        item = {"audio_filepath": rel if i < 3 else os.path.join(folder, rel),
                "text": f"utterance number {i}", "duration": 0.2 + 0.05 * i,
                "speaker": speaker, "language": "en" if i < 4 else "de"}
        if i == 5:
            item["id"] = "custom-id"
        good.append(item)
    if lines is None:
        lines = [json.dumps(item) for item in good[:2]] + [
            "{not json", "[1, 2]", json.dumps({"text": "no audio"}),
            json.dumps({"audio_filepath": "audio/p1/u1.wav", "text": "x", "speaker": [1]}),
            "",
        ] + [json.dumps(item) for item in good[2:]]
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path, good


def test_manifest_every_field_per_utterance(tmp_path):
    path, good = _manifest_corpus(str(tmp_path))
    corpus = Corpus.from_manifest(path)
    assert corpus.name == "train" and corpus.speakers == ["p1", "p2"] and corpus.languages == ["de", "en"]
    kept, skipped = corpus.scan()
    assert [u.id for u in kept] == ["u0", "u1", "u2", "u3", "u4", "custom-id"]
    for utterance, item in zip(kept, good):
        assert utterance.path == os.path.join(str(tmp_path), "audio", item["speaker"],
                                              os.path.basename(item["audio_filepath"]))
        assert (utterance.text, utterance.speaker, utterance.language, utterance.duration) == (
            item["text"], item["speaker"], item["language"], item["duration"])
        assert abs(utterance.info.seconds - item["duration"]) < 1e-3
    assert [(s["line"], s["reason"]) for s in skipped] == [
        (3, "manifest line is not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (4, "manifest line is not a JSON object (got list)"),
        (5, "manifest line has no `audio_filepath` string"),
        (6, "manifest field `speaker` must be str or int, got [1]"),
    ]
    with pytest.raises(ValueError, match=r"Bad input in .*train.jsonl, 4 utterance\(s\): line 3 "):
        corpus.scan(on_bad_input="raise")


def test_manifest_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"`manifest` must be a JSON Lines file.*does not exist"):
        Corpus.from_manifest(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="is a folder"):
        Corpus.from_manifest(tmp_path)


def test_ljspeech_other_metadata_file(tmp_path):
    path = make_synthetic_corpus(tmp_path, 4, sample_rate=8000, min_seconds=0.2, max_seconds=0.4)
    lines = open(os.path.join(path, "metadata.csv"), encoding="utf-8").read().splitlines()
    with open(os.path.join(path, "metadata_eval.csv"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines[:2]) + "\n")
    kept, _ = Corpus.from_ljspeech(path, metadata="metadata_eval.csv").scan()
    assert [u.id for u in kept] == [line.split("|")[0] for line in lines[:2]]
    assert kept[0].speaker is None and Corpus.from_ljspeech(path).speakers is None
    with pytest.raises(ValueError, match="metadata_train.csv does not exist"):
        Corpus.from_ljspeech(path, metadata="metadata_train.csv")


def test_concat_keeps_duplicate_ids_under_source_prefixes(tmp_path):
    first = make_synthetic_corpus(tmp_path / "a", 3, seed=1, sample_rate=8000, min_seconds=0.2, max_seconds=0.4)
    second = make_synthetic_corpus(tmp_path / "b", 3, seed=2, sample_rate=8000, min_seconds=0.2, max_seconds=0.4)
    manifest, _ = _manifest_corpus(str(tmp_path / "m"))
    a, b = Corpus.from_ljspeech(first), Corpus.from_ljspeech(second)
    assert a.ids == b.ids  # the same LJ ids in both
    joined = Corpus.concat([a, b, Corpus.from_manifest(manifest)])
    kept, skipped = joined.scan()
    assert [u.id for u in kept] == (["a/" + i for i in a.ids] + ["b/" + i for i in b.ids]
                                    + ["train/" + i for i in ("u0", "u1", "u2", "u3", "u4", "custom-id")])
    assert len(skipped) == 4 and joined.speakers == ["p1", "p2"]
    assert kept[0].path == os.path.join(first, "wavs", a.ids[0] + ".wav")
    assert kept[3].path == os.path.join(second, "wavs", b.ids[0] + ".wav")
    assert [c.split("/")[0] for c in Corpus.concat([a, a]).ids] == ["a"] * 3 + ["a-2"] * 3
    with pytest.raises(ValueError, match="`corpora` must be a non-empty list of Corpus"):
        Corpus.concat([])


def test_split_disjoint_complete_repeatable_and_stable(tmp_path):
    records = [{"id": f"utt{i:04d}", "path": f"{i}.wav", "text": "x", "line": i + 1,
                "speaker": f"s{i % 3}"} for i in range(1000)]
    corpus = Corpus(records, "mem")
    train, val = corpus.split(0.1)
    assert set(train.ids).isdisjoint(val.ids) and sorted(train.ids + val.ids) == sorted(corpus.ids)
    assert 70 <= len(val.ids) <= 130
    assert (train.ids, val.ids) == tuple(part.ids for part in corpus.split(0.1))
    assert val.ids != corpus.split(0.1, seed=1)[1].ids
    grown = Corpus(records + [{"id": "new", "path": "n.wav", "text": "y", "line": 1001}], "mem")
    g_train, g_val = grown.split(0.1)
    assert set(val.ids) <= set(g_val.ids) and set(train.ids) <= set(g_train.ids)
    only_s0 = Corpus([r for r in records if r["speaker"] == "s0"], "mem")
    assert only_s0.split(0.5)[1].speakers == ["s0"] and val.speakers == ["s0", "s1", "s2"]
    for bad in (0, 1, 1.5, "0.1"):
        with pytest.raises(ValueError, match="`val_fraction` must be between 0 and 1"):
            corpus.split(bad)


def test_float_wavs_with_nan_or_inf_are_bad_input(tmp_path):
    pairs = []
    for name, value in (("ok", None), ("nan", np.nan), ("inf", np.inf), ("huge", 3e38)):
        path = str(tmp_path / f"{name}.wav")
        write_wav(path, _tone(0.2), 8000, sample_format="float32")
        if value is not None:
            info = read_wav_header(path)
            with open(path, "r+b") as f:
                f.seek(info.data_offset + 4 * 100)
                f.write(np.array([value], "<f4").tobytes())
        pairs.append((path, name))
    kept, skipped = Corpus.from_pairs(pairs).scan()
    assert [u.id for u in kept] == ["ok"]
    assert [(s["id"], s["reason"]) for s in skipped] == [
        (name, "NaN or infinite samples in the audio; re-export or remove the file") for name in ("nan", "inf")
    ] + [("huge", "float samples far outside [-1, 1] (peak 3e+38): the features would not be finite; "
                  "re-export the file with samples in [-1, 1] or remove it")]
    with pytest.raises(ValueError, match=r"3 utterance\(s\): line 2 \(id 'nan', file .*nan.wav\): NaN"):
        Corpus.from_pairs(pairs).scan(on_bad_input="raise")


def test_kept_utterances_are_columns_with_a_sequence_view(tmp_path):
    paths = []
    for i, seconds in enumerate((0.2, 0.5, 0.3)):
        paths.append(str(tmp_path / f"u{i}.wav"))
        write_wav(paths[-1], _tone(seconds), 8000)
    records = [{"id": f"u{i}", "path": p, "text": f"text {i}", "line": i + 1,
                "speaker": "s1" if i else None, "duration": 0.5} for i, p in enumerate(paths)]
    records.append(dict(records[0], line=4))  # a duplicate id: skipped
    corpus = Corpus(records, "mem")
    assert all(isinstance(v, np.ndarray) for v in (corpus.lines, corpus.durations,
                                                   corpus.speaker_codes))
    kept, skipped = corpus.scan()
    assert [s["reason"] for s in skipped] == ["duplicate id 'u0' (first at line 1)"]
    assert [u.id for u in kept] == ["u0", "u1", "u2"] and len(kept) == 3
    assert kept.column("frames").tolist() == [read_wav_header(p).frames for p in paths]
    assert kept.column("format_code").tolist() == [read_wav_header(p).format_code for p in paths]
    assert kept[1].info == read_wav_header(paths[1]) and kept[1].speaker == "s1"
    assert kept[0].speaker is None and kept[0].duration == 0.5
    subset = kept.take([2, 0])
    assert [u.id for u in subset] == ["u2", "u0"] and subset[0] == kept[2]
    names = subset.lookup("id")(tf.constant([[1, 0]], tf.int64)).numpy().tolist()
    assert names == [[b"u0", b"u2"]]
    assert subset.string("text", 0) == "text 2"
