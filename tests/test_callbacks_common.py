"""Every public callback: defaults, two fits, steps_per_execution, TensorBoard."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.data import instrument
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


@pytest.mark.parametrize("name", PUBLIC)
def test_two_fits_with_steps_per_execution_and_tensorboard(name, tmp_path):
    callback = make(name, tmp_path)
    model = tiny_model(steps_per_execution=3)
    tensorboard = keras.callbacks.TensorBoard(str(tmp_path / "tb"), profile_batch=0)
    for _ in range(2):
        history = model.fit(dataset(), epochs=2, verbose=0, callbacks=[callback, tensorboard])
        assert len(history.history["loss"]) == 2
    assert not getattr(callback, "errors", [])
    if hasattr(callback, "report"):
        assert isinstance(callback.report(), dict)
    if name == "StepTimer":  # state reset per fit: one fit's 2 x 16 hooks of 3 steps
        assert callback.counts == [3] * 32
