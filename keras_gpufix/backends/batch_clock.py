"""BatchClock: when each batch of `fit`'s data source was ready, and its shapes.

Keras 3 fetches a step's batch inside `train_function`, between the begin
and end hooks, so a slow `keras.utils.PyDataset`, Python generator or
array slicing shows as a slow step, never as input wait. The clock is told
when each batch becomes ready (`keras_internals.time_batches`):

- on JAX, torch and numpy the loop's thread takes each batch with `next()`
  from the epoch iterator (any source: arrays, PyDataset with or without
  workers, generators, a `tf.data` dataset read in Python): the batch is
  ready when `next()` returns;
- on TensorFlow a `tf.data` thread runs a PyDataset or a generator through
  `from_generator` (prefetched): the batch is ready when the Python source
  hands it over. Arrays and `tf.data` datasets have no Python producer
  there (a dataset through `kg.data.instrument` is measured inside
  `tf.data`, `data/input_probe.py`).

The step stream reads it like an `InputCursor` (`take`): the k-th batch
ready is the k-th batch a step takes (one source, in order), and a step
waited `max(0, ready - cycle start)`, as XProf counts input time. Each
batch also gives its shapes (`((B, T, F), (B, 1))`): on JAX a new shape
is a new XLA compile of the step.
"""

import threading
import time

import numpy as np

from keras_gpufix.keras_internals import data_source, time_batches

__all__ = ["BatchClock"]


def _shape_key(batch):
    """`((B, T, F), (B, 1), ...)`: the shapes of a batch's tensors of rank >= 1,
    in the order of its tuples, lists and dicts (a few us a batch)."""
    shapes = []
    _add_shapes(batch, shapes)
    return tuple(shapes)


def _add_shapes(value, shapes):
    if isinstance(value, (tuple, list)):
        for item in value:
            _add_shapes(item, shapes)
    elif isinstance(value, dict):
        for item in value.values():
            _add_shapes(item, shapes)
    else:
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape):
            shapes.append(tuple(-1 if d is None else int(d) for d in shape))


class BatchClock:
    """Ready times and shapes of the batches `fit` takes from its data source.

    Use `BatchClock.attach(backend, iterator)` in a callback's `on_train_begin`, then
    `take(begins, ends, counts)` per group of hooks, in order, and
    `detach()` at the end of training.

    Attributes:
        source: the kind of data source (`PyDataset`, `Generator`, `Array`, ...).
        workers: a PyDataset's workers when Keras runs it through its queue
            (its batches then arrive in bursts of `workers`), else None.
        probe: itself (the stream reads `shape_key`, `batch_size`,
            `frames_per_second` from the probe it follows).
    """

    # Batches between two reads (the stream reads at least every 1024 hooks).
    CAPACITY = 4096
    frames_per_second = None  # real frames are known only through kg.data

    def __init__(self, source, workers=None):
        self.source = source
        self.workers = workers
        self.probe = self
        self._lock = threading.Lock()
        self._ready = np.full(self.CAPACITY, np.nan)
        self._keys = [None] * self.CAPACITY
        self._count = 0
        self._next = 0
        self._restore = None

    @classmethod
    def attach(cls, backend, iterator):
        """The clock of the running `fit`'s data source, or None.

        None outside `fit` (a custom loop: `kg.watch` times `next()`
        itself), and on TensorFlow for sources without a Python producer
        (arrays, `tf.data`: `kg.data.instrument` measures those).

        Args:
            backend: the run's `backends.Backend`.
            iterator: `fit`'s epoch iterator (`keras_internals.
                fit_epoch_iterator()`), or None outside `fit`.
        """
        if iterator is None:
            return None
        clock = cls(*data_source(iterator))
        clock._restore = time_batches(iterator, clock.record,
                                      consumer=not backend.tensorflow_step)
        return clock if clock._restore is not None else None

    def record(self, batch):
        """Called when `batch` became ready (on whichever thread produced it)."""
        now = time.time()
        key = _shape_key(batch)
        with self._lock:
            slot = self._count % self.CAPACITY
            self._ready[slot] = now
            self._keys[slot] = key
            self._count += 1

    def detach(self):
        """Takes the wrappers out of Keras's data path (end of training)."""
        if self._restore is not None:
            self._restore()
            self._restore = None

    # -- what the stream reads (as from an InputCursor) ----------------------

    def start(self):
        pass

    def epoch_begin(self):
        pass

    def take(self, begins, ends, counts):
        """Per hook: input wait (s), shape key of its last batch, real frames (None).

        Args:
            begins: wall times (`time.time()`) each hook's cycle began (the
                previous step's end).
            ends: wall times each hook ended.
            counts: batches each hook took.

        Returns:
            Three lists, one item per hook; an item is None where a batch's
            record was overwritten (more than `CAPACITY` batches unread) or
            never made.
        """
        n = len(counts)
        counts = np.asarray(counts, np.int64)
        total = int(counts.sum())
        with self._lock:
            produced = self._count
            idx = np.arange(self._next, self._next + total)
            valid = (idx < produced) & (idx >= produced - self.CAPACITY)
            ready = np.where(valid, self._ready[idx % self.CAPACITY], np.nan)
            keys = [self._keys[i % self.CAPACITY] if ok else None
                    for i, ok in zip(idx.tolist(), valid.tolist())]
        self._next += total
        begins, ends = np.asarray(begins, np.float64), np.asarray(ends, np.float64)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        hook = np.repeat(np.arange(n), counts)
        per = (ends - begins) / np.maximum(counts, 1)
        # Batch k of a hook could not be taken before it was ready.
        lag = ready - (begins[hook] + per[hook] * (np.arange(total) - first))
        worst = np.full(n, -np.inf)
        with np.errstate(invalid="ignore"):
            np.maximum.at(worst, hook, lag)
        waits = np.clip(worst, 0.0, ends - begins)
        last = (np.cumsum(counts) - 1).tolist()
        missing = np.isnan(waits).tolist()
        return ([None if m else w for w, m in zip(waits.tolist(), missing)],
                [None if m else keys[i] for i, m in zip(last, missing)], [None] * n)

    # -- the probe's interface -------------------------------------------------

    @staticmethod
    def shape_key(row):
        """The shape key of a batch (already one)."""
        return row

    @staticmethod
    def batch_size(key):
        """The leading dimension of the first tensor of a shape key."""
        return key[0][0] if key and key[0] else None
