"""setup_strategy / global_batch_size, and training under real strategies.

Two logical CPU devices must be configured before TensorFlow initialises its
devices, and pytest runs every test in one process, so the 2-replica and the
multi-worker runs happen in subprocesses (tests/_two_device_worker.py,
tests/_multiworker_worker.py), bounded by timeouts and always cleaned up.
"""

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix import distribute
from keras_gpufix.analysis import headline
from keras_gpufix.data.synthetic import make_synthetic_corpus
from keras_gpufix.data_service import DataServiceServer

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    return env


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_devices():
    """Results of the scenarios in one subprocess with CPU:0 and CPU:1."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_two_device_worker.py"),
         "equivalence", "xla_layers", "builder"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, name, payload = line.split(" ", 2)
            results[name] = json.loads(payload)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


# -- 2 replicas on 2 logical CPU devices --------------------------------------


def test_devices_give_two_replica_mirrored_strategy(two_devices):
    result = two_devices["equivalence"]
    assert result["strategy"] == "MirroredStrategy"
    assert result["replicas"] == 2


def test_compile_model_under_mirrored_really_compiles_each_replica(two_devices):
    result = two_devices["equivalence"]
    # Read from the traced train function: one XLA call per replica device.
    assert result["jit_compile"] is True
    assert result["xla_scope"] == "per_replica"
    assert result["retracing_jit_compile"] is True  # the monitors read the same XLA state
    assert result["xla_devices"] == ["CPU:0", "CPU:1"]
    assert result["fallback_reason"] is None


def test_one_step_on_two_replicas_equals_one_device(two_devices):
    result = two_devices["equivalence"]
    assert result["restored_after_sample_step"]
    assert result["moved"] > 1e-3  # the step changed the weights
    assert result["max_abs_diff"] < 1e-5


def test_batchnorm_and_dropout_train_per_replica_xla(two_devices):
    result = two_devices["xla_layers"]
    assert result["jit_compile"] is True
    assert result["xla_devices"] == ["CPU:0", "CPU:1"]
    assert result["finite"] and len(result["loss"]) == 2


def test_padded_bucketed_global_batches_train_under_mirrored(two_devices):
    result = two_devices["builder"]
    assert result["global_batch"] == 4
    assert result["jit_compile"] is True
    assert all(np.isfinite(result["loss"]))
    if result["steps_per_execution"] == 1:
        # Keras 3.15 cannot run its multi-step loop under MirroredStrategy;
        # compile_model saw it on the sample batch and said so.
        assert any("steps_per_execution=1" in w for w in result["warnings"])
    else:
        assert result["steps_per_execution"] == 2 and not result["warnings"]


# -- two worker processes ---------------------------------------------------------


def _run_workers(tmp, scenarios, timeout=240, **env):
    """Runs two `_multiworker_worker.py` on loopback ports picked free; returns
    each worker's `{scenario: result}`. Every process is stopped by its PID."""
    corpus = make_synthetic_corpus(tmp / "corpus", 41, min_seconds=0.2, max_seconds=1.0)
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    procs = []
    try:
        for index in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            procs.append(subprocess.Popen(
                [sys.executable, str(TESTS / "_multiworker_worker.py"), str(tmp), corpus,
                 *scenarios],
                env=_env(TF_CONFIG=json.dumps(tf_config), **env),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ))
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]
    return [{name: json.loads((tmp / f"{name}-{task}.json").read_text()) for name in scenarios}
            for task in range(2)]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Both workers' results of every scenario, from one pair of processes;
    a tf.data service dispatcher and worker run in this process meanwhile."""
    servers = [DataServiceServer("dispatcher", verbose=0).start()]
    servers.append(DataServiceServer("worker", dispatcher=servers[0].target, verbose=0).start())
    try:
        tmp = tmp_path_factory.mktemp("workers")
        return _run_workers(tmp, ["coverage", "coverage_service", "weights", "straggler",
                                  "straggler_loop"],
                            KG_TEST_SERVICE=servers[0].target, KG_TEST_LOG_DIR=str(tmp / "logs"))
    finally:
        for server in servers:
            server.stop()


def test_multi_worker_two_processes_end_with_identical_weights(two_workers):
    reports = [worker["weights"] for worker in two_workers]
    for report in reports:
        assert report["strategy"] in ("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy")
        assert report["replicas"] == 2 and report["global_batch"] == 8
        assert report["jit_compile"] is True
        assert report["moved"] > 1e-3
    assert reports[0]["xla_devices"] == ["worker:0/CPU:0"]
    assert reports[1]["xla_devices"] == ["worker:1/CPU:0"]
    first, second = ([np.array(w) for w in r["weights"]] for r in reports)
    assert len(first) == len(second)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scenario", ["coverage", "coverage_service"])
def test_builder_defaults_read_every_utterance_once_per_epoch_across_workers(
        two_workers, scenario):
    reports = [worker[scenario] for worker in two_workers]
    utterances = reports[0]["utterances"]
    assert reports[0]["remainder"] == 0
    for epoch in range(2):
        seen = reports[0]["epochs"][epoch] + reports[1]["epochs"][epoch]
        assert len(seen) == len(set(seen)) == utterances, (
            f"epoch {epoch}: {len(seen) - len(set(seen))} read twice, "
            f"{utterances - len(set(seen))} never")
        assert reports[0]["epochs"][epoch] and reports[1]["epochs"][epoch]
    # Still a new draw every epoch.
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]


@pytest.mark.parametrize("scenario", ["straggler", "straggler_loop"])
def test_the_chief_names_the_planted_straggler_its_cause_and_the_others_loss(
        two_workers, scenario):
    chief, slowed = (worker[scenario] for worker in two_workers)
    for worker in (chief, slowed):
        job = worker["job"]
        assert job["workers"] == 2 and not job["missing"]
        s = job["straggler"]
        assert (s["task"], s["cause"], s["phase"]) == (1, "input", "input_wait")
        # The job's samples/s, counted once, against samples consumed / wall time.
        assert job["samples_per_s"] == pytest.approx(worker["true_samples_per_s"], rel=0.10)
        # the others wait in the all-reduce about as long as worker 1 is late
        assert s["others_wait_share"] == pytest.approx(s["share"], abs=0.1)
        assert s["gain"] == pytest.approx(1 / (1 - s["share"]))
    waits = {w["task"]: w for w in chief["job"]["per_worker"]}
    assert waits[1]["input_wait_ms"] > waits[0]["input_wait_ms"] + 10
    assert waits[0]["collective_wait_ms"] > waits[1]["collective_wait_ms"] + 10
    lanes = chief["job"]["series"]["workers"]
    assert sum(lanes["0"]["collective_wait_ms"]) > sum(lanes["1"]["collective_wait_ms"])
    assert "(task 0): job of 2 workers" in chief["printed"]
    assert "straggler: worker 1 (its input: " in chief["printed"]
    # The slowed worker says only that it is the cause; the chief says it once.
    assert slowed["printed"].splitlines() == [chief["printed"].splitlines()[-1].replace(
        "(task 0)", "(task 1)")]
    # The chief's record keeps the job; its headline and report.html open with it.
    record = chief["record"]
    assert record["job"]["straggler"]["task"] == 1
    first = headline(record)[0]
    assert first.startswith("verdict: straggler; worker 1 (its input) costs the job ")
    html = chief["html"]
    assert "<span class='verdict straggler' id='verdict'>straggler</span>" in html
    assert html.count("<tr class='worker") == 2 and "<tr class='worker straggler'>" in html
    assert html.count("<g class='lane'") == 2


# -- in process: choices and errors -------------------------------------------------


def test_global_batch_size():
    assert kg.global_batch_size(32, tf.distribute.get_strategy()) == 32
    assert kg.global_batch_size(16) == 16


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_global_batch_size_rejects(bad):
    with pytest.raises(ValueError, match=re.escape(f"Received: per_replica={bad!r}")):
        kg.global_batch_size(bad, tf.distribute.get_strategy())


def test_setup_strategy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode='pipeline'"):
        kg.setup_strategy(mode="pipeline")
    with pytest.raises(ValueError, match=re.escape("`devices` must be a non-empty list of "
                                                   "device names such as ['/gpu:0', '/gpu:1']. "
                                                   "Received: devices=[]")):
        kg.setup_strategy(devices=[])
    with pytest.raises(ValueError, match=re.escape("Received: devices='/gpu:0'")):
        kg.setup_strategy(devices="/gpu:0")


def test_auto_on_cpu_is_default_strategy_and_logs(caplog, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with caplog.at_level(logging.INFO, logger="keras_gpufix"):
        strategy = kg.setup_strategy()
    assert strategy is tf.distribute.get_strategy()
    assert strategy.num_replicas_in_sync == 1
    assert "no GPU" in caplog.text


def test_one_device_mode(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = kg.setup_strategy(mode="one_device")
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert "CPU:0" in strategy.extended.worker_devices[0]


def test_tf_config_cluster_selects_multi_worker(monkeypatch):
    created = {}

    def fake(**kwargs):
        created["kwargs"] = kwargs
        return tf.distribute.get_strategy()

    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", fake)
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0},
    }))
    kg.setup_strategy()
    assert created["kwargs"] == {}  # TensorFlow picks the collectives itself


def test_invalid_tf_config_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match=re.escape("`TF_CONFIG` is not valid JSON")):
        kg.setup_strategy()


class _FakeGPU:
    def __init__(self, index):
        self.name = f"/physical_device:GPU:{index}"
        self.device_type = "GPU"


def _fake_gpus(monkeypatch, count):
    real = tf.config.list_physical_devices

    def listing(device_type=None):
        if device_type == "GPU":
            return [_FakeGPU(i) for i in range(count)]
        return real(device_type)

    monkeypatch.setattr(tf.config, "list_physical_devices", listing)


def test_two_gpus_mirrored_leaves_the_all_reduce_to_tensorflow(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    _fake_gpus(monkeypatch, 2)
    created = {}

    def fake(devices=None, cross_device_ops=None):
        created.update(devices=devices, ops=cross_device_ops)
        return tf.distribute.get_strategy()

    monkeypatch.setattr(tf.distribute, "MirroredStrategy", fake)
    kg.setup_strategy(memory_growth=False)
    assert created["devices"] == ["/gpu:0", "/gpu:1"]
    assert created["ops"] is None


@pytest.mark.parametrize("kwargs, expected", [
    ({}, "default"),
    ({"device_count": 1}, "one_device"),
    ({"device_count": 2}, "mirrored"),
    ({"device_count": 1, "cluster": {"worker": 2}}, "multi_worker"),
    ({"mode": "mirrored"}, "mirrored"),
])
def test_resolve_strategy_mode(kwargs, expected):
    mode, why = distribute.resolve_strategy_mode(**kwargs)
    assert mode == expected and why
    assert mode in distribute.STRATEGY_MODES


def test_resolve_strategy_mode_names_the_modes():
    with pytest.raises(ValueError, match="Received: mode='pipeline'"):
        distribute.resolve_strategy_mode("pipeline")


@pytest.mark.parametrize("mode, devices, message", [
    ("one_device", ["/cpu:0", "/cpu:1"], "`mode='one_device'` takes exactly one device"),
    ("default", ["/cpu:0"], "`mode='default'` uses no device list"),
])
def test_a_device_list_the_mode_would_ignore_is_an_error(mode, devices, message):
    with pytest.raises(ValueError, match=message + r".*Received: \d devices"):
        distribute.resolve_strategy_mode(mode, device_count=len(devices), devices_given=True)
    with pytest.raises(ValueError, match=message):
        kg.setup_strategy(mode=mode, devices=devices, memory_growth=False)


def _gpus_without_memory_growth(monkeypatch, count):
    """`count` fake GPUs, no TF_CONFIG, no logical configuration, memory growth off."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    _fake_gpus(monkeypatch, count)
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda d: None)
    monkeypatch.setattr(tf.config.experimental, "get_memory_growth", lambda d: False)


