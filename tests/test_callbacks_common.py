"""Every public callback: defaults, two fits, steps_per_execution, TensorBoard, one
report layout, the Keras `logs` keys."""

import csv
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.data import instrument
from keras_gpufix.exceptions import GpufixWarning
from planted import FEATURES, tiny_model

PUBLIC = ["StepTimer", "GPUOscillationMonitor", "ProfilerTrigger", "RetracingMonitor"]


def make(name, tmp_path):
    cls = getattr(kg, name)
    if name == "ProfilerTrigger":  # its only required argument
        return cls(str(tmp_path / "trigger"))
    return cls()


def dataset():
    x = np.random.default_rng(0).random((48 * 8, FEATURES), dtype=np.float32)
    return instrument(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)).prefetch(2)


def test_every_public_callback_is_listed():
    assert set(PUBLIC) == set(kg.callbacks.__all__)


@pytest.mark.flaky(reruns=1)  # a verdict from wall-clock time: a host loaded beside it (another test worker) can move one run
@pytest.mark.parametrize("name", PUBLIC)
def test_two_fits_with_steps_per_execution_and_tensorboard(name, tmp_path):
    callback = make(name, tmp_path)
    model = tiny_model(steps_per_execution=3)
    tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tb"), profile_batch=0)
    for _ in range(2):
        history = model.fit(dataset(), epochs=2, verbose=0, callbacks=[callback, tensorboard])
        assert len(history.history["loss"]) == 2
    assert not getattr(callback, "errors", [])
    CHECK_SECOND_FIT[name](callback, tmp_path)


def _step_timer(timer, tmp_path):
    # state reset per fit: one fit's 2 x 16 hooks of 3 steps, each timed
    assert [r.steps for r in timer.records()] == [3] * 32
    summary = timer.summary()
    assert summary["count"] == 96 and summary["mean_ms"] > 0
    assert summary["steps_per_record"] == 3
    assert summary["samples_per_s"] > 0  # batch size read from the instrumented batches


def _monitor(monitor, tmp_path):
    report = monitor.report()
    assert report["step_time"]["count"] > 0 and report["step_time"]["mean_ms"] > 0
    assert report["new_shapes"] == 1  # one batch shape, read from the instrumented data
    assert report["input_wait"] is not None and 0 <= report["input_wait"] <= 1
    assert report["fix"] and report["errors"] == []
    assert all(e["start_step"] <= e["end_step"] < 96 for e in report["events"])


def _profiler(trigger, tmp_path):
    report = trigger.report()  # nothing armed it: no GPUOscillationMonitor in the list
    assert report["traces"] == [] and report["skipped"] == []
    assert report["log_dir"] == str(tmp_path / "trigger")
    assert str(tmp_path / "trigger") in report["tensorboard"]


def _retracing(monitor, tmp_path):
    report = monitor.report()
    assert report["steps"] == 96 and report["compiled"] is True
    assert report["trace_count"] == 0  # traced in the first fit only
    assert report["new_shapes"] == 1 and report["shapes"] == [[[8, FEATURES], [8, 1]]]
    assert report["recompile_ms"] == 0.0 and report["verdict"] == "healthy"


CHECK_SECOND_FIT = {"StepTimer": _step_timer, "GPUOscillationMonitor": _monitor,
                    "ProfilerTrigger": _profiler, "RetracingMonitor": _retracing}


def _broken(*args, **kwargs):
    raise RuntimeError("injected")


def _inject(name, monkeypatch):
    """Breaks one thing each callback relies on, inside its hooks."""
    if name == "StepTimer":
        import keras_gpufix.callbacks._clock as module

        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=_broken,
                                                                  time=_broken))
    elif name == "GPUOscillationMonitor":
        from keras_gpufix.analysis import OscillationDetector

        monkeypatch.setattr(OscillationDetector, "update", _broken)
    elif name == "ProfilerTrigger":
        from keras_gpufix import profiling

        monkeypatch.setattr(profiling, "step_marker", _broken)
    else:
        from keras_gpufix.callbacks import retracing_monitor

        monkeypatch.setattr(retracing_monitor.RetracingMonitor, "_trace_total", _broken)


@pytest.mark.parametrize("name", PUBLIC)
def test_a_failure_inside_any_callback_is_one_warning_at_the_users_line(
        name, tmp_path, monkeypatch):
    callback = make(name, tmp_path)
    if name == "ProfilerTrigger":  # a trace due at step 2, so its hooks mark steps
        callback = kg.ProfilerTrigger(str(tmp_path / "trigger"), trigger=2, steps=2,
                                      analyze=False, verbose=0)
    _inject(name, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = tiny_model().fit(dataset(), epochs=2, verbose=0, callbacks=[callback])
    assert len(history.history["loss"]) == 2  # fit went on
    ours = [w for w in caught if issubclass(w.category, GpufixWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "RuntimeError: injected" in str(ours[0].message)
    assert "training continues" in str(ours[0].message)
    assert ours[0].filename == __file__  # the fit(...) line, not our base class
    assert callback.errors and all("injected" in e for e in callback.errors)


HEAD = ("verdict", "fix", "phase", "cost_share", "because", "changed")


def test_one_report_layout_and_keras_logs_a_progress_bar_can_show(tmp_path):
    callbacks = [make(name, tmp_path) for name in PUBLIC]
    steps = []
    batch_logs = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append(logs["step_ms"]))
    csv_logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    early = keras.callbacks.EarlyStopping(monitor="step_ms", mode="min", patience=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GpufixWarning)
        history = tiny_model().fit(dataset(), epochs=2, verbose=0,
                                   callbacks=[*callbacks, batch_logs, csv_logger, early])
    reports = [cb.report() for cb in callbacks]
    head = {k: reports[0][k] for k in HEAD}
    assert all({k: r[k] for k in HEAD} == head for r in reports)  # one verdict, one layout
    assert all(r["errors"] == [] for r in reports)
    assert len(steps) == 96 and all(s > 0 for s in steps)
    logged = history.history
    assert "verdict" not in logged  # a name, in report(); an index on a progress bar says nothing
    assert all(s > 0 for s in logged["step_ms"]) and all(0 <= w <= 1 for w in logged["input_wait"])
    # the input wait the run's report gives, the warm-up and epoch starts left out
    monitor = reports[PUBLIC.index("GPUOscillationMonitor")]
    assert logged["input_wait"][-1] == pytest.approx(monitor["input_wait"], abs=0.01)
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["step_ms"]) for r in rows] == pytest.approx(logged["step_ms"])
    assert [float(r["input_wait"]) for r in rows] == pytest.approx(logged["input_wait"])
