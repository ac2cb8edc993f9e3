"""Every reach into Keras's and TensorFlow's private structures, in one place.

keras_gpufix needs a few things Keras and TensorFlow offer no public way to
get: the `tf.function`s inside `model.train_function`, the graphs they traced,
and so on. Each is one small function here, checked on Keras 3.15.1 and
TensorFlow 2.21.0, with a test in `tests/test_keras_internals.py`. The rest of
the package calls these functions and never touches a private name itself, so
a Keras release that moves something breaks one function, not many.

A function that finds the structure changed returns its "unknown" value
(`None`, an empty dict) and the caller says "not verified"; it never guesses.
"""

import functools
import types
from collections import deque

__all__ = ["cross_device_ops_name", "traced_functions"]


def traced_functions(train_function, depth: int = 4) -> dict:
    """The `tf.function`s a Keras train function calls, by name.

    Keras 3 builds `model.train_function` as a Python closure around
    `tf.function`s (`multi_step_on_iterator`, `one_step_on_data`, the
    latter wrapped by `functools.wraps`); older Keras and `tf.keras` make
    it a `tf.function` itself. Closure cells, `__wrapped__`, `func` and
    `python_function` are followed up to `depth` levels; other objects
    (the model) are not entered. Checked on Keras 3.15.1, TensorFlow 2.21.0.

    Args:
        train_function: `model.train_function` (or any callable), or `None`.
        depth: how many links to follow from `train_function`. Defaults to 4.

    Returns:
        A dict name -> object with `experimental_get_tracing_count()`, in
        breadth-first order (empty when none is reachable).
    """
    found, seen = {}, set()
    queue = deque([(train_function, 0)])
    while queue:  # breadth first: each object is reached by its shortest path
        obj, level = queue.popleft()
        if obj is None or level > depth or id(obj) in seen:
            continue
        seen.add(id(obj))
        if callable(getattr(obj, "experimental_get_tracing_count", None)):
            name = getattr(obj, "__name__", None) or type(obj).__name__
            while name in found:
                name += "_"
            found[name] = obj
            queue.append((getattr(obj, "python_function", None), level + 1))
        elif isinstance(obj, functools.partial):
            queue.append((obj.func, level + 1))
        elif isinstance(obj, types.MethodType):
            queue.append((obj.__func__, level + 1))
        elif isinstance(obj, types.FunctionType):
            queue.append((getattr(obj, "__wrapped__", None), level + 1))
            for cell in obj.__closure__ or ():
                try:
                    queue.append((cell.cell_contents, level + 1))
                except ValueError:  # empty cell
                    pass
    return found


def cross_device_ops_name(strategy) -> str:
    """The all-reduce a `MirroredStrategy` chose, e.g. `"NcclAllReduce"`.

    TensorFlow picks it when the strategy is created (NCCL on GPUs where it
    has it, else hierarchical copy; `CollectiveAllReduce` on CPU devices) and
    only keeps it in `strategy.extended._cross_device_ops`. Checked on
    TensorFlow 2.21.0.

    Returns:
        The class name, or `"unknown"` when the attribute is gone.
    """
    ops = getattr(getattr(strategy, "extended", None), "_cross_device_ops", None)
    return type(ops).__name__ if ops is not None else "unknown"
