"""Custom JAX loops: the script's `jax.jit` functions, and which of them trains.

On the JAX backend a custom loop's step is a `jax.jit` function. While the
script runs, `jax.jit` is wrapped: a function the script jits (not Keras's
own, nor a library's) becomes a `Jitted`, which calls the compiled function
unchanged and tells `LoopPatch.jit_call` about each call. A function trains
when an array its first call returned is an argument of its second
(`fed_back`): its updated parameters or optimizer state, as
`params, opt_state, loss = step(params, opt_state, batch)` hands them on.
An evaluation step (a loss, logits) or a jitted augmentation does not; nor
does a function that returns gradients applied outside it (its outputs
never come back).

What the what-if and the input's stages do on TensorFlow needs `tf.function`
and `tf.data`: on another backend the report says what was measured instead
(`WHAT_IF_ELSEWHERE`, `STAGES_ELSEWHERE`). A `fit` over a `PyDataset` gets
the what-if with the step as measured in the run (`method` `in_run`) and
the input drained alone (`Drained`: its batches made by as many threads as
the `PyDataset` has `workers`, a queue of `max_queue_size`, as `fit` makes
them).
"""

import functools
from collections import deque

__all__ = ["Drained", "Jitted", "STAGES_ELSEWHERE", "WHAT_IF_ELSEWHERE", "arrays", "batch_of",
           "fed_back", "patch_jit", "signatures"]

WHAT_IF_ELSEWHERE = ("on the {} backend with this input: it replays the step as a tf.function; "
                     "the gain given is the run's own input-wait share")
STAGES_ELSEWHERE = ("not measured on the {} backend: the input's stages by file:line are "
                    "tf.data's; the input wait was timed at each next() of the run's input")


def arrays(tree):
    """The JAX arrays in `tree` (a list)."""
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, jax.Array)]


def signatures(tree):
    """(shape, dtype) of each JAX array in `tree`."""
    return [(tuple(leaf.shape), str(leaf.dtype)) for leaf in arrays(tree)]


def fed_back(outputs, args, kwargs) -> bool:
    """Whether a jitted function trains: one of the arrays its previous call
    returned (`outputs`, kept alive until now) is an argument of this call,
    as updated parameters or optimizer state are (`params, loss = step(params,
    x)`). A function that transforms its input (a jitted augmentation, an
    evaluation step) gets a new batch each call, never its own output."""
    returned = {id(a) for a in outputs}
    return any(id(a) in returned for a in arrays((args, kwargs)))


def batch_of(args, kwargs, updated):
    """The arrays (JAX or NumPy) of a train step's call whose (shape, dtype) is
    not in `updated` (the signatures its last call returned): its batch, what
    `kg.watch` reads the batch size and the shapes from."""
    import jax
    import numpy as np

    return [leaf for leaf in jax.tree_util.tree_leaves((args, kwargs))
            if isinstance(leaf, (jax.Array, np.ndarray))
            and (tuple(leaf.shape), str(leaf.dtype)) not in updated]


class Jitted:
    """A `jax.jit` function of the script: calls go through `on_call(self, args, kwargs)`.

    Attributes (`lower`, `trace`, `__wrapped__`, ...) are the jitted function's.
    """

    def __init__(self, jitted, on_call):
        self.jitted = jitted
        self._on_call = on_call
        functools.update_wrapper(self, jitted, updated=())

    def __call__(self, *args, **kwargs):
        return self._on_call(self, args, kwargs)

    def __get__(self, obj, objtype=None):  # a jitted method
        return self if obj is None else functools.partial(self, obj)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def patch_jit(on_call, is_library_frame):
    """Wraps `jax.jit` so that the functions the script jits are `Jitted`; returns
    the function that undoes it. `is_library_frame(frame)`: the caller is a
    library (Keras, JAX, ours), whose functions are left alone."""
    import sys

    import jax

    original = jax.jit

    @functools.wraps(original)
    def jit(fun=None, *args, **kwargs):
        if fun is None:  # jax.jit(static_argnums=...) used as a decorator factory
            return lambda f: jit(f, *args, **kwargs)
        jitted = original(fun, *args, **kwargs)
        if is_library_frame(sys._getframe(1)):
            return jitted
        return Jitted(jitted, on_call)

    jax.jit = jit

    def undo():
        jax.jit = original

    return undo


class Drained:
    """The batches of a `keras.utils.PyDataset`, in order, made by `workers`
    threads with at most `max_queue_size` ahead (its own settings; processes
    are drained as threads), for `what_if.input_rate`."""

    def __init__(self, py_dataset):
        self.py_dataset = py_dataset

    def __iter__(self):
        from concurrent.futures import ThreadPoolExecutor

        ds = self.py_dataset
        count = ds.num_batches
        workers = max(1, int(getattr(ds, "workers", 1) or 1))
        ahead = max(workers, int(getattr(ds, "max_queue_size", 10) or 10))
        with ThreadPoolExecutor(workers, thread_name_prefix="keras-gpufix-drain") as pool:
            pending, index = deque(), 0
            try:
                while True:
                    while (count is None or index < count) and len(pending) < ahead:
                        pending.append(pool.submit(ds.__getitem__, index))
                        index += 1
                    if not pending:
                        return
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()
