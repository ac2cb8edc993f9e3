import sys
import time
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.compile.hardware import device_info
from keras_gpufix.exceptions import GpufixWarning
from planted import FEATURES, SleepEvery, StepWork, planted_dataset, tiny_model

REPORT_KEYS = {"verdict", "fix", "phase", "cost_share", "because", "changed", "errors",
               "events", "step_time", "input_wait", "gpu_util", "epoch_start_ms", "new_shapes"}
EVENT_KEYS = {"verdict", "start_step", "end_step", "cv", "period", "evidence", "fix"}


def fit(kind, monitor, epochs=1, **kwargs):
    tiny_model().fit(planted_dataset(kind, **kwargs), epochs=epochs, verbose=0,
                     callbacks=[monitor])
    return monitor.report()


@pytest.mark.flaky(reruns=1)  # a verdict from wall-clock time: a host loaded beside it (another test worker) can move one run
def test_healthy_run_raises_no_alarm(capsys):
    monitor = kg.GPUOscillationMonitor(nvml=False)
    report = fit("healthy", monitor)
    assert set(report) >= REPORT_KEYS
    assert report["verdict"] == "healthy" and report["events"] == []
    assert report["input_wait"] is not None and report["input_wait"] < 0.2
    assert report["step_time"]["count"] == 240 - 5  # warmup left out
    out = capsys.readouterr().out
    assert "GPU utilisation not sampled" not in out or device_info()["gpus"]  # no GPU: no line
    assert "verdict healthy" in out


def test_slow_input_is_input_bound_with_measured_wait():
    report = fit("slow", kg.GPUOscillationMonitor(verbose=0, nvml=False), batches=160, sleep=0.01)
    assert report["verdict"] == "input_bound"
    event = report["events"][0]
    assert set(event) >= EVENT_KEYS
    assert "input_wait" in event["evidence"]["signals"]
    assert event["evidence"]["input_wait"] > 0.5
    assert report["input_wait"] > 0.5
    assert "AUTOTUNE" in event["fix"]


def test_periodic_stall_named_with_its_period():
    report = fit("periodic", kg.GPUOscillationMonitor(verbose=0, nvml=False), k=7)
    assert report["verdict"] == "periodic_stall"
    assert report["events"][0]["period"] == 7
    assert report["events"][0]["phase"] == "input_wait"


def test_work_between_steps_is_named_with_its_phase_and_cost():
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)
    tiny_model().fit(planted_dataset("healthy", batches=200), epochs=1, verbose=0,
                     callbacks=[StepWork(0.004), monitor, SleepEvery(6, 0.012)])
    report = monitor.report()
    event = report["events"][0]
    assert (report["verdict"], event["phase"], event["period"]) == ("periodic_stall",
                                                                     "between", 6)
    assert event["fix"].startswith("work between steps every 6 steps costs")
    assert report["phases"]["between"] > 0.15  # 12 ms every 6 steps of about 4 ms
    assert report["step_time"]["phases"]["between"] == report["phases"]["between"]


def test_a_run_shorter_than_the_window_is_judged_at_its_end():
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)  # window 96
    report = fit("slow", monitor, batches=40, sleep=0.01)
    assert report["verdict"] == "input_bound" and report["input_wait"] > 0.4
    tiny = fit("healthy", kg.GPUOscillationMonitor(verbose=0, nvml=False), batches=10)
    assert tiny["verdict"] == "unknown"  # 5 steps after warmup
    assert tiny["fix"].startswith("only 5 steps after warmup (fewer than min_judge_steps=8)")


def test_events_reach_on_detect_and_our_other_callbacks(tmp_path):
    got = []
    trigger = kg.ProfilerTrigger(str(tmp_path), steps=2, analyze=False, verbose=0)
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False, on_detect=got.append)
    tiny_model().fit(planted_dataset("periodic"), epochs=1, verbose=0,
                     callbacks=[monitor, trigger])
    assert [e["verdict"] for e in got] == ["periodic_stall"]
    # the trigger in the same list gets the event from the run's one judgement
    assert trigger.traces[0]["reason"].startswith("oscillation: periodic_stall")


def test_an_exception_of_the_users_on_detect_propagates_as_keras_does():
    calls = []

    def broken(event):
        calls.append(event)
        raise RuntimeError("boom")

    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False, on_detect=broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom") as raised:
            tiny_model().fit(planted_dataset("periodic", batches=400), epochs=2, verbose=0,
                             callbacks=[monitor])
    assert len(calls) == 1 and monitor.report()["errors"] == []
    assert [w for w in caught if issubclass(w.category, GpufixWarning)] == []
    assert raised.traceback[-1].name == "broken"  # the user's frame, not ours


def test_internal_error_never_stops_fit(monkeypatch):
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)

    def broken_update(*args, **kwargs):
        raise ZeroDivisionError("detector bug")

    monkeypatch.setattr(monitor.detector, "update", broken_update)
    with pytest.warns(GpufixWarning, match="detector bug"):
        history = tiny_model().fit(planted_dataset("healthy", batches=40), epochs=2,
                                   verbose=0, callbacks=[monitor])
    assert len(history.history["loss"]) == 2


def fake_pynvml(util=30, fail_after=None):
    state = {"calls": 0}

    def rates(handle):
        state["calls"] += 1
        if fail_after is not None and state["calls"] > fail_after:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return types.SimpleNamespace(gpu=util)

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "Fake GPU", nvmlDeviceGetUtilizationRates=rates,
    )


