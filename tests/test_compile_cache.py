"""`CompileCache`: XLA compiles kept across runs, and `compile_model`'s account of them."""

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix.compile import CompileCache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(cache_dir, weights, corpus):
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    worker = os.path.join(REPO, "tests", "_compile_cache_worker.py")
    proc = subprocess.run([sys.executable, worker, str(cache_dir), str(weights), str(corpus)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_from_the_cache_and_trains_the_same(tmp_path):
    from keras_gpufix.data import make_synthetic_corpus

    cache_dir, corpus = tmp_path / "xla", tmp_path / "corpus"
    make_synthetic_corpus(str(corpus), 3, min_seconds=0.2, max_seconds=0.4)
    first = _train(cache_dir, tmp_path / "first.npz", corpus)
    entries = CompileCache(str(cache_dir)).entries()
    second = _train(cache_dir, tmp_path / "second.npz", corpus)

    # the first process built the feature cache, the second opened it: the first
    # traced more before its model (TensorFlow's trace ids then differ)
    assert (first["feature_cache"], second["feature_cache"]) == ("miss", "hit")
    assert first["ids_before"] != second["ids_before"]
    assert first["started_at_import"] is False  # TF reads TF_XLA_FLAGS after its import
    assert first["compile_cache"]["active"]
    assert first["compile_cache"]["directory"] == str(cache_dir)
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
    kept = [(e["name"], e["size_bytes"]) for e in entries]
    assert [(e["name"], e["size_bytes"]) for e in CompileCache(str(cache_dir)).entries()] == kept
    # what the package reports: the compile seconds are a fraction of the first run's
    first_s = fresh["seconds"] + first["fit_compile_ms"] / 1e3
    second_s = cached["seconds"] + second["fit_compile_ms"] / 1e3
    print(f"compile seconds: fresh {first_s:.2f}, from the cache {second_s:.2f}")
    assert second_s < first_s
    # entries never change results
    assert second["loss"] == first["loss"]
    a, b = np.load(tmp_path / "first.npz"), np.load(tmp_path / "second.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a.files)


@pytest.fixture
def fresh_process_state(monkeypatch):
    """CompileCache as in a process that has not enabled it yet."""
    monkeypatch.setattr(CompileCache, "_current", None)
    monkeypatch.setattr(CompileCache, "_told", False)
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    tf.constant(0)  # TensorFlow has started (it has read TF_XLA_FLAGS)


def test_after_tensorflow_started_the_cache_stays_off_and_says_once_how_to_set_it(
        fresh_process_state, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "keras_gpufix.compile"):
        first = CompileCache.enable(str(tmp_path))
        second = CompileCache.enable()
    assert not first.active and first.directory is None
    assert f"TF_XLA_FLAGS=--tf_xla_persistent_cache_directory={tmp_path}" in first.note
    assert "TF_XLA_FLAGS" not in os.environ  # setting it now would do nothing
    assert not second.active
    assert len(caplog.records) == 1  # said once


def test_a_folder_named_in_tf_xla_flags_is_the_one_kept(fresh_process_state, monkeypatch,
                                                        tmp_path):
    monkeypatch.setenv("TF_XLA_FLAGS", f"--tf_xla_persistent_cache_directory={tmp_path / 'mine'}")
    cache = CompileCache.enable(str(tmp_path / "other"))
    assert cache.active and cache.directory == str(tmp_path / "mine")
    assert "mine" in cache.note and (tmp_path / "mine").is_dir()
    assert CompileCache.enable(None).note.startswith("the compile cache was already on")


def test_enable_refuses_a_value_that_is_no_folder(fresh_process_state):
    with pytest.raises(ValueError, match=r"`compile_cache` must be 'auto', a folder or None.*"
                                         r"Received: compile_cache=3"):
        CompileCache.enable(3)
    off = CompileCache.enable(None)
    assert not off.active and off.note == "off (compile_cache=None)"


def test_entries_and_clear_and_where_auto_keeps_them(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert CompileCache.default_directory() == str(tmp_path / "home" / "keras_gpufix" / "xla")
    assert CompileCache.default_directory(beside=str(tmp_path / "c")) == str(tmp_path / "c" / "xla")
    folder = tmp_path / "xla"
    folder.mkdir()
    (folder / "xla_compile_cache__1__2__XLA_CPU_JIT.pb").write_bytes(b"x" * 10)
    (folder / "jit_f-abc-cache").write_bytes(b"y" * 5)
    hour_ago = time.time() - 3600
    os.utime(folder / "jit_f-abc-cache", (hour_ago, hour_ago))
    cache = CompileCache(str(folder))
    found = cache.entries()
    assert [(e["name"], e["size_bytes"]) for e in found] == [
        ("jit_f-abc-cache", 5), ("xla_compile_cache__1__2__XLA_CPU_JIT.pb", 10)]
    assert 3600 <= found[0]["age_s"] < 3660 and 0 <= found[1]["age_s"] < 60
    with cache.watch() as seen:
        (folder / "xla_compile_cache__3__4__XLA_CPU_JIT.pb").write_bytes(b"z")
    assert seen["written"] == 1 and seen["compiles"] is None  # TensorFlow: files only
    names = [e["name"] for e in cache.entries()]
    assert cache.clear() == {"removed": names, "freed_bytes": 16}
    assert cache.entries() == [] and CompileCache(None).entries() == []


_JAX_RUN = """
import json, sys
from keras_gpufix.compile import CompileCache
cache = CompileCache.enable(sys.argv[1])
import jax, jax.numpy as jnp
for i in range(int(sys.argv[2])):  # what else the process compiled before (a first run's)
    jax.jit(lambda x, i=i: x * i + 1)(jnp.ones(3))
step = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))
with cache.watch() as seen:
    w = step(jnp.ones((8, 4)) / 8, jnp.linspace(-1, 1, 64).reshape(8, 8))
print(json.dumps({**seen, "w": w.tolist(), "keras": "keras" in sys.modules}))
"""


def test_on_jax_a_second_process_loads_its_compiles_from_the_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env.update(PYTHONPATH=REPO, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    runs = []
    for others in ("3", "0"):  # JAX keys an entry on the program, not on what came before
        proc = subprocess.run([sys.executable, "-c", _JAX_RUN, str(tmp_path / "xla"), others],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiles"] >= 1 and first["from_cache"] == 0
    assert first["written"] == first["compiles"]
    # every compile of the second from the cache (it may count small ops the first had
    # compiled before its block, for its other functions: 6 vs 5 here)
    assert second["compiles"] >= first["compiles"] and second["from_cache"] == second["compiles"]
    assert second["written"] == 0
    assert second["compile_s"] < first["compile_s"]
    assert second["w"] == first["w"]
    assert not first["keras"]  # turning the cache on imported no Keras (nor TensorFlow)


DIAGNOSED = """\
import keras
import numpy as np
import tensorflow as tf

import keras_gpufix as kg

xs = np.random.rand(256, 16).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((xs, xs[:, :1])).batch(16)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(1)])
kg.compile_model(model, optimizer="adam", loss="mse", jit_compile=True)
model.fit(ds, epochs=1, verbose=0)
"""


def test_diagnose_says_how_many_compiles_came_from_the_cache(tmp_path):
    # the cache named before TensorFlow starts (diagnose starts it before the script)
    script, cache = tmp_path / "train.py", tmp_path / "xla"
    script.write_text(DIAGNOSED)
    cache.mkdir()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={cache}")
    lines = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "keras_gpufix", "diagnose", "--no-trace",
                               "--no-what-if", "--", "python", str(script)], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines.append(next(line for line in proc.stdout.splitlines() if line.startswith("fit 1:")))
    assert f"0 of 1 compiles from the compile cache ({cache}), 1 fresh" in lines[0], lines
    assert f"1 of 1 compiles from the compile cache ({cache}), 0 fresh" in lines[1], lines
