import json
import os
import re

import pytest
from edge_faults import read_only_folder

from keras_gpufix.cli import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from keras_gpufix.data.synthetic import make_synthetic_corpus

    return make_synthetic_corpus(str(tmp_path_factory.mktemp("cli") / "corpus"), 24, max_seconds=2.0,
                       bad_files=("empty_file",))


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def test_help_and_version(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert "keras-gpufix" in capsys.readouterr().out


@pytest.mark.parametrize("argv, name", [
    (["bench-data", "c", "--batch-sizes", "8,x"], "--batch-sizes"),
    (["bench-data", "c", "--seconds", "0"], "--seconds"),
    (["bench-data", "c", "--parallel", "auto,-1"], "--parallel"),
    (["diagnose", "--steps", "0", "--", "python", "t.py"], "--steps"),
    (["cache", "explode", "c"], "action"),
    (["demo", "--utterances", "zero"], "--utterances"),
])
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, name):
    assert main(argv) == 2
    assert name in capsys.readouterr().err


def test_cache_build_info_clear(corpus, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    os.mkdir(cache)
    assert main(["cache", "info", corpus, "--cache-dir", cache, "--json"]) == 0
    info = last_json(capsys.readouterr().out)
    assert info["status"] == "missing" and info["utterances"] == 24 and len(info["skipped"]) == 1

    assert main(["cache", "build", corpus, "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "cache miss" in out and "status:       fresh" in out
    # not a terminal: one line says what runs, no progress bar (no \r, no ANSI codes)
    assert "Computing the features of 24 utterances into" in out
    assert "\r" not in out and "\x1b[" not in out

    assert main(["cache", "build", corpus, "--cache-dir", cache, "--json"]) == 0
    built = last_json(capsys.readouterr().out)
    assert built["build"] == "hit" and built["size_bytes"] > 0
    assert built["fingerprint"] == info["fingerprint"]

    assert main(["cache", "clear", corpus, "--cache-dir", cache]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert main(["cache", "info", corpus, "--cache-dir", cache, "--json"]) == 0
    assert last_json(capsys.readouterr().out)["status"] == "missing"


def test_cache_build_into_a_new_relative_folder(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["cache", "build", corpus, "--cache-dir", "new/cache"]) == 0
    out = capsys.readouterr().out
    assert "cache miss" in out and "status:       fresh" in out
    assert os.path.isdir(tmp_path / "new" / "cache")


def test_cache_takes_a_json_lines_manifest(corpus, tmp_path, capsys):
    manifest = tmp_path / "train.jsonl"
    with open(os.path.join(corpus, "metadata.csv"), encoding="utf-8") as f:
        lines = [line.split("|") for line in f.read().splitlines()]
    manifest.write_text("".join(
        json.dumps({"audio_filepath": os.path.join(corpus, "wavs", uid + ".wav"), "text": text,
                    "speaker": "s1"}) + "\n" for uid, text, *_ in lines[:5]), encoding="utf-8")
    (tmp_path / "c").mkdir()
    assert main(["cache", "info", str(manifest), "--cache-dir", str(tmp_path / "c"), "--json"]) == 0
    info = last_json(capsys.readouterr().out)
    assert info["status"] == "missing" and info["utterances"] == 5
    assert main(["cache", "info", str(tmp_path / "none.jsonl"), "--cache-dir", "/tmp"]) == 2
    assert "JSON Lines manifest" in capsys.readouterr().err


def test_cache_needs_a_folder(corpus, capsys):
    assert main(["cache", "info", corpus]) == 2
    assert "--cache-dir" in capsys.readouterr().err
    assert main(["cache", "info", "/no/such/corpus", "--cache-dir", "/tmp"]) == 2
    assert "CORPUS" in capsys.readouterr().err


def test_cache_takes_settings_from_a_config(corpus, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  audio: {{n_mels: 40}}\n  cache_dir: {tmp_path / 'cc'}\n")
    (tmp_path / "cc").mkdir()
    assert main(["cache", "info", corpus, "--cache-dir", str(tmp_path / "cc"), "--json"]) == 0
    default = last_json(capsys.readouterr().out)
    assert main(["cache", "info", corpus, "--config", str(cfg), "--json"]) == 0
    from_config = last_json(capsys.readouterr().out)
    assert from_config["cache_dir"] == str(tmp_path / "cc")
    assert from_config["fingerprint"] != default["fingerprint"]  # n_mels is part of it


def test_bench_data_grid_and_recommendation(corpus, tmp_path, capsys):
    argv = ["bench-data", corpus, "--batch-sizes", "4,8", "--parallel", "auto,1",
            "--seconds", "0.3", "--num-buckets", "2", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[4/4]" in out and "recommended: batch_size=" in out and "steps/s" in out
    assert "\r" not in out and "\x1b[" not in out
    assert main(argv + ["--json"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["cache"] == "hit"
    assert [(r["batch_size"], r["parallel"]) for r in result["runs"]] == [
        (4, "auto"), (4, 1), (8, "auto"), (8, 1)]
    assert all(r["batches"] > 0 and r["utterances_per_s"] > 0 for r in result["runs"])
    best = max(result["runs"], key=lambda r: r["utterances_per_s"])
    assert result["best"] == best


def _leftover(cache, size):
    """What a failed or killed build leaves in `cache`: a hidden temporary folder."""
    (cache / ".features-0123.tmp-abc").mkdir(parents=True)
    (cache / ".features-0123.tmp-abc" / "part").write_bytes(b"x" * size)


def test_cache_build_lists_skipped_files_and_leftovers_are_shown_and_cleared(corpus, tmp_path,
                                                                            capsys):
    cache = tmp_path / "cache"
    _leftover(cache, 4096)
    assert main(["cache", "build", corpus, "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "leftovers (1, from interrupted or failed builds" in out
    skipped = [line for line in out.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 1 and "empty" in skipped[0] and ".wav" in skipped[0]
    assert main(["cache", "build", corpus, "--cache-dir", str(cache), "--json"]) == 0
    [entry] = last_json(capsys.readouterr().out)["skipped"]
    assert entry["path"].endswith(".wav") and entry["path"] in skipped[0] and entry["reason"]
    assert main(["cache", "clear", corpus, "--cache-dir", str(cache), "--json"]) == 0
    cleared = last_json(capsys.readouterr().out)
    assert ".features-0123.tmp-abc" in cleared["removed"] and cleared["freed_bytes"] >= 4096
    assert not (cache / ".features-0123.tmp-abc").exists()


def test_a_failed_builds_leftover_alone_is_shown_by_info_and_removed_by_clear(corpus, tmp_path,
                                                                             capsys):
    cache = tmp_path / "cache"
    _leftover(cache, 8192)  # no entry: as an older version's disk-full build left it
    assert main(["cache", "info", corpus, "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "status:       missing" in out and "leftovers (1, from interrupted or failed builds" in out
    assert main(["cache", "clear", corpus, "--cache-dir", str(cache), "--all"]) == 0
    out = capsys.readouterr().out
    assert "nothing to clear" not in out and ".features-0123.tmp-abc" in out
    assert os.listdir(cache) == []


def test_cache_build_disk_full_exits_2_with_one_line_and_nothing_left(corpus, tmp_path, capsys,
                                                                       monkeypatch):
    import errno

    from keras_gpufix.data.builder import SpeechDatasetBuilder
    from keras_gpufix.data.cache import FeatureCache

    def full(self, paths):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    monkeypatch.setattr(SpeechDatasetBuilder, "_write_features", full)
    cache = tmp_path / "cache"
    assert main(["cache", "build", corpus, "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert str(cache) in err[-1] and "is full" in err[-1] and "Traceback" not in "".join(err)
    assert "the entry needs about" in err[-1]  # the estimate made before building
    assert FeatureCache.leftovers(str(cache)) == [] and FeatureCache.entries(str(cache)) == []


def test_cache_build_in_a_file_exits_2_naming_the_folder(corpus, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["cache", "build", corpus, "--cache-dir", str(blocker / "cache")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "a_file is a file, not a directory" in err


def test_read_only_cache_folder_exits_2_with_the_reason_validate_gives(corpus, tmp_path, capsys):

    with read_only_folder(tmp_path / "ro") as ro:
        cache = os.path.join(ro, "cache")
        assert main(["cache", "build", corpus, "--cache-dir", cache]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        reason = re.search(r"cannot be written \((.+?)\)\. ", err[-1])
        assert reason and cache in err[-1] and ro in reason.group(1), err
        config = tmp_path / "c.yaml"
        config.write_text(f"data:\n  cache_dir: {cache}\n")
        assert main(["validate", str(config), "--json"]) == 1
        problems = last_json(capsys.readouterr().out)["problems"]
        assert [p["kind"] for p in problems] == ["cache_dir_not_writable"]
        assert f"{cache} cannot be written ({reason.group(1)})" in problems[0]["message"]
        assert os.listdir(ro) == []


def test_ctrl_c_during_cache_build_is_one_line_exit_130(corpus, tmp_path, capsys, monkeypatch):
    from keras_gpufix.data.builder import SpeechDatasetBuilder
    from keras_gpufix.data.cache import FeatureCache

    def interrupted(self, paths):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(SpeechDatasetBuilder, "_write_features", interrupted)
    cache = tmp_path / "cache"
    assert main(["cache", "build", corpus, "--cache-dir", str(cache)]) == 130
    assert capsys.readouterr().err.strip() == (
        "keras-gpufix: interrupted; nothing half-written: the cache entry was not committed")
    assert FeatureCache.leftovers(str(cache)) == [] and FeatureCache.entries(str(cache)) == []


@pytest.mark.parametrize("command", [["cache", "info"], ["bench-data"]])
def test_bad_config_is_unusable_input_naming_file_and_line(tmp_path, capsys, corpus, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  cache_dir: c\n  audio: {n_mels: 40, fmin: -1}\n")
    assert main([*command, corpus, "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml, line 3" in err and "`data.audio.fmin`" in err


def test_bench_data_counts_batches_live_on_a_terminal(corpus, tmp_path, monkeypatch):
    import io

    from keras_gpufix.benchdata import bench_data

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    bench_data(corpus, batch_sizes=(4,), seconds=0.3, num_buckets=2,
               cache_dir=str(tmp_path / "cache"))
    out = terminal.getvalue()
    assert "/Unknown" in out and "batch" in out  # Keras's Progbar, counting within the setting
    assert out.index("/Unknown") < out.index("[1/1] batch")
