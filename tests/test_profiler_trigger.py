"""ProfilerTrigger with real `fit` on CPU: when it traces, and what it leaves running."""

import gc
import glob
import os
import re
import threading
import time
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix import profiling
from keras_gpufix.analysis import THRESHOLDS, slow_limit
from keras_gpufix.exceptions import GpufixWarning
from planted import planted_dataset, tiny_model


def xplanes(log_dir):
    return glob.glob(os.path.join(str(log_dir), "**", "*.xplane.pb"), recursive=True)


class Boom(keras.callbacks.Callback):
    """Another user callback that raises mid-fit."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise RuntimeError("boom")


class Emit(keras.callbacks.Callback):
    """Plays the monitor: calls `on_oscillation` at given batches."""

    def __init__(self, target, events):
        super().__init__()
        self.target, self.events = target, events

    def on_train_batch_end(self, batch, logs=None):
        if batch in self.events:
            self.target.on_oscillation(self.events[batch])


@pytest.fixture(autouse=True)
def no_trace_left():
    yield
    left = profiling.active_trace()
    if left is not None:
        profiling.stop_trace(save=False)
    assert left is None, "a test left a keras_gpufix trace running"


@pytest.fixture(scope="module")
def input_bound_run(tmp_path_factory):
    """The planted input-bound pipeline; the monitor is found as a sibling."""
    log_dir = tmp_path_factory.mktemp("input_bound")
    monitor = kg.GPUOscillationMonitor(window=32, nvml=False, verbose=0)
    trigger = kg.ProfilerTrigger(str(log_dir), steps=8, verbose=0)
    tiny_model().fit(planted_dataset("slow", batches=120), epochs=1, verbose=0,
                     callbacks=[trigger, monitor])
    return log_dir, monitor, trigger


def test_input_bound_run_is_traced_and_classified(input_bound_run):
    log_dir, monitor, trigger = input_bound_run
    assert "input_bound" in {e["verdict"] for e in monitor.events}
    assert len(trigger.traces) == 1
    trace = trigger.traces[0]  # armed by the first event, found without wiring
    assert trace["reason"].startswith(f"oscillation: {monitor.events[0]['verdict']} at steps")
    assert trace["end_step"] - trace["start_step"] + 1 == 8
    assert trace["start_step"] >= monitor.events[0]["start_step"] + monitor.window
    assert os.path.dirname(trace["path"]) == os.path.join(str(log_dir), "plugins", "profile")
    assert glob.glob(os.path.join(trace["path"], "*.xplane.pb"))
    analysis = trace["analysis"]
    assert analysis["steps"] >= 4  # XProf may drop a partial first or last step
    assert analysis["step_time_ms"] > 0
    assert analysis["classification"] in ("highly_input_bound", "moderately_input_bound")
    assert analysis["input_percent"] >= THRESHOLDS["xprof_moderately_input_bound_percent"]
    assert "input-bound" in analysis["conclusion"]
    assert trigger.report()["traces"][0]["path"] == trace["path"]


def test_healthy_run_with_oscillation_trigger_captures_nothing(tmp_path):
    # The monitor's part is played by Emit, so the run is healthy on any machine:
    # a healthy verdict every 10 steps must never start a trace.
    trigger = kg.ProfilerTrigger(str(tmp_path), verbose=0)
    healthy = {b: {"verdict": "healthy", "start_step": b - 9, "end_step": b}
               for b in range(9, 90, 10)}
    tiny_model().fit(planted_dataset("healthy", batches=90), epochs=1, verbose=0,
                     callbacks=[trigger, Emit(trigger, healthy)])
    assert trigger.traces == [] and trigger.skipped == []
    assert xplanes(tmp_path) == []
    assert trigger.report()["traces"] == []


def test_fit_returns_while_a_slow_analysis_runs_and_it_lands_in_the_report(
        tmp_path, monkeypatch, capsys):
    release, result = threading.Event(), {"step_time_ms": 1.0, "classification": "x"}

    def slow_analysis(path):  # XProf on a trace of long steps: minutes
        release.wait(60)
        return dict(result, path=path)

    monkeypatch.setattr(profiling, "analyze_trace", slow_analysis)
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=2, steps=3, analysis_timeout=0.2)
    tiny_model().fit(planted_dataset("healthy", batches=12), epochs=1, verbose=0,
                     callbacks=[trigger])
    assert trigger.traces[0]["analysis"] is None  # fit did not wait for it
    assert trigger.report()["traces"][0]["pending"] is True
    assert "1 XProf analysis(es) still running after 0.2 s" in capsys.readouterr().out
    release.set()
    for _ in range(100):
        if not trigger.report()["traces"][0]["pending"]:
            break
        time.sleep(0.05)
    late = trigger.report()["traces"][0]
    assert late["pending"] is False
    assert late["analysis"] == dict(result, path=trigger.traces[0]["path"])


def test_on_oscillation_arms_a_trace_and_ignores_recoveries(tmp_path):
    trigger = kg.ProfilerTrigger(str(tmp_path), steps=3, analyze=False, verbose=0)
    event = {"verdict": "periodic_stall", "start_step": 1, "end_step": 9}
    emit = Emit(trigger, {2: {"verdict": "healthy", "start_step": 0, "end_step": 2},
                          9: event})
    tiny_model().fit(planted_dataset("healthy", batches=20), epochs=1, verbose=0,
                     callbacks=[trigger, emit])
    assert [(t["start_step"], t["end_step"]) for t in trigger.traces] == [(10, 12)]
    assert trigger.traces[0]["reason"] == "oscillation: periodic_stall at steps 1-9"
    assert trigger.traces[0]["analysis"] is None  # analyze=False
    assert len(xplanes(tmp_path)) == 1


def test_on_detect_wiring_and_a_trigger_without_oscillation(tmp_path):
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger="slow_step", verbose=0)
    trigger.on_oscillation({"verdict": "input_bound", "start_step": 0, "end_step": 5})
    tiny_model().fit(planted_dataset("healthy", batches=12), epochs=1, verbose=0,
                     callbacks=[trigger])
    assert trigger.traces == []


def test_step_triggers_respect_max_traces_and_cooldown_over_two_fits(tmp_path):
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=[2, 4, 6, 8, 30], steps=3,
                                 max_traces=2, cooldown=5, analyze=False, verbose=0)
    model = tiny_model()
    for fit in range(2):
        model.fit(planted_dataset("healthy", batches=40), epochs=1, verbose=0,
                  callbacks=[trigger])
        spans = [(t["start_step"], t["end_step"]) for t in trigger.traces[2 * fit:]]
        # 2-4 traced; "step 4" armed meanwhile waits out the cool-down (> 4 + 5).
        assert spans == [(2, 4), (10, 12)]
        assert [t["reason"] for t in trigger.traces[2 * fit:]] == ["step 2", "step 4"]
    assert len({t["path"] for t in trigger.traces}) == 4
    assert len(xplanes(tmp_path)) == 4


def test_slow_step_trigger_traces_the_next_steps(tmp_path):
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger="slow_step", steps=4, warmup=5,
                                 analyze=False, verbose=0)
    # The run's thresholds, one setting for every callback: the monitor's.
    monitor = kg.GPUOscillationMonitor(thresholds={"min_slow_ms": 100}, nvml=False, verbose=0)
    stall = planted_dataset("periodic", batches=60, k=40, sleep=0.3)  # batch 40 stalls
    tiny_model().fit(stall, epochs=1, verbose=0, callbacks=[monitor, trigger])
    assert len(trigger.traces) == 1
    trace = trigger.traces[0]
    slow = int(re.match(r"slow step (\d+):", trace["reason"]).group(1))
    assert 38 <= slow <= 41  # prefetch(2) may move the wait by a step or two
    assert trace["start_step"] == slow + 1
    assert trace["end_step"] == slow + 4


def test_slow_step_is_timed_by_the_shared_stream_and_judged_by_the_one_rule(
        tmp_path, monkeypatch):
    import keras_gpufix.callbacks._clock as stream_module

    clock = {"now": 0.0, "reads": 0}

    def perf_counter():
        clock["reads"] += 1
        return clock["now"]

    def slow_stop(save=True):  # saving a trace takes a while: our own time, not a stall
        clock["now"] += 1.0
        return stop(save)

    # Only the stream's clock is faked: a cycle slow on it alone must fire the trigger.
    monkeypatch.setattr(stream_module, "time",
                        types.SimpleNamespace(perf_counter=perf_counter, time=lambda: 1e9))
    stop = profiling.stop_trace
    monkeypatch.setattr(profiling, "stop_trace", slow_stop)
    timer = kg.StepTimer()
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger="slow_step", steps=2, warmup=5,
                                 cooldown=5, analyze=False, verbose=0)
    hooks = keras.callbacks.CallbackList([timer, trigger], model=tiny_model())
    hooks.on_train_begin()
    hooks.on_epoch_begin(0)
    for i in range(60):
        hooks.on_train_batch_begin(i)
        # step 20: 1.8x the median cycle, under stall_factor=2 (the rule's limit: 22 ms)
        clock["now"] += {20: 0.019, 45: 0.5}.get(i, 0.010)
        hooks.on_train_batch_end(i, {})
        clock["now"] += 0.4 if i == 30 else 0.001  # a callback stalls after step 30
    hooks.on_epoch_end(0)
    hooks.on_train_end()
    assert trigger.stream is timer.stream
    assert clock["reads"] == 2 * 60 + 1  # begin + end per step, and the stream's offset
    assert slow_limit([0.011] * 16, factor=THRESHOLDS["stall_factor"],
                      min_ms=THRESHOLDS["min_slow_ms"]) == pytest.approx(0.022)
    assert [(t["start_step"], t["end_step"], t["reason"]) for t in trigger.traces] == [
        (32, 33, "slow step 31: 410.0 ms against a median of 11.0 ms"),  # between steps
        (46, 47, "slow step 45: 501.0 ms against a median of 11.0 ms"),  # in the step
    ]  # step 34, after the 1 s of saving the first trace, fired nothing


def test_works_under_kg_watch_without_a_model(tmp_path):
    # Issue 21: every hook failed with "cannot create weak reference to 'NoneType'".
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=2, steps=2, analyze=False, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GpufixWarning)
        with kg.watch([np.zeros((2, 3), np.float32)] * 12, callbacks=[trigger]) as watched:
            for _ in watched:
                pass
    assert trigger.errors == []
    assert [(t["start_step"], t["end_step"]) for t in trigger.traces] == [(2, 3)]
    assert glob.glob(os.path.join(trigger.traces[0]["path"], "*.xplane.pb"))
    assert trigger.report()["verdict"] == "unknown"  # 12 steps: too few to judge


def test_tensorboard_profile_batch_in_the_same_list(tmp_path, monkeypatch):
    active, seen = [], {"max": 0, "starts": []}
    start, stop = tf.profiler.experimental.start, tf.profiler.experimental.stop

    def counting_start(logdir, options=None):
        start(logdir, options=options)
        active.append(logdir)
        seen["starts"].append(str(logdir))
        seen["max"] = max(seen["max"], len(active))

    def counting_stop(save=True):
        stop(save=save)
        active.pop()

    tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tb"), profile_batch=(2, 4))
    monkeypatch.setattr(tf.profiler.experimental, "start", counting_start)
    monkeypatch.setattr(tf.profiler.experimental, "stop", counting_stop)
    trigger = kg.ProfilerTrigger(str(tmp_path / "kg"), trigger=2, steps=3, analyze=False,
                                 verbose=0)
    with pytest.warns(GpufixWarning, match="another profiler is running"):
        history = tiny_model().fit(planted_dataset("healthy", batches=20), epochs=1,
                                   verbose=0, callbacks=[tensorboard, trigger])
    assert len(history.history["loss"]) == 1
    assert seen["max"] == 1 and active == []
    # TensorBoard traced its batches 2-4 (steps 1-3); ours waited `steps` steps.
    assert seen["starts"] == [str(tmp_path / "tb" / "train"), str(tmp_path / "kg")]
    assert [(t["start_step"], t["end_step"]) for t in trigger.traces] == [(5, 7)]
    assert len(xplanes(tmp_path / "tb")) == 1 and len(xplanes(tmp_path / "kg")) == 1
    assert trigger.report()["skipped"][0].startswith("step 2:")


def test_exception_in_another_callback_does_not_leave_the_profiler_running(tmp_path):
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=2, steps=50, analyze=False,
                                 verbose=0)
    model = tiny_model()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(planted_dataset("healthy", batches=20), epochs=1, verbose=0,
                  callbacks=[trigger, Boom(at=5)])
    assert profiling.active_trace() is not None  # on_train_end never ran
    with pytest.warns(GpufixWarning, match="ended by an exception"):
        model.fit(planted_dataset("healthy", batches=20), epochs=1, verbose=0,
                  callbacks=[trigger])
    interrupted, fresh = trigger.traces
    assert interrupted["reason"] == "step 2 (fit ended by an exception)"
    assert (interrupted["start_step"], interrupted["end_step"]) == (2, 5)
    assert glob.glob(os.path.join(interrupted["path"], "*.xplane.pb"))
    assert (fresh["start_step"], fresh["end_step"]) == (2, 19)  # fit ended first
    profiling.start_trace(tmp_path / "free")  # raises ProfilerBusyError if one still runs
    profiling.stop_trace(save=False)


def test_a_dropped_trigger_stops_its_trace_for_the_next_profiler(tmp_path):
    trigger = kg.ProfilerTrigger(str(tmp_path / "kg"), trigger=1, steps=50, analyze=False,
                                 verbose=0)
    model = tiny_model()
    try:
        model.fit(planted_dataset("healthy", batches=20), epochs=1, verbose=0,
                  callbacks=[trigger, Boom(at=3)])
    except RuntimeError:
        pass
    assert profiling.active_trace() is not None
    del trigger
    gc.collect()
    profiling.start_trace(tmp_path / "free")  # raises ProfilerBusyError if one still runs
    profiling.stop_trace(save=False)
    tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tb"), profile_batch=2)
    model.fit(planted_dataset("healthy", batches=6), epochs=1, verbose=0,
              callbacks=[tensorboard])
    assert len(xplanes(tmp_path / "tb")) == 1  # TensorBoard could profile


@pytest.mark.parametrize("kwargs, match", [
    ({"log_dir": ""}, "log_dir"),
    ({"trigger": "sometimes"}, "trigger"),
    ({"trigger": [3, -1]}, "trigger"),
    ({"trigger": True}, "trigger"),
    ({"steps": 0}, "steps"),
    ({"max_traces": 0}, "max_traces"),
    ({"cooldown": -1}, "cooldown"),
    ({"analysis_timeout": -1}, "analysis_timeout"),
])
def test_arguments_are_checked(kwargs, match):
    kwargs = {"log_dir": "logs", **kwargs}
    with pytest.raises(ValueError, match=match):
        kg.ProfilerTrigger(**kwargs)
