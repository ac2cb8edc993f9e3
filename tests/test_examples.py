"""The examples run as users run them: in a subprocess, on data they generate.

`examples/train_asr_ctc.py` trains a tiny CTC model from a generated manifest.
`examples/train_tts.py` trains a few steps on a tiny generated corpus (one
bucket, so one XLA compile), then resumes from its checkpoint, loading its
compiles from the compile cache; the loss goes down across the four epochs. `examples/tensorboard_snapshot.py` serves a
small log dir with TensorBoard and checks our scalars and the Profile run
through its HTTP API (no browser).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from edge_faults import TF_LOG_LINE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run(args, timeout=300, log_level="2"):
    """stdout of an example run as a user runs it; `log_level=None` leaves
    TF_CPP_MIN_LOG_LEVEL unset (TensorFlow's own log lines would show), and
    then checks that none reached stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONUNBUFFERED"] = "1"
    if log_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = log_level
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if log_level is None:
        noise = [line for line in proc.stderr.splitlines() if TF_LOG_LINE.match(line)
                 or "cuInit" in line]
        assert not noise, noise[:5]
    return proc.stdout


def _last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


TINY_TTS = [
    "--utterances", "12", "--min-seconds", "1", "--max-seconds", "1.5",
    "--batch-size", "4", "--num-buckets", "1", "--steps", "8",
    "--d-model", "32", "--layers", "1", "--reduction", "8", "--dropout", "0",
    "--mixed-precision", "float32",
]


def _train_tts_first_run(out):
    first = _last_json(_run([os.path.join(EXAMPLES, "train_tts.py"), "--output", out,
                             "--epochs", "2", *TINY_TTS]))
    assert first["epochs_run"] == [0, 1]
    assert os.path.exists(os.path.join(out, "checkpoint", "latest.weights.h5"))
    assert os.path.exists(os.path.join(out, "tts.keras"))
    # one bucket, features from the cache: the monitor measures the input wait
    # (instrumented) and fit traces at most the train function made again for a
    # new steps_per_execution (its step and its loop, once each), not per batch
    # (8 steps an epoch: steps_per_execution 1, the step compile_model compiled)
    assert first["verdict"] == "healthy", first
    assert first["input_wait"] is not None and first["input_wait"] < 0.2
    assert first["retracing"]["trace_count"] <= 2
    # the builder's batches carry their lengths: speech throughput is reported
    assert first["audio_seconds_per_s"] > 0 and first["real_frames_per_s"] > 0
    assert first["compile_cache"]["directory"] == os.path.join(out, "cache", "xla")
    assert first["compile_cache"]["fresh"] >= 1
    return first


def test_train_tts_trains_and_saves(tmp_path):
    _train_tts_first_run(str(tmp_path / "run"))


# Over the 20 s budget (two processes, ~38 s on 2 cores): the first run's checks stay in
# CI above; a second process compiling from a compile cache is test_compile_cache's.
@pytest.mark.slow
def test_train_tts_resumes_from_its_checkpoint_with_its_compiles_cached(tmp_path):
    out = str(tmp_path / "run")
    first = _train_tts_first_run(out)
    second = _last_json(_run([os.path.join(EXAMPLES, "train_tts.py"), "--output", out,
                              "--epochs", "4", *TINY_TTS]))
    assert second["epochs_run"] == [2, 3]  # resumed from the checkpoint, not from scratch
    assert second["compile_cache"]["fresh"] == 0  # every compile loaded from the cache
    losses = second["history"]["loss"]
    assert second["history"]["epoch"] == [0, 1, 2, 3]
    assert losses[-1] < losses[0]
    # the resumed run starts where the first ended, not at an untrained model's loss
    assert losses[2] < losses[0]


def test_tensorboard_snapshot_serves_scalars_and_profile(tmp_path):
    pytest.importorskip("tensorboard")
    result = _last_json(_run([os.path.join(EXAMPLES, "tensorboard_snapshot.py"),
                              "--logdir", str(tmp_path / "logs"), "--json"], log_level=None))
    assert result["ok"], result
    assert "step_timer/step_ms" in result["scalar_tags"]
    assert result["profile_runs"]


def test_train_asr_ctc_trains_from_a_generated_manifest(tmp_path):
    out = str(tmp_path / "asr")
    result = _last_json(_run([os.path.join(EXAMPLES, "train_asr_ctc.py"), "--output", out,
                              "--utterances", "24", "--epochs", "4", "--batch-size", "8",
                              "--num-buckets", "1", "--width", "32", "--val-fraction", "0.25"]))
    assert result["train_utterances"] + result["val_utterances"] == 24
    assert result["val_utterances"] > 0 and result["speakers"] == ["a", "b"]
    assert result["batch_shapes"] == 1  # one bucket, drop_remainder: one XLA compile
    assert all(np.isfinite(result["loss"])) and result["loss"][-1] < result["loss"][0]
    assert 0.0 <= result["val_cer"] <= 1.5
    assert os.path.exists(os.path.join(out, "asr.keras"))
    with open(os.path.join(out, "train.jsonl"), encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert not os.path.isabs(first["audio_filepath"])  # the manifest's paths are relative
