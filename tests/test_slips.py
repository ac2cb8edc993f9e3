"""A new user's slips, each answered with one line naming the problem and the fix,
and a non-zero exit where the command failed (diagnose's are in test_diagnose.py)."""

import os
import subprocess
import sys

import pytest
from edge_faults import TF_LOG_LINE

from keras_gpufix.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_builder_on_a_missing_folder_says_the_folder_is_missing(tmp_path):
    from keras_gpufix.data import SpeechDatasetBuilder

    missing = str(tmp_path / "no" / "such" / "folder")
    with pytest.raises(ValueError, match=f"`corpus` folder {missing} does not exist: "
                                         "check the path"):
        SpeechDatasetBuilder(missing)


def test_cache_info_on_a_mistyped_corpus_exits_2_saying_it_does_not_exist(capsys):
    assert main(["cache", "info", "typo_dir", "--cache-dir", "cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("keras-gpufix cache: error: CORPUS typo_dir does not exist: check the "
                       "path (a corpus folder or a JSON Lines manifest)")


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_info_or_clear_on_a_mistyped_cache_folder_exits_2(tmp_path, capsys, action):
    from keras_gpufix.data.synthetic import make_synthetic_corpus

    corpus = make_synthetic_corpus(str(tmp_path / "corpus"), 2, max_seconds=1.0)
    typo = str(tmp_path / "cahce")
    assert main(["cache", action, corpus, "--cache-dir", typo]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"keras-gpufix cache: error: cache folder {typo} does not exist: check "
                       "the path, or create it with `keras-gpufix cache build`")
    assert not os.path.exists(typo)


def test_cache_info_hides_tensorflows_log_lines(tmp_path):
    from keras_gpufix.data.synthetic import make_synthetic_corpus

    corpus = make_synthetic_corpus(str(tmp_path / "corpus"), 2, max_seconds=1.0)
    (tmp_path / "cache").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "keras_gpufix", "cache", "info", corpus,
                           "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "status:       missing" in proc.stdout
    noise = [line for line in proc.stderr.splitlines()
             if TF_LOG_LINE.match(line) or "cuInit" in line]
    assert not noise, noise[:5]
