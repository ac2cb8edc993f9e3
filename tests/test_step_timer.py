import glob
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.data import instrument
from planted import FEATURES, tiny_model


def drive(timer, clock, steps):
    """Runs the hooks of one epoch of `steps` steps with a patched clock."""
    with mock.patch("keras_gpufix.callbacks.step_timer.time.perf_counter",
                    side_effect=clock):
        timer.on_train_begin()
        timer.on_epoch_begin(0)
        for i in range(steps):
            timer.on_train_batch_begin(i)
            timer.on_train_batch_end(i, {})
        timer.on_epoch_end(0)
        timer.on_train_end()


def test_patched_clock_gives_exact_figures():
    timer = kg.StepTimer(batch_size=32)
    # begin/end pairs: 10 ms, 20 ms, 30 ms, 40 ms
    drive(timer, [0.0, 0.010, 1.0, 1.020, 2.0, 2.030, 3.0, 3.040], 4)
    s = timer.summary()
    assert timer.durations == pytest.approx([0.010, 0.020, 0.030, 0.040])
    assert s["count"] == 4
    assert s["mean_ms"] == pytest.approx(25.0)
    assert s["max_ms"] == pytest.approx(40.0)
    assert s["samples_per_s"] == pytest.approx(4 * 32 / 0.1)
    assert s["steps_per_hook"] == 1


def test_warmup_steps_left_out_of_summary():
    timer = kg.StepTimer(warmup=1)
    drive(timer, [0.0, 5.0, 6.0, 6.010, 7.0, 7.010], 3)
    s = timer.summary()
    assert s["count"] == 2
    assert s["max_ms"] == pytest.approx(10.0)
    assert s["samples_per_s"] is None  # no batch size known


def test_steps_per_execution_divides_the_hook():
    model = tiny_model(steps_per_execution=4)
    x = np.random.rand(32 * 16, FEATURES).astype("float32")
    timer = kg.StepTimer()
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[timer])
    assert timer.counts == [4] * 8
    times, _ = timer.per_step()
    assert len(times) == 32
    assert timer.summary()["steps_per_hook"] == 4
    assert sum(times) == pytest.approx(sum(timer.durations))


def test_batch_size_read_from_instrumented_dataset():
    x = np.random.rand(100, FEATURES).astype("float32")
    ds = instrument(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)).prefetch(2)
    timer = kg.StepTimer()
    tiny_model().fit(ds, epochs=2, verbose=0, callbacks=[timer])
    assert timer.batch_sizes == [16] * 6 + [4] + [16] * 6 + [4]
    s = timer.summary()
    assert s["samples_per_s"] * s["total_s"] == pytest.approx(200)
    assert all(w is not None and w >= 0 for w in timer.input_waits)


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
    assert timer.batch_sizes == [8] * 10
    assert {s[0] for s in timer.shapes} == {(8, FEATURES)}
