"""Each stage of the script's `tf.data` pipeline: where it was built and how fast it runs.

While the script runs, `StageSites` wraps the public `tf.data.Dataset`
transformations and sources (`map`, `batch`, `from_tensor_slices`, ...)
and `tf.numpy_function` / `tf.py_function`. Each dataset the script itself
builds (the call comes from outside TensorFlow, Keras and keras_gpufix) is
recorded with:

| field        | what it is                                                |
|--------------|-----------------------------------------------------------|
| `op`         | the method called (`map`, `batch`, `from_tensor_slices`)  |
| `where`      | the script's line that called it (file:line)              |
| `function`   | file:line of the stage's own Python function: the function|
|              | a `numpy_function` / `py_function` inside the map wraps   |
|              | (not the lambda around it), else the map function itself |
| `python`     | the stage runs Python per element (a `numpy_function` or  |
|              | `py_function` traced in its function, `from_generator`)   |
| `parallel`   | `num_parallel_calls` as given (-1: AUTOTUNE)              |
| `batch_size` | `batch_size` as given                                     |

After a run judged `input_bound` (or whose what-if finds the input costing
time: `analysis.stages_needed`), `measure_stages` walks the pipeline from
the dataset given to `fit` (or iterated by the loop) back to its source
and drains a fresh iterator of each recorded prefix for a bounded time
(`SECONDS` in all; `drain_rate` pulls inside a `tf.function`, without
Python per element, and leaves each start-up out), so each stage's rate
is that of the pipeline up to and including it, in batches/s of the final
dataset, less what pulling an element costs by itself (an unbatched
prefix pays it per element; it is no stage's work). `analysis.judge_stages`
names the slow stage from these.
"""

import functools
import inspect
import sys
import time
import weakref

from keras_gpufix.diagnose.loop_patch import _library_prefixes, _where

__all__ = ["StageSites", "drain_rate", "measure_stages"]

SECONDS = 4.0  # budget of all the prefixes' drains together
STAGE_SECONDS = (0.3, 1.0)  # each prefix's drain: at least, at most
MAX_DEPTH = 64  # stages walked back from the final dataset
MAX_ELEMENTS = 1 << 16  # the most elements one drain reads
MIN_ELEMENT_S = 1e-9  # a stage's time per element once the pull's own is taken off

#: Dataset methods recorded: transformations, then the sources (static).
TRANSFORMS = ("map", "batch", "padded_batch", "ragged_batch", "filter", "flat_map",
              "interleave", "cache", "shuffle", "prefetch", "repeat", "take", "skip",
              "unbatch", "shard", "bucket_by_sequence_length", "group_by_window",
              "with_options", "concatenate")
SOURCES = ("from_tensor_slices", "from_tensors", "from_generator", "range", "list_files",
           "zip")
#: Stages whose elements per output element are not known from their arguments.
_UNKNOWN_RATIO = ("unbatch", "flat_map", "interleave", "bucket_by_sequence_length",
                  "group_by_window")
_UNRECORDED_RATIO = ("Batch", "FlatMap", "Interleave", "GroupBy", "Window", "Rebatch")