def test_memory_growth_too_late_is_a_clear_error(monkeypatch):
    _gpus_without_memory_growth(monkeypatch, 1)

    def too_late(device, enable):
        raise RuntimeError("Physical devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", too_late)
    with pytest.raises(RuntimeError, match="came after TensorFlow initialised the GPUs") as info:
        kg.setup_strategy()
    assert "memory_growth=False" in str(info.value)


def test_memory_growth_is_set_on_every_gpu(monkeypatch):
    _gpus_without_memory_growth(monkeypatch, 2)
    grown = []
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda d, enable: grown.append((d.name, enable)))
    monkeypatch.setattr(tf.distribute, "MirroredStrategy",
                        lambda devices=None, cross_device_ops=None: tf.distribute.get_strategy())
    kg.setup_strategy()
    assert grown == [("/physical_device:GPU:0", True), ("/physical_device:GPU:1", True)]


def _tf_config(index, cluster=None):
    cluster = cluster or {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def test_cluster_seed_is_the_same_on_every_worker_and_none_alone(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert distribute.cluster_seed() is None
    seeds = []
    for index in range(2):
        monkeypatch.setenv("TF_CONFIG", _tf_config(index))
        seeds.append(distribute.cluster_seed())
    assert seeds[0] == seeds[1] and isinstance(seeds[0], int) and seeds[0] >= 0
    monkeypatch.setenv("TF_CONFIG", _tf_config(0, {"worker": ["127.0.0.1:3", "127.0.0.1:4"]}))
    assert distribute.cluster_seed() != seeds[0]
    monkeypatch.setenv("TF_CONFIG", _tf_config(0, {"worker": ["127.0.0.1:1"]}))
    assert distribute.cluster_seed() is None


def test_builder_reports_the_remainder_and_the_cluster_seed(tmp_path, monkeypatch):
    corpus = make_synthetic_corpus(tmp_path / "c", 11, min_seconds=0.2, max_seconds=0.5)
    builder = kg.data.SpeechDatasetBuilder(corpus, verbose=0)
    monkeypatch.setenv("TF_CONFIG", _tf_config(1))
    dataset = builder.build(batch_size=4, num_buckets=2, drop_remainder=True, as_dict=True)
    read = sum(len(batch["id"]) for batch in dataset)
    assert builder.report["remainder"] == 11 - read == 3
    assert builder.report["shuffle_seed"] == distribute.cluster_seed() is not None
    builder.build(batch_size=4, num_buckets=2, seed=5)
    assert builder.report["shuffle_seed"] == 5 and builder.report["remainder"] == 0
