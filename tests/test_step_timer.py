import glob
import tracemalloc
import types
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.data import instrument
from planted import FEATURES, tiny_model


def drive(timer, clock, steps):
    """Runs the hooks of one epoch of `steps` steps with a patched clock.

    `clock` holds the begin/end reads; the stream reads the clock once more
    when it opens (its wall-time offset).
    """
    with mock.patch("keras_gpufix.callbacks._clock.time.perf_counter",
                    side_effect=[0.0] + list(clock)):
        timer.on_train_begin()
        timer.on_epoch_begin(0)
        for i in range(steps):
            timer.on_train_batch_begin(i)
            timer.on_train_batch_end(i, {})
        timer.on_epoch_end(0)
        timer.on_train_end()


def test_patched_clock_gives_exact_figures():
    timer = kg.StepTimer(batch_size=32)
    # steps of 10, 20, 30, 40 ms, 5 ms between them
    drive(timer, [0.0, 0.010, 0.015, 0.035, 0.040, 0.070, 0.075, 0.115], 4)
    records = timer.records()
    assert [r.step for r in records] == pytest.approx([0.010, 0.020, 0.030, 0.040])
    assert [r.between for r in records] == pytest.approx([0.0, 0.005, 0.005, 0.005])
    assert all(r.input_wait is None for r in records)  # no instrumented dataset
    s = timer.summary()
    assert s["count"] == 4
    assert s["mean_ms"] == pytest.approx(115 / 4)  # the cycle: step + between
    assert s["max_ms"] == pytest.approx(45.0)
    assert s["samples_per_s"] == pytest.approx(4 * 32 / 0.115)
    assert s["phases"]["between"] == pytest.approx(15 / 115)
    assert s["phases"]["input_wait"] is None
    assert s["steps_per_record"] == 1


def test_warmup_steps_left_out_of_summary():
    timer = kg.StepTimer(warmup=1)
    drive(timer, [0.0, 5.0, 5.0, 5.010, 5.010, 5.020], 3)
    s = timer.summary()
    assert s["count"] == 2
    assert s["max_ms"] == pytest.approx(10.0)
    assert s["samples_per_s"] is None  # no batch size known


def test_steps_per_execution_divides_the_hook():
    model = tiny_model(steps_per_execution=4)
    x = np.random.rand(32 * 16, FEATURES).astype("float32")
    timer = kg.StepTimer()
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[timer])
    records = timer.records()
    assert [r.steps for r in records] == [4] * 8
    assert [r.index for r in records] == list(range(0, 32, 4))
    s = timer.summary()
    assert s["count"] == 32 and s["steps_per_record"] == 4
    assert s["total_s"] == pytest.approx(sum(r.cycle for r in records))


def test_batch_size_read_from_instrumented_dataset():
    x = np.random.rand(100, FEATURES).astype("float32")
    ds = instrument(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)).prefetch(2)
    timer = kg.StepTimer()
    tiny_model().fit(ds, epochs=2, verbose=0, callbacks=[timer])
    records = timer.records()
    assert [r.samples for r in records] == [16] * 6 + [4] + [16] * 6 + [4]
    s = timer.summary()
    assert s["samples_per_s"] * s["total_s"] == pytest.approx(200)
    assert all(r.input_wait is not None and r.input_wait >= 0 for r in records)
    assert [r.new_shape for r in records] == [True] + [False] * 5 + [True] + [False] * 7


