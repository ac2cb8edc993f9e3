"""The run's judgement in the experiment trackers, with the real packages: MLflow on a
local file store, W&B offline (its run folder read back as `wandb sync` would read it).
A tracker that fails is one warning; `compare` reads runs from the trackers."""

import glob
import json
import os
import re
import struct
import sys
import textwrap
import time
import warnings

import keras
import numpy as np
import pytest

import keras_gpufix as kg
from edge_faults import read_only_folder
from keras_gpufix.analysis.headline import headline, verdict_share
from keras_gpufix.cli import main
from keras_gpufix.exceptions import GpufixWarning
from keras_gpufix.run_record import RunRecord
from keras_gpufix.trackers import Trackers, load_record

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402 - after the skip

PHASES = {"keras_gpufix/cycle_ms", "keras_gpufix/step_ms", "keras_gpufix/between_ms"}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An MLflow file store in a temp folder (MLflow 3 asks for the opt-in to one)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    yield mlflow.tracking.MlflowClient()
    while mlflow.active_run() is not None:  # a failed test leaves none open
        mlflow.end_run()


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")


def _fit(monitor, epochs=3):
    """A tiny fit (8 steps an epoch) with `monitor`; returns its History's losses."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.linspace(0, 1, 128, dtype="float32").reshape(32, 4)
    history = model.fit(x, x[:, :1], batch_size=4, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[monitor])
    return history.history["loss"]


def _batches(wait_s, steps=24):
    for _ in range(steps):
        time.sleep(wait_s)
        yield np.zeros((4, 2), np.float32)


def _artifact(client, run_id, name, tmp_path):
    path = client.download_artifacts(run_id, f"keras_gpufix/{name}", str(tmp_path / run_id))
    with open(path, encoding="utf-8") as f:
        return f.read()


def _check_mlflow(client, run_id, record_path, tmp_path):
    """The run's tags say the record's headline; its artifacts are the record and its page."""
    record = RunRecord.load(record_path)
    tags = client.get_run(run_id).data.tags
    lines = headline(record.data, f"runs:/{run_id}")
    assert tags["keras_gpufix.verdict"] == record.data["verdict"]["verdict"]
    assert tags["keras_gpufix.headline"] == "\n".join(lines)
    assert tags["keras_gpufix.fix"] == lines[1][len("fix:"):].strip()
    share = verdict_share(record.data)[1]
    assert tags["keras_gpufix.share"] == ("" if share is None else f"{share:.4g}")
    with open(record_path, encoding="utf-8") as f:
        assert _artifact(client, run_id, "run_record.json", tmp_path) == f.read()
    page = _artifact(client, run_id, "report.html", tmp_path)
    assert f"keras-gpufix compare runs:/{run_id} AFTER" in page
    return tags


def test_a_fit_in_an_active_mlflow_run_logs_its_headline_phases_and_record(store, tmp_path):
    with mlflow.start_run() as run:
        monitor = kg.GPUOscillationMonitor(log_dir=str(tmp_path / "logs"), nvml=False,
                                           verbose=0)
        _fit(monitor)
        _fit(monitor, epochs=1)  # a second fit: its points follow the first's
    run_id = run.info.run_id
    assert monitor.report()["trackers"] == [{
        "tracker": "mlflow", "run_id": run_id, "tracking_uri": os.environ["MLFLOW_TRACKING_URI"],
        "uri": f"runs:/{run_id}", "started": False}]
    _check_mlflow(store, run_id, tmp_path / "logs" / "keras_gpufix" / "run_record.json",
                  tmp_path)
    # the phases once an epoch (8 steps each), never per step
    for key in PHASES:
        history = store.get_metric_history(run_id, key)
        assert [m.step for m in history] == [8, 16, 24, 32]
        assert all(m.value > 0 for m in history)
    cycle, wait, step, between = (store.get_metric_history(run_id, f"keras_gpufix/{k}")
                                  for k in ("cycle_ms", "input_wait_ms", "step_ms",
                                            "between_ms"))
    assert len(wait) == 4  # the arrays' input wait is measured (fit's dataset probe)
    assert [c.value for c in cycle] == pytest.approx(
        [w.value + s.value + b.value for w, s, b in zip(wait, step, between)])


def test_a_watch_loop_named_to_mlflow_starts_and_ends_its_run(store, tmp_path):
    assert mlflow.active_run() is None
    monitor = kg.GPUOscillationMonitor(log_dir=str(tmp_path / "logs"), nvml=False, verbose=0,
                                       trackers=Trackers("mlflow", update_freq=10))
    batches = [np.zeros((4, 2), np.float32)] * 40
    with kg.watch(batches, callbacks=[monitor]) as watched:
        for _ in range(2):
            for _ in watched:
                time.sleep(0.004)
    assert mlflow.active_run() is None  # the run it started, ended
    (described,) = monitor.report()["trackers"]
    assert described["started"] is True
    run = store.get_run(described["run_id"])
    assert run.info.status == "FINISHED"
    tags = _check_mlflow(store, run.info.run_id,
                         tmp_path / "logs" / "keras_gpufix" / "run_record.json", tmp_path)
    assert tags["keras_gpufix.verdict"] == watched.report()["verdict"]
    # at each epoch's end, and between, 10 steps or more after the last point (the
    # records reach the monitor in batches, about every quarter second)
    steps = [m.step for m in store.get_metric_history(run.info.run_id, "keras_gpufix/step_ms")]
    assert steps == sorted(set(steps)) and {40, 80} <= set(steps)
    assert all(b in (40, 80) or b - a >= 10 for a, b in zip([0] + steps, steps))


def test_trackers_none_logs_nothing_and_bad_values_are_named(store, monkeypatch):
    with mlflow.start_run() as run:
        monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0, trackers=None)
        _fit(monitor, epochs=1)
    monkeypatch.setenv("KERAS_GPUFIX_TRACKERS", "off")  # "auto" off, the script unchanged
    with mlflow.start_run():
        _fit(kg.GPUOscillationMonitor(nvml=False, verbose=0), epochs=1)
    for run in (run, mlflow.last_active_run()):
        assert not any(k.startswith("keras_gpufix") for k in store.get_run(
            run.info.run_id).data.tags)
        assert not store.get_run(run.info.run_id).data.metrics
    assert monitor.report()["trackers"] == []
    with pytest.raises(ValueError, match=r"`trackers` must be .* Received: trackers='neptune'"):
        kg.GPUOscillationMonitor(trackers="neptune")
    with pytest.raises(ValueError, match=r"Received: update_freq=0"):
        Trackers("mlflow", update_freq=0)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    with pytest.raises(ImportError, match=re.escape("pip install keras-gpufix[wandb]")):
        kg.GPUOscillationMonitor(trackers=["mlflow", "wandb"])


def test_a_store_that_cannot_be_written_is_one_warning_and_changes_nothing(store, tmp_path):
    plain = _fit(kg.GPUOscillationMonitor(nvml=False, verbose=0, trackers=None))
    run = mlflow.start_run()
    folder = os.path.join(mlflow.get_experiment(run.info.experiment_id).artifact_location[
        len("file:"):], run.info.run_id)
    logs = tmp_path / "logs"
    monitor = kg.GPUOscillationMonitor(log_dir=str(logs), nvml=False, verbose=0)
    with read_only_folder(folder):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _fit(monitor)
    mlflow.end_run()
    ours = [w for w in caught if issubclass(w.category, GpufixWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "logging to MLflow failed" in str(ours[0].message)
    assert "Read-only file system" in str(ours[0].message)
    assert losses == plain  # the fit's result
    record = RunRecord.load(logs)  # the local record, complete
    assert record.data["step_time"]["count"] == monitor.report()["step_time"]["count"] > 0
    assert record.data["verdict"]["verdict"] == monitor.report()["verdict"]


def test_a_tracker_slower_than_end_wait_s_is_left_to_finish_in_the_background(
        store, tmp_path, monkeypatch):
    monkeypatch.setattr(Trackers, "END_WAIT_S", 0.0)  # as a server that does not answer
    with mlflow.start_run() as run:
        monitor = kg.GPUOscillationMonitor(log_dir=str(tmp_path / "logs"), nvml=False,
                                           verbose=0)
        with pytest.warns(GpufixWarning, match="MLflow did not answer within 0 s; training "
                                               "goes on, the local run record is complete"):
            with kg.watch([np.zeros((4, 2), np.float32)] * 12, callbacks=[monitor]) as watched:
                for _ in watched:
                    pass
    deadline = time.monotonic() + 30
    while "keras_gpufix.headline" not in store.get_run(run.info.run_id).data.tags:
        assert time.monotonic() < deadline, "the headline never reached the run"
        time.sleep(0.05)
    assert store.get_run(run.info.run_id).data.tags["keras_gpufix.verdict"] == \
        RunRecord.load(tmp_path / "logs").data["verdict"]["verdict"]


def _wandb_records(folder):
    """The records of a W&B offline run folder's `.wandb` file (its log format: a 7-byte
    header, then 32 KiB blocks of chunks, each a 7-byte header and a protobuf part)."""
    (path,) = glob.glob(os.path.join(folder, "*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, chunk, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wandb_run(folder):
    """(summary, history rows) of a W&B offline run folder."""
    def items(parts):  # a key with a "/" is kept as its nested_key
        return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in parts}

    records = list(_wandb_records(folder))
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "the run's exit record was never written"
        time.sleep(0.1)  # W&B's own process writes the file's last records after finish()
        records = list(_wandb_records(folder))
    summary, history = {}, []
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update(items(record.summary.update))
        elif record.WhichOneof("record_type") == "history":
            history.append(items(record.history.item))
    return summary, history


def test_a_fit_in_a_wandb_offline_run_logs_its_summary_history_and_files(offline, tmp_path):
    with wandb.init(project="kg-test", dir=str(tmp_path)) as run:
        folder = os.path.dirname(run.dir)
        monitor = kg.GPUOscillationMonitor(log_dir=str(tmp_path / "logs"), nvml=False,
                                           verbose=0)
        _fit(monitor)
    local = tmp_path / "logs" / "keras_gpufix" / "run_record.json"
    record = RunRecord.load(local)
    summary, history = _wandb_run(folder)
    lines = headline(record.data, folder)
    assert summary["keras_gpufix/verdict"] == record.data["verdict"]["verdict"]
    assert summary["keras_gpufix/headline"] == "\n".join(lines)
    assert summary["keras_gpufix/share"] == verdict_share(record.data)[1]
    mine = [row for row in history if "keras_gpufix/train_step" in row]
    assert [row["keras_gpufix/train_step"] for row in mine] == [8, 16, 24]
    assert all(PHASES <= set(row) for row in mine)
    files = os.path.join(folder, "files", "keras_gpufix")
    assert not os.path.islink(os.path.join(files, "run_record.json"))  # a copy, kept
    with open(local, encoding="utf-8") as f, \
            open(os.path.join(files, "run_record.json"), encoding="utf-8") as g:
        assert g.read() == f.read()
    with open(os.path.join(files, "report.html"), encoding="utf-8") as f:
        assert f"keras-gpufix compare {folder} AFTER" in f.read()
    # the run folder is a record `compare` reads
    assert load_record(folder).data == record.data


def test_compare_of_two_mlflow_runs_says_what_it_says_of_their_records(store, tmp_path,
                                                                        capsys):
    runs = {}
    for name, wait in (("slow", 0.008), ("fixed", 0.0)):
        with mlflow.start_run() as run:
            monitor = kg.GPUOscillationMonitor(log_dir=str(tmp_path / name), nvml=False,
                                               verbose=0)
            with kg.watch(_batches(wait), callbacks=[monitor]) as watched:
                for _ in watched:
                    time.sleep(0.002)
        runs[name] = run.info.run_id

    def compare(before, after):
        assert main(["compare", "--json", before, after]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return {k: v for k, v in out.items() if k not in ("before_record", "after_record")}, out

    by_files, _ = compare(str(tmp_path / "slow"), str(tmp_path / "fixed"))
    by_runs, out = compare(f"runs:/{runs['slow']}", f"runs:/{runs['fixed']}")
    assert by_runs == by_files
    assert out["before_record"] == f"runs:/{runs['slow']}"
    assert main(["compare", f"runs:/{runs['slow']}", "runs:/0123456789abcdef"]) == 2
    assert "runs:/0123456789abcdef: no keras_gpufix run record in this MLflow run" in \
        capsys.readouterr().err


def test_diagnose_logs_its_record_once_to_the_scripts_runs(store, offline, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""\
        import mlflow, wandb
        import numpy as np
        import keras
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        with mlflow.start_run(), wandb.init(project="kg-test", dir={str(tmp_path)!r}):
            model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=4, epochs=3, verbose=0)
        """))
    logs = tmp_path / "diagnose"
    assert main(["diagnose", "--no-trace", "--no-what-if", "--log-dir", str(logs), "--",
                 "python", str(script)]) == 0
    out = capsys.readouterr().out
    (run,) = store.search_runs([store.get_experiment_by_name("Default").experiment_id])
    assert f"keras-gpufix diagnose: logged to MLflow run {run.info.run_id}" in out
    record = RunRecord.load(logs)
    assert record.data["source"] == "diagnose"
    _check_mlflow(store, run.info.run_id, logs / "run_record.json", tmp_path)
    # the monitor's phases, once (diagnose logs none of its own)
    assert len(store.get_metric_history(run.info.run_id, "keras_gpufix/step_ms")) == 3
    # the W&B run ended with the script: resumed for the record (one more folder, same id)
    first, resumed = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert first.rsplit("-", 1)[1] == resumed.rsplit("-", 1)[1]
    summary, history = _wandb_run(first)
    assert "keras_gpufix/verdict" not in summary and len(history) == 3
    summary, history = _wandb_run(resumed)
    assert summary["keras_gpufix/verdict"] == record.data["verdict"]["verdict"]
    assert not history
    assert load_record(resumed).data == record.data
