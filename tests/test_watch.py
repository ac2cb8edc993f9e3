"""kg.watch: any loop, any iterable, the Keras hooks in fit's order."""

import inspect
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

import keras_gpufix as kg
from custom_loops import TRUTH, check_named_right, compiled_by_kind


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"epoch_begin {epoch}")

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(f"begin {batch}")

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(f"end {batch}")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(f"epoch_end {epoch}")

    def on_train_end(self, logs=None):
        self.calls.append("train_end")


def batches(n=3, size=4):
    return [np.zeros((size, 2), np.float32) for _ in range(n)]


def test_hooks_in_fit_order_over_epochs_and_a_break():
    recorder = Recorder()
    with kg.watch(batches(), callbacks=[recorder]) as watched:
        for _ in watched:
            pass
        for step, _ in enumerate(watched):
            if step == 1:
                break
        assert recorder.calls[-1] == "begin 1"  # the step is open in the loop body
    assert recorder.calls == [
        "train_begin",
        "epoch_begin 0", "begin 0", "end 0", "begin 1", "end 1", "begin 2", "end 2", "epoch_end 0",
        "epoch_begin 1", "begin 0", "end 0", "begin 1", "end 1", "epoch_end 1",
        "train_end",
    ]
    assert (watched.epoch, watched.steps) == (2, 5)


def test_an_error_in_the_loop_ends_the_run_without_ending_the_epoch():
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        with kg.watch(batches(), callbacks=[recorder]) as watched:
            for _ in watched:
                raise RuntimeError("boom")
    assert recorder.calls == ["train_begin", "epoch_begin 0", "begin 0", "end 0", "train_end"]


def test_a_stop_raised_by_the_iterable_ends_the_epoch_cleanly():
    # diagnose's --steps: the iterable's iterator raises StopIteration early.
    def two_then_stop():
        yield from batches(2)

    recorder = Recorder()
    with kg.watch(two_then_stop(), callbacks=[recorder]) as watched:
        seen = sum(1 for _ in watched)
    assert seen == 2
    assert recorder.calls[-3:] == ["end 1", "epoch_end 0", "train_end"]


def test_default_callback_is_the_monitor_and_bad_arguments_are_named():
    watched = kg.watch(batches())
    assert [type(c).__name__ for c in watched.callbacks] == ["GPUOscillationMonitor"]
    with pytest.raises(ValueError, match="`iterable` must be iterable.*Received: iterable=int"):
        kg.watch(3)
    with pytest.raises(ValueError, match="`callbacks` must be a list of keras.callbacks.Callback"):
        kg.watch(batches(), callbacks=[print])


