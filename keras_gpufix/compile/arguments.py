"""`compile_model`'s argument check, without TensorFlow or Keras: the
config's `compile` section is judged by it (`keras-gpufix validate` imports
neither)."""

import sys

from keras_gpufix.compile.hardware import POLICIES

__all__ = ["check_args"]


def check_args(jit_compile, mixed_precision, steps_per_execution, sample_batch) -> None:
    """`compile_model`'s argument check (also the config's `compile` section's).

    Raises:
        ValueError: naming the first invalid argument and its value.
    """
    if not isinstance(jit_compile, bool):
        raise ValueError(
            f"`jit_compile` must be True or False. Received: jit_compile={jit_compile!r}"
        )
    if mixed_precision not in ("auto", None) + POLICIES:
        raise ValueError(
            "`mixed_precision` must be 'auto', None or one of "
            f"{', '.join(repr(p) for p in POLICIES)}. "
            f"Received: mixed_precision={mixed_precision!r}"
        )
    if steps_per_execution != "auto" and not (
        isinstance(steps_per_execution, int)
        and not isinstance(steps_per_execution, bool)
        and steps_per_execution >= 1
    ):
        raise ValueError(
            "`steps_per_execution` must be 'auto' or an int >= 1. "
            f"Received: steps_per_execution={steps_per_execution!r}"
        )
    if sample_batch is not None and not (
        _is_dataset(sample_batch)
        or (isinstance(sample_batch, (tuple, list)) and len(sample_batch) in (2, 3))
    ):
        raise ValueError(
            "`sample_batch` must be (x, y), (x, y, sample_weight) or a "
            f"tf.data.Dataset. Received: sample_batch of type {type(sample_batch).__name__}"
        )


def _is_dataset(value) -> bool:
    """Whether `value` is a `tf.data.Dataset` (none can exist before TensorFlow is imported)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.data.Dataset)
