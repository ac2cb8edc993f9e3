"""Each function of keras_gpufix.keras_internals on the installed Keras/TensorFlow."""

import keras
import numpy as np
import tensorflow as tf

from keras_gpufix.keras_internals import cross_device_ops_name, traced_functions


def test_traced_functions_finds_keras_steps():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), epochs=1, verbose=0)
    found = traced_functions(model.train_function)
    assert "one_step_on_data" in found
    assert found["one_step_on_data"].experimental_get_tracing_count() >= 1


def test_traced_functions_covers_old_and_odd_train_functions():
    fn = tf.function(lambda x: x + 1)
    fn(tf.constant(1.0))
    assert list(traced_functions(fn).values()) == [fn]  # tf.keras style
    assert traced_functions(lambda it: None) == {}
    assert traced_functions(None) == {}


def test_cross_device_ops_name_of_a_mirrored_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert cross_device_ops_name(strategy).endswith("AllReduce")
    assert cross_device_ops_name(tf.distribute.get_strategy()) == "unknown"
