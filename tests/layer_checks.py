"""Shared checks for our Keras layers and `tf.data` functions (keras-hub style).

keras-hub's `TestCase.run_preprocessing_layer_test` checks every
preprocessing layer the same way; these helpers do that for ours, so each
test module asserts the same properties with one call:

- `check_layer(layer, inputs)`: the config round trip
  (`from_config(get_config())` gives the same config and the same
  outputs), a batch equals its examples one by one, and the layer gives the
  same outputs inside `tf.data` (`map`, batched and unbatched) as eagerly.
- `check_dataset_function(fn, examples)`: a per-example function gives the
  same outputs eagerly, in a `tf.function` with unknown input shapes and
  inside `Dataset.map`.
- `check_config_round_trip(config)`: a dataclass config survives
  `asdict` -> JSON -> constructor (the path of the YAML config and of the
  cache fingerprint).

Outputs are compared with `numpy.testing.assert_allclose(atol=atol)`.
"""

import dataclasses
import json

import keras
import numpy as np
import tensorflow as tf

__all__ = ["check_config_round_trip", "check_dataset_function", "check_layer"]


def _assert_close(actual, expected, atol, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(actual, expected, atol=atol, err_msg=what)


def check_layer(layer, inputs, atol=1e-5):
    """Config round trip, batched vs unbatched, and inside `tf.data`.

    Args:
        layer: a built or unbuilt Keras layer taking one batched tensor.
        inputs: a NumPy batch `(batch, ...)` of at least 2 examples.
        atol: tolerance of every comparison.

    Returns:
        The layer's output on `inputs` (NumPy), for further checks.
    """
    inputs = np.asarray(inputs)
    assert len(inputs) >= 2, "check_layer needs a batch of at least 2 examples"
    expected = keras.ops.convert_to_numpy(layer(inputs))

    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config(), "get_config() does not round-trip"
    _assert_close(clone(inputs), expected, atol, "from_config(get_config()) output")

    one_by_one = np.concatenate([keras.ops.convert_to_numpy(layer(inputs[i:i + 1])) for i in range(len(inputs))])
    _assert_close(one_by_one, expected, atol, "batch vs examples one by one")

    batched = tf.data.Dataset.from_tensor_slices(inputs).batch(2).map(layer)
    _assert_close(np.concatenate([x.numpy() for x in batched]), expected, atol,
                  "inside tf.data (batched)")
    unbatched = tf.data.Dataset.from_tensor_slices(inputs).map(lambda x: layer(x[None])[0])
    _assert_close(np.stack([x.numpy() for x in unbatched]), expected, atol,
                  "inside tf.data (unbatched)")
    return expected


def check_dataset_function(fn, examples, atol=1e-5):
    """The same outputs eagerly, in a `tf.function` and in `Dataset.map`.

    Args:
        fn: `tensor -> tensor or tuple of tensors`, one example at a time.
        examples: list of NumPy arrays of one dtype and rank (lengths may
            differ).
        atol: tolerance of every comparison.

    Returns:
        The eager outputs (list of NumPy values or tuples), for further checks.
    """
    def numpy(output):
        if isinstance(output, (tuple, list)):
            return tuple(np.asarray(o) for o in output)
        return np.asarray(output)

    def compare(actual, expected, what):
        actual = actual if isinstance(actual, tuple) else (actual,)
        expected = expected if isinstance(expected, tuple) else (expected,)
        assert len(actual) == len(expected), what
        for a, e in zip(actual, expected):
            _assert_close(a, e, atol, what)

    eager = [numpy(fn(tf.constant(x))) for x in examples]
    first = np.asarray(examples[0])
    spec = tf.TensorSpec([None] * first.ndim, tf.as_dtype(first.dtype))
    graph = tf.function(fn, input_signature=[spec], autograph=False)
    for x, expected in zip(examples, eager):
        compare(numpy(graph(tf.constant(x))), expected, "in a tf.function with unknown shape")
    dataset = tf.data.Dataset.from_generator(lambda: iter(examples),
                                             output_signature=spec).map(fn)
    for output, expected in zip(dataset, eager):
        compare(numpy(output), expected, "inside Dataset.map")
    return eager


def check_config_round_trip(config):
    """A dataclass config equals itself after `asdict` -> JSON -> constructor.

    Returns:
        The JSON text (what a fingerprint or a YAML file sees).
    """
    text = json.dumps(dataclasses.asdict(config), sort_keys=True)
    assert type(config)(**json.loads(text)) == config, f"{config!r} does not round-trip"
    return text