def test_watching_a_list_on_jax_imports_no_tensorflow():
    pytest.importorskip("jax")
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import keras_gpufix as kg
        assert "tensorflow" not in sys.modules and "keras" not in sys.modules
        monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
        with kg.watch([np.ones((8, 3))] * 12, callbacks=[monitor]) as watched:
            for epoch in range(2):
                for batch in watched:
                    batch.sum()
        import keras
        print(keras.backend.backend(), "tensorflow" in sys.modules,
              watched.report()["step_time"]["count"])
    """)
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    backend, tf_imported, steps = out.stdout.split()[-3:]
    assert (backend, tf_imported) == ("jax", "False")
    assert int(steps) > 0


def test_time_in_next_is_the_input_wait_handed_with_the_batch_facts(monkeypatch):
    from keras_gpufix import watched as watched_module
    from keras_gpufix.callbacks import _clock as clock_module

    supplied = []

    class Stream:  # the shared step log's entry points (core's StepStream)
        def supply(self, wait, **facts):
            supplied.append((wait, facts))

        def drop_probe(self):  # a list is not the instrumented dataset itself
            supplied.append("drop_probe")

        def tell(self, **facts):  # what the run's judgement knows (synced)
            pass

    # iter(): 0.125 s to create the iterator; next(): start, return;
    # the ending next() and the iterator's release: 2 s, for the next step.
    clock = iter([0.0, 0.125, 10.0, 10.5, 11.0, 11.25, 12.0, 13.0, 13.0, 14.0])

    class Clock:
        @staticmethod
        def perf_counter():
            return next(clock)

    monkeypatch.setattr(watched_module, "stream_of", lambda callbacks: Stream())
    monkeypatch.setattr(clock_module, "time", Clock)  # the step clock times next()
    batches = [(np.zeros((4, 2)), np.zeros(4)), {"x": np.zeros((3, 5, 2))}]
    with kg.watch(batches, callbacks=[Recorder()]) as watched:
        assert sum(1 for _ in watched) == 2
    assert supplied == [
        "drop_probe",
        (0.625, {"samples": 4, "shape": ((4, 2), (4,)), "split": False,
                 "collective": False}),
        (0.25, {"samples": 3, "shape": ((3, 5, 2),), "split": False,
                 "collective": False}),
    ]
    assert watched._carry == 2.0


@pytest.mark.parametrize("kind", sorted(TRUTH))
def test_custom_loops_are_named_right(kind):
    check_named_right(kind, "watch")


def test_an_eager_step_is_reported_not_compiled_beside_a_compiled_one():
    # kg.watch cannot see how the step runs; RetracingMonitor(functions=...) can.
    assert compiled_by_kind("watch") == {"function": True, "eager": False}


def test_a_pydataset_and_a_generator_give_records_with_samples_and_waits():
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 6

        def __getitem__(self, index):
            return np.zeros((5, 2), np.float32), np.zeros(5, np.float32)

    timer = kg.StepTimer()
    with kg.watch(Batches(), callbacks=[timer]) as watched:
        for _ in range(2):
            for _ in watched:
                pass
    records = timer.records()
    assert [r.samples for r in records] == [5] * 12
    assert all(r.input_wait is not None and not r.split for r in records)
    assert [r.epoch_first for r in records] == ([True] + [False] * 5) * 2

    timer = kg.StepTimer()
    with kg.watch((np.zeros((3, 1)) for _ in range(4)), callbacks=[timer]) as watched:
        for _ in range(2):  # a generator is one epoch; the second is empty
            for _ in watched:
                pass
    assert [r.samples for r in timer.records()] == [3] * 4
    assert watched.epoch == 2


def test_the_report_is_readable_in_the_loop_and_a_short_run_is_judged_at_its_end():
    def slow_batches(n):  # 10 ms in next() against a 2 ms loop body
        for _ in range(n):
            time.sleep(0.01)
            yield np.zeros((4, 2))

    mid = []
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)  # window 96 > 40 steps
    with kg.watch(slow_batches(40), callbacks=[monitor]) as watched:
        for step, _ in enumerate(watched):
            time.sleep(0.002)
            if step == 35:
                mid.append(watched.report())
    assert mid[0]["verdict"] == "input_bound"
    assert 0 < mid[0]["step_time"]["count"] < watched.report()["step_time"]["count"]
    assert watched.report()["verdict"] == "input_bound"
    assert watched.report()["input_wait"] > 0.5

    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    with kg.watch(slow_batches(10), callbacks=[monitor]) as watched:  # 5 steps after warmup
        for _ in watched:
            pass
    assert watched.report()["verdict"] == "unknown"


def _stalled_loop(n, step_s, every, stall_s):
    """(report, file:line of the work) of a kg.watch loop over `n` batches whose steps
    take `step_s`, with `stall_s` of work on the host after every `every`th step (none
    where 0)."""
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    with kg.watch(batches(n), callbacks=[monitor]) as watched:
        for step, _ in enumerate(watched):
            time.sleep(step_s)  # the step
            if stall_s and step % every == every - 1:
                time.sleep(stall_s)  # the work every `every` steps (a plot, host work)
    source, first = inspect.getsourcelines(_stalled_loop)
    work = f"{__file__}:{first + next(i for i, l in enumerate(source) if 'the work every' in l)}"
    return watched.report(), work


def test_a_periodic_stall_is_named_at_the_loop_body_line_that_runs_it():
    report, plot = _stalled_loop(60, 0.004, 5, 0.08)  # a plot every 5 steps
    assert report["verdict"] == "periodic_stall", report["because"]
    assert report["fix"].endswith(f"at {plot}")
    (stall,) = [c for c in report["causes"] if c["verdict"] == "periodic_stall"]
    assert stall["where"] == plot
    # the run record names it too, as diagnose's does
    from keras_gpufix.run_record import RunRecord

    record = RunRecord.from_monitor(report)
    assert [f["where"] for f in record.data["fixes"]] == [[plot]]
    # a loop without stalls names no line
    report, _ = _stalled_loop(60, 0.004, 5, 0)
    assert all("where" not in c for c in report["causes"])


def test_host_work_shorter_than_a_step_every_4th_step_is_ranked_with_its_share_and_line():
    # 40 ms of work on the host at every 4th 40 ms step: a stalled cycle is twice the median at
    # most, the slow-step limit (1.25x) still sees it (issue 47, item 5)
    report, work = _stalled_loop(64, 0.04, 4, 0.04)
    assert report["verdict"] == "periodic_stall", report["because"]
    (stall,) = [c for c in report["causes"] if c["verdict"] == "periodic_stall"]
    assert stall["period"] == 4 and stall["where"] == work
    assert 0.1 <= stall["share"] <= 0.25  # 40 of every 200 ms: 20%


def test_a_failing_hand_over_is_one_warning_and_the_loop_goes_on(monkeypatch):
    from keras_gpufix import watched as watched_module

    class Broken:
        def supply(self, wait, **facts):
            raise RuntimeError("stream gone")

        def drop_probe(self):
            pass

        def tell(self, **facts):
            pass

    monkeypatch.setattr(watched_module, "stream_of", lambda callbacks: Broken())
    with pytest.warns(kg.GpufixWarning, match="could not hand step 1 to the monitors") as caught:
        with kg.watch(batches(4), callbacks=[Recorder()]) as watched:
            assert sum(1 for _ in watched) == 4
    assert len([w for w in caught if issubclass(w.category, kg.GpufixWarning)]) == 1


def test_each_step_end_waits_for_the_device_unless_sync_is_off(monkeypatch):
    from keras_gpufix import watched as watched_module

    waits = []
    monkeypatch.setattr(watched_module, "_sync_call", lambda backend: lambda: waits.append(1))
    with pytest.raises(ValueError, match="`sync` must be True or False. Received: sync='yes'"):
        kg.watch(batches(), sync="yes")
    timer = kg.StepTimer()
    with kg.watch(batches(12), callbacks=[timer]) as watched:
        for step, _ in enumerate(watched):
            if step >= 1:
                watched.step_done()  # ends the step: the rest of the body is `between`
                watched.step_done()  # outside a step: nothing
    assert len(waits) == 12 and watched.synced
    records = timer.records()
    assert all(r.input_wait is not None for r in records)
    # A step is split once the loop was seen to call step_done at its end.
    assert [r.split for r in records] == [False, False] + [True] * 10

    waits.clear()
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    timer = kg.StepTimer()
    with kg.watch(batches(12), callbacks=[monitor, timer], sync=False) as watched:
        for _ in watched:
            watched.step_done()
    assert waits == [] and not watched.synced and monitor.detector.synced is False
    # Timed at dispatch: no input wait is claimed; the cycle is the step.
    assert all(r.input_wait is None and r.between == 0.0 and not r.split
               for r in timer.records())
    assert monitor.report()["input_wait"] is None


def test_a_failing_sync_is_one_warning_and_the_steps_are_unsynced_after(monkeypatch):
    from keras_gpufix import watched as watched_module

    def broken():
        raise RuntimeError("device lost")

    monkeypatch.setattr(watched_module, "_sync_call", lambda backend: broken)
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    timer = kg.StepTimer()
    with pytest.warns(kg.GpufixWarning, match="could not wait for step 1's device work") as caught:
        with kg.watch(batches(6), callbacks=[monitor, timer]) as watched:
            assert sum(1 for _ in watched) == 6
    assert len([w for w in caught if issubclass(w.category, kg.GpufixWarning)]) == 1
    assert not watched.synced and monitor.detector.synced is False
    assert [r.input_wait is None for r in timer.records()] == [False] + [True] * 5


def test_the_sync_of_each_backend(monkeypatch):
    import types

    from keras_gpufix.watched import _sync_call

    assert _sync_call("numpy") is None  # synchronous: nothing to wait for
    tf = pytest.importorskip("tensorflow")
    assert _sync_call("tensorflow") is None  # synchronous eager execution on a CPU
    tf.config.experimental.set_synchronous_execution(False)
    try:
        assert _sync_call("tensorflow") is tf.test.experimental.sync_devices
    finally:
        tf.config.experimental.set_synchronous_execution(True)
    pytest.importorskip("jax")
    _sync_call("jax")()  # blocks on the live arrays: none pending here
    cuda = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda: None)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert _sync_call("torch") is cuda.synchronize
    cuda.is_available = lambda: False
    assert _sync_call("torch") is None


def test_an_eager_gradient_in_the_loop_reaches_the_runs_judgement_with_its_line():
    import tensorflow as tf

    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    weight = tf.Variable(1.0)
    with kg.watch([np.ones(2)] * 2, callbacks=[monitor]) as watched:
        for _ in watched:
            with tf.GradientTape() as tape:
                loss = weight * 2.0
            tape.gradient(loss, weight)
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "tape.gradient(loss, weight)" in text)
    assert monitor.detector.eager is True
    assert monitor.detector.eager_where == f"{__file__}:{line}"