def test_tensorboard_scalars_written(tmp_path):
    x = np.random.rand(64, FEATURES).astype("float32")
    tiny_model().fit(x, x[:, :1], batch_size=16, epochs=2, verbose=0,
                     callbacks=[kg.StepTimer(batch_size=16, log_dir=str(tmp_path))])
    tags = {}
    for path in glob.glob(str(tmp_path / "keras_gpufix" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    assert len(tags["step_timer/step_ms"]) == 8
    assert tags["step_timer/epoch_mean_ms"] == [3, 7]
    assert len(tags["step_timer/samples_per_s"]) == 2


@pytest.mark.parametrize("kwargs, name", [({"batch_size": 0}, "batch_size"),
                                          ({"warmup": -1}, "warmup")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        kg.StepTimer(**kwargs)


def test_instrumented_validation_set_is_not_taken_for_training():
    x = np.random.rand(40, FEATURES).astype("float32")
    train = instrument(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8))
    val_x = np.random.rand(200, FEATURES).astype("float32")
    val = instrument(tf.data.Dataset.from_tensor_slices((val_x, val_x[:, :1])).batch(5))
    timer = kg.StepTimer()
    tiny_model().fit(train, validation_data=val, epochs=2, verbose=0, callbacks=[timer])
    assert [r.samples for r in timer.records()] == [8] * 10
    assert {r.shape[0] for r in timer.records()} == {(8, FEATURES)}


class FakeCursor:
    """Stands in for InputCursor: one fixed batch shape, counts what is read."""

    instances = []

    def __init__(self):
        self.taken, self.calls = 0, 0
        self.probe = types.SimpleNamespace(shape_key=lambda row: ((8, FEATURES), (8, 1)),
                                           batch_size=lambda key: 8, frames_per_second=None)
        FakeCursor.instances.append(self)

    def start(self):
        pass

    def epoch_begin(self):
        pass

    def take(self, begins, ends, counts):
        self.calls += 1
        self.taken += int(sum(counts))
        return [0.001] * len(counts), [np.zeros(1)] * len(counts), [None] * len(counts)


def trio():
    return [kg.StepTimer(), kg.GPUOscillationMonitor(verbose=0, nvml=False),
            kg.RetracingMonitor(verbose=0)]


def drive_hooks(callbacks, steps, clock):
    """Fires fit's hooks for `steps` steps in epochs of 500, without fit."""
    callbacks.on_train_begin()
    for step in range(steps):
        if step % 500 == 0:
            callbacks.on_epoch_begin(step // 500)
        callbacks.on_train_batch_begin(step % 500)
        clock.advance(0.010 if step % 7 else 0.012)
        callbacks.on_train_batch_end(step % 500, {})
        clock.advance(0.001)
        if step % 500 == 499 or step == steps - 1:
            callbacks.on_epoch_end(step // 500)
    callbacks.on_train_end()


class Clock:
    def __init__(self):
        self.now, self.reads = 0.0, 0

    def advance(self, seconds):
        self.now += seconds

    def perf_counter(self):
        self.reads += 1
        return self.now

    def time(self):
        return 1.0e9


def test_the_trio_reads_the_clock_and_the_probe_once_per_hook(monkeypatch):
    import keras_gpufix.callbacks._clock as stream_module
    import keras_gpufix.data.input_probe as input_probe

    clock = Clock()
    monkeypatch.setattr(stream_module, "time", clock)
    monkeypatch.setattr(input_probe, "InputCursor", FakeCursor)
    FakeCursor.instances = []
    timer, monitor, retracing = callbacks = trio()
    drive_hooks(keras.callbacks.CallbackList(callbacks), 1200, clock)
    assert clock.reads == 2 * 1200 + 1  # begin + end of each step, and the stream's offset
    (cursor,) = FakeCursor.instances  # one probe reader for the three callbacks
    assert cursor.taken == 1200  # each step's batch read once
    assert cursor.calls < 1200 / 8  # in batches, not per hook
    assert timer.stream is monitor.stream is retracing.stream
    assert timer.summary()["count"] == 1200 and timer.summary()["input_wait"] > 0
    assert monitor.report()["step_time"]["count"] == 1200 - 5 - 2  # warmup, 2 epoch starts
    assert retracing.report()["steps"] == 1200 and retracing.report()["new_shapes"] == 1


def keras_gpufix_bytes(steps):
    clock = Clock()
    callbacks = keras.callbacks.CallbackList(trio())
    with mock.patch("keras_gpufix.callbacks._clock.time", clock):
        tracemalloc.start()
        drive_hooks(callbacks, steps, clock)
        snapshot = tracemalloc.take_snapshot()
        tracemalloc.stop()
    ours = snapshot.filter_traces([tracemalloc.Filter(True, "*keras_gpufix*")])
    return sum(stat.size for stat in ours.statistics("filename")), callbacks


def test_memory_does_not_grow_with_the_run():
    # 1,000 steps fill every ring (the step log's window is 96); 10,000 pass
    # every cap a per-step leak would stop at (MAX_PENDING 8192, MAX_OPEN 4096)
    short, _ = keras_gpufix_bytes(1000)
    long, callbacks = keras_gpufix_bytes(10000)
    print(f"keras_gpufix holds {short / 1024:.0f} KiB after 1,000 steps, "
          f"{long / 1024:.0f} KiB after 10,000")
    assert callbacks.callbacks[0].summary()["count"] == 10000
    assert long <= short * 1.05 + 16 * 1024


def test_a_run_that_ended_by_an_exception_does_not_capture_the_next(monkeypatch):
    import keras_gpufix.callbacks._clock as stream_module

    clock = Clock()
    monkeypatch.setattr(stream_module, "time", clock)
    crashed = kg.StepTimer()
    crashed.on_train_begin()
    crashed.on_train_batch_begin(0)
    crashed.on_train_batch_end(0, {})  # ... and fit raised: no on_train_end
    timer = kg.StepTimer()
    drive_hooks(keras.callbacks.CallbackList([timer]), 20, clock)
    assert timer.stream is not crashed.stream
    assert timer.summary()["count"] == 20
