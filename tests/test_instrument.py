import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix.data import instrument
from planted import FEATURES, tiny_model


def batches(n=10, batch=4):
    x = np.arange(n * batch * FEATURES, dtype=np.float32).reshape(n * batch, FEATURES)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(batch)


def test_elements_unchanged_and_recorded_in_order():
    ds = instrument(batches(), capacity=16)
    plain = [a.numpy() for a, _ in batches()]
    got = [a.numpy() for a, _ in ds]
    assert all(np.array_equal(p, g) for p, g in zip(plain, got))
    probe = ds.input_probe
    assert probe.produced() == 10
    ready, shapes = probe.read(0, 10)
    assert np.all(np.diff(ready) >= 0)
    assert probe.shape_key(shapes[0]) == ((4, FEATURES), (4, 1))
    assert probe.batch_size(probe.shape_key(shapes[0])) == 4


def test_ring_reports_overwritten_and_future_elements_as_missing():
    ds = instrument(batches(n=20), capacity=16)
    for _ in ds:
        pass
    ready, shapes = ds.input_probe.read(0, 22)
    assert np.isnan(ready[:4]).all() and (shapes[:4] == -1).all()  # overwritten
    assert np.isfinite(ready[4:20]).all()
    assert np.isnan(ready[20:]).all()  # not produced yet


def test_instrumented_inside_a_strategy_scope():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        ds = instrument(batches())
        model = tiny_model()
    model.fit(ds.prefetch(2), epochs=1, verbose=0)
    assert ds.input_probe.produced() >= 10


def test_rejects_non_datasets():
    with pytest.raises(ValueError, match="`dataset` must be a tf.data.Dataset"):
        instrument([1, 2, 3])


def test_public_name_is_the_function_after_the_builder_loaded():
    import keras_gpufix as kg
    import keras_gpufix.data.builder  # noqa: F401  imports the probe module

    assert callable(kg.data.instrument) and kg.data.instrument is instrument