def _code_where(fn):
    """file:line of a callable's code (partials, wrappers and tf.functions unwrapped)."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "python_function"):
            fn = fn.python_function
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None),
                                                     "__code__", None)
    return code and f"{code.co_filename}:{code.co_firstlineno}"


def _as_int(value):
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


class StageSites:
    """Context manager: records where the script builds each `tf.data` stage.

    Example:

    >>> with StageSites() as sites:
    ...     ds = tf.data.Dataset.range(8).map(f)
    >>> sites.site_of(ds)["op"]
    'map'
    """

    def __init__(self):
        self._sites = {}
        self._building = []
        self._saved = []

    def site_of(self, dataset):
        """The recorded site of `dataset` (a dict, see the module), or None."""
        ref, site = self._sites.get(id(dataset), (None, None))
        return site if ref is not None and ref() is dataset else None

    def __enter__(self):
        import tensorflow as tf

        library = _library_prefixes()
        cls = tf.data.Dataset
        for name in TRANSFORMS + SOURCES:
            raw = cls.__dict__.get(name)
            if raw is None:
                continue
            static = isinstance(raw, staticmethod)
            wrapped = self._wrap(name, raw.__func__ if static else raw, library, tf)
            self._saved.append((cls, name, raw))
            setattr(cls, name, staticmethod(wrapped) if static else wrapped)
        for name in ("numpy_function", "py_function"):
            original = getattr(tf, name, None)
            if original is not None:
                self._saved.append((tf, name, original))
                setattr(tf, name, self._wrap_python(original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        return False

    def _wrap(self, name, original, library, tf):
        signature = inspect.signature(original)
        sites = self

        @functools.wraps(original)
        def method(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(library):
                return original(*args, **kwargs)
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                arguments = {}
            fn = next((arguments[k] for k in ("map_func", "predicate", "generator")
                       if callable(arguments.get(k))), None)
            site = {"op": name, "where": _where(caller), "function": fn and _code_where(fn),
                    "python": name == "from_generator",
                    "parallel": _as_int(arguments.get("num_parallel_calls")),
                    "batch_size": _as_int(arguments.get("batch_size"))}
            sites._building.append(site)
            try:
                result = original(*args, **kwargs)
            finally:
                sites._building.pop()
            if isinstance(result, tf.data.Dataset):
                sites._sites[id(result)] = (weakref.ref(result), site)
            return result

        return method

    def _wrap_python(self, original):
        sites = self

        @functools.wraps(original)
        def python_function(*args, **kwargs):
            fn = args[0] if args else kwargs.get("func")
            if sites._building and callable(fn):  # traced inside a stage's function
                sites._building[-1].update(python=True, function=_code_where(fn))
            return original(*args, **kwargs)

        return python_function


def drain_rate(dataset, seconds):
    """Elements/s a fresh iterator of `dataset` supplies, pulled inside a
    `tf.function` as `fit` pulls its batches (no Python per element, whose
    overhead would be charged to the first stages): after the first element
    (the start-up), n elements at a time, n doubled until a pull takes a
    third of `seconds` (or the dataset ends); the rate is the faster of the
    last two pulls (the larger ones: a host hiccup in one of them is not the
    stage's). None when the dataset has under two elements.
    """
    import tensorflow as tf

    # the iterator is an argument, not a capture: freed on return, so no
    # background thread (a prefetch calling a numpy_function) outlives the drain
    @tf.function(autograph=False)
    def pull(iterator, n):
        def more(i, has):
            return tf.logical_and(i < n, has)

        def one(i, has):
            has = iterator.get_next_as_optional().has_value()
            return i + tf.cast(has, tf.int64), has

        return tf.while_loop(more, one, (tf.constant(0, tf.int64), tf.constant(True)))[0]

    iterator = iter(dataset)
    try:
        if int(pull(iterator, tf.constant(1, tf.int64))) < 1:  # the start-up is not timed
            return None
        t0 = time.perf_counter()
        n, rates = 1, []
        while True:
            start = time.perf_counter()
            got = int(pull(iterator, tf.constant(n, tf.int64)))
            took = time.perf_counter() - start
            if got and took > 0:
                rates.append(got / took)
            if got < n or n >= MAX_ELEMENTS or (len(rates) >= 2 and (
                    took >= seconds / 3 or time.perf_counter() - t0 >= seconds)):
                return max(rates[-2:]) if rates else None
            n *= 2
    finally:
        del iterator


def _chain(dataset, seconds=STAGE_SECONDS[0]):
    """The pipeline from its source to `dataset`: one input per stage; at a stage with
    several inputs (`zip`, `concatenate`) the walk goes on into the slowest of them
    (each drained for `seconds`: the branch that holds the zip back, e.g. the audio
    map beside the text), so the zip itself is never taken for the slow source."""
    from keras_gpufix.keras_internals import input_datasets

    chain = [dataset]
    while len(chain) < MAX_DEPTH:
        inputs = input_datasets(chain[-1])
        if len(inputs) > 1:
            rates = [(drain_rate(d, seconds) or float("inf"), i) for i, d in enumerate(inputs)]
            inputs = [inputs[min(rates)[1]]]
        if len(inputs) != 1:
            break
        chain.append(inputs[0])
    return chain[::-1]


def _per_final(chain, index, sites):
    """Elements of `chain[index]` per element of the final dataset (None: unknown)."""
    ratio = 1
    for dataset in chain[index + 1:]:
        site = sites.site_of(dataset)
        if site is None:
            if any(part in type(dataset).__name__ for part in _UNRECORDED_RATIO):
                return None
            continue
        if site["op"] in _UNKNOWN_RATIO:
            return None
        if site["batch_size"] is not None and site["op"].endswith("batch"):
            ratio *= site["batch_size"]
    return ratio


def measure_stages(dataset, sites, seconds=SECONDS, budget=None):
    """Drains each recorded prefix of `dataset`'s pipeline; returns the stages.

    Args:
        dataset: the dataset given to `fit` or iterated by the loop.
        sites: the run's `StageSites`.
        seconds: the budget of all the drains together. Defaults to `SECONDS`.
        budget: None, or the run's what-if `Budget` (`what_if.py`): the
            drains share what is left of it, and a prefix reached once it
            is spent is left unmeasured (its `error` says so). Defaults to None.

    Returns:
        A dict `stages` (source first: the recorded site's fields, `op` the
        dataset's class name where none was recorded, and `stateful` (a
        map's function holds a stateful op: tf.data does not parallelize
        it by itself; None for other stages), `elements_per_s` (as
        drained), `per_batch` (elements per final batch), `batches_per_s`
        (the pull's own cost per element, `pull_ms`, taken off) and
        `pass_batches` (a map made on a `.repeat()`: final batches in one
        pass over its data, the repeat's input; else None); `error` where a
        prefix could not be drained), `cpus` (cores usable), `pull_ms` (what pulling one element
        of a `range` costs, drained the same way) and `seconds` (spent).
    """
    from keras_gpufix.compile.hardware import usable_cpus
    from keras_gpufix.keras_internals import map_function_stateful

    import tensorflow as tf

    t0 = time.perf_counter()
    if budget is not None:
        seconds = min(seconds, budget.left())
    chain = _chain(dataset)
    picked = [i for i, d in enumerate(chain)
              if i == 0 or d is dataset or sites.site_of(d) is not None]
    low, high = STAGE_SECONDS
    each = max(low, min(high, seconds / (len(picked) + 1)))
    # what pulling one element costs by itself (a range has no work): not a stage's
    pull_s = 1.0 / (drain_rate(tf.data.Dataset.range(MAX_ELEMENTS), low) or float("inf"))
    stages = []
    for index in picked:
        node = chain[index]
        site = sites.site_of(node) or {"op": type(node).__name__.strip("_"), "where": None,
                                       "function": None, "python": False, "parallel": None,
                                       "batch_size": None}
        stage = dict(site, stateful=map_function_stateful(node), elements_per_s=None,
                     per_batch=_per_final(chain, index, sites), batches_per_s=None,
                     pass_batches=None)
        if site["op"] == "map" and index >= 2 and stage["per_batch"] and (
                "Repeat" in type(chain[index - 1]).__name__):
            elements = int(chain[index - 2].cardinality())  # one pass, the repeat's input
            if elements > 0:
                stage["pass_batches"] = elements / stage["per_batch"]
        if budget is not None and budget.left() <= 0:
            budget.stop()
            stage["error"] = f"not measured: the what-if's {budget.cut}"
        else:
            try:
                stage["elements_per_s"] = drain_rate(node, each)
            except Exception as exc:  # a prefix that cannot run alone is left unmeasured
                stage["error"] = f"{type(exc).__name__}: {exc}"
        if stage["elements_per_s"] and stage["per_batch"]:
            element_s = max(1.0 / stage["elements_per_s"] - pull_s, MIN_ELEMENT_S)
            stage["batches_per_s"] = 1.0 / (element_s * stage["per_batch"])
        stages.append(stage)
    return {"stages": stages, "cpus": usable_cpus(), "pull_ms": 1000.0 * pull_s,
            "seconds": time.perf_counter() - t0}