def test_nvml_samples_become_evidence(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(util=30))
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=True)
    report = fit("slow", monitor, batches=160, sleep=0.01)
    assert report["gpu_util"] == pytest.approx(0.30)
    assert "gpu_util" in report["events"][0]["evidence"]["signals"]
    assert report["verdict"] == "input_bound"


def test_nvml_failure_mid_run_warns_once_and_training_finishes(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_after=3))
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=True)
    with pytest.warns(GpufixWarning, match="GPU_IS_LOST") as record:
        history = tiny_model().fit(planted_dataset("healthy", batches=60), epochs=2,
                                   verbose=0, callbacks=[monitor])
    assert len(history.history["loss"]) == 2
    assert len([w for w in record if issubclass(w.category, GpufixWarning)]) == 1


def test_bad_on_detect_is_rejected():
    with pytest.raises(ValueError, match="`on_detect`"):
        kg.GPUOscillationMonitor(on_detect=42)


class HostWorkEvery(keras.callbacks.Callback):
    """Host work every `k`-th batch of `factor` x the median cycle so far (a
    user's logging callback), whatever the host's load makes that cycle."""

    def __init__(self, k=5, factor=1.0):
        super().__init__()
        self.k, self.factor = k, factor
        self.cycles, self.last = [], None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self.last is not None and (batch - 1) % self.k:  # a cycle without the work
            self.cycles.append(now - self.last)
        if batch % self.k == 0 and self.cycles:
            time.sleep(self.factor * float(np.median(self.cycles)))
        self.last = time.perf_counter() if batch % self.k == 0 else now


def test_work_of_a_callback_listed_first_between_uneven_steps_is_found_between():
    # Batches of uneven length (no kg.data.instrument: shapes unknown), the
    # step growing with the length, as CTC ASR or MelGAN batches do.
    lengths = np.random.default_rng(0).integers(16, 400, 150)
    ds = tf.data.Dataset.from_tensor_slices(lengths).map(
        lambda n: (tf.random.uniform([16, n, 32]), tf.zeros([16, 1]))).prefetch(2)
    inp = keras.Input((None, 32))
    hidden = keras.layers.Dense(128, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden)))
    model.compile("adam", "mse", jit_compile=False)
    work, monitor = HostWorkEvery(5), kg.GPUOscillationMonitor(verbose=0, nvml=False)
    model.fit(ds, epochs=1, verbose=0, callbacks=[work, monitor])  # the user's callback first
    report = monitor.report()
    assert report["step_time"]["cv"] > 0.3  # uneven steps
    assert (report["verdict"], report["phase"]) == ("periodic_stall", "between")
    assert [e["period"] for e in report["events"] if e["verdict"] == "periodic_stall"][0] == 5
    assert report["phases"]["between"] > 0.1


class EagerSpeech(keras.Model):
    def compile(self, optimizer="adam", loss="mse", run_eagerly=True, **kwargs):
        super().compile(optimizer=optimizer, loss=loss, run_eagerly=run_eagerly,  # here
                        **kwargs)


def test_the_eager_step_fix_names_the_compile_override_that_made_it_eager():
    inp = keras.Input((FEATURES,))
    model = EagerSpeech(inp, keras.layers.Dense(1)(inp))
    model.compile()
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)
    model.fit(planted_dataset("healthy", batches=30), epochs=1, verbose=0, callbacks=[monitor])
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, start=1) if text.rstrip().endswith("# here"))
    report = monitor.report()
    assert report["verdict"] == "eager_step"
    assert report["fix"].endswith(f", at {__file__}:{line}")
    assert report["events"][0]["fix"] == report["fix"]


def _speech_batches(bucketed):
    """240 utterances, 8 a batch, each batch's longest of 100-400 frames (its others from
    20 frames up to it): padded to the longest of each batch, or bucketed by length
    (10-frame buckets, padded to the boundary); their lengths told to the monitors
    (`instrument(frames=...)`)."""
    rng = np.random.default_rng(0)
    caps = np.repeat(rng.integers(100, 400, 30), 8)
    lengths = tf.constant(rng.integers(20, caps), tf.int32)
    ds = tf.data.Dataset.from_tensor_slices(lengths).repeat().map(
        lambda n: (tf.ones([n, 64]), n))
    if bucketed:
        ds = ds.bucket_by_sequence_length(lambda x, n: n, list(range(10, 410, 10)), [8] * 41,
                                          pad_to_bucket_boundary=True)
    else:
        ds = ds.padded_batch(8)
    ds = kg.data.instrument(ds, frames=lambda batch: batch[1])
    return ds.map(lambda x, n: (x, x[:, :, :1])).prefetch(2)


def test_padding_that_costs_the_step_is_named_with_buckets_for_fix():
    def run(bucketed):
        inputs = keras.Input((None, 64))
        x = keras.layers.Conv1D(256, 9, padding="same", activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Conv1D(1, 9, padding="same")(x))
        model.compile("sgd", "mse")
        monitor = kg.GPUOscillationMonitor(window=16, warmup=4, nvml=False, verbose=0)
        model.fit(_speech_batches(bucketed), epochs=1, steps_per_epoch=30, verbose=0,
                  callbacks=[monitor])
        return monitor.report()

    padded = run(bucketed=False)
    causes = {c["verdict"]: c for c in padded["causes"]}
    assert "padded_batches" in causes, padded["causes"]
    assert "num_buckets" in causes["padded_batches"]["fix"]
    evidence = next(e["evidence"] for e in padded["events"] if "padding" in e["evidence"])
    assert 0.3 < evidence["padding"] < 0.6  # 20-400 frames, padded to each batch's longest
    bucketed = run(bucketed=True)
    assert "padded_batches" not in {c["verdict"] for c in bucketed["causes"]}
