"""`CompileCache`: XLA compiles kept across runs, and `compile_model`'s account of them."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix.compile import CompileCache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(cache_dir, weights):
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "_compile_cache_worker.py"),
                           str(cache_dir), str(weights)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_from_the_cache_and_trains_the_same(tmp_path):
    cache_dir = tmp_path / "xla"
    first = _train(cache_dir, tmp_path / "first.npz")
    entries = CompileCache(str(cache_dir)).entries()
    second = _train(cache_dir, tmp_path / "second.npz")

    assert first["started_at_import"] is False  # TF reads TF_XLA_FLAGS after its import
    assert first["compile_cache"]["active"] and first["compile_cache"]["directory"] == str(cache_dir)
    # compile_model's sample step compiled the first shape afresh, fit the second one
    [fresh] = first["compiles"]
    assert fresh["shape"] == [[4, 16, 8], [4, 16, 8]]
    assert fresh["from_cache"] is False and fresh["kept"] is True
    assert first["fit_written"] == 1 and len(entries) == 2
    # the second run loads both from the cache: nothing written
    [cached] = second["compiles"]
    assert cached["shape"] == fresh["shape"]
    assert cached["from_cache"] is True and cached["kept"] is True
    assert second["fit_written"] == 0
    assert [e["name"] for e in CompileCache(str(cache_dir)).entries()] == [e["name"] for e in entries]
    # what the package reports: the compile seconds are a fraction of the first run's
    first_s = fresh["seconds"] + first["fit_compile_ms"] / 1e3
    second_s = cached["seconds"] + second["fit_compile_ms"] / 1e3
    print(f"compile seconds: fresh {first_s:.2f}, from the cache {second_s:.2f}")
    assert second_s < first_s
    # entries never change results
    assert second["loss"] == first["loss"]
    a, b = np.load(tmp_path / "first.npz"), np.load(tmp_path / "second.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a.files)
