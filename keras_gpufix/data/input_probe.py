"""Live input readiness: make a dataset's production observable.

`instrument(dataset)` appends one sequential `map` that, for every element,
bumps a counter and records in ring buffers when the element became ready
and the shape of each of its tensors. The rings are `tf.lookup` tables, not
variables, so a dataset instrumented inside a `tf.distribute` strategy scope
does not get mirrored variables (which cannot be scatter-updated). It adds no
Python to the pipeline and leaves the elements unchanged.

The monitors read the rings every few steps (never per step) through an
`InputCursor`, which follows consumption: the element a step takes is the
next one after those taken by earlier steps. From that they know, per step:

- the input wait: `max(0, ready_time - step_begin)`: the step could not run
  before its batch existed (the same quantity XProf's input-pipeline
  analyzer reports as input time);
- the batch's shapes (the batch size for samples/s, and new shapes that
  cost an XLA recompile);
- when the dataset's maker said which tensor holds the feature lengths
  (`instrument(..., frames=, frames_per_second=)`; the `kg.data` builder
  does), the batch's real (unpadded) feature frames, hence the seconds of
  audio a step consumed (`real_frames_per_s`, `audio_seconds_per_s`).

Place it last before the final `prefetch` (or `prefetch_to_device`), after
any `tf.data` service `distribute`, so that the recorded order is the
consumption order. Every element also records its index within its iterator (0 for the
first element of a new iterator), so the cursor re-anchors at the first
step of an epoch: batches that the previous epoch's iterator had already
prefetched and that were discarded with it (a loop that stopped early, a
`break`) are skipped instead of shifting every later step by their count.
A dataset repeated after `instrument` restarts the index every pass; once
the cursor sees that inside an epoch it never re-anchors (one iterator goes
on, as `fit` with `steps_per_epoch` does). Not told apart: a pass exactly as
long as an epoch plus the batches prefetched at its end, before any pass
ended inside an epoch.
"""

import threading
import time
import weakref

import numpy as np
import tensorflow as tf

__all__ = ["instrument", "instrumented", "InputProbe", "InputCursor"]

_PROBES = weakref.WeakSet()
_LOCK = threading.Lock()


class InputProbe:
    """Counters and ring buffers written by an instrumented dataset.

    Args:
        element_spec: the dataset's `element_spec`.
        capacity: ring size in elements (batches). Defaults to 4096.
        frames: a function of one element returning its feature lengths
            (one integer per utterance, unpadded), or None to record no
            frames. Defaults to None.
        frames_per_second: feature frames per second of audio
            (`sample_rate / hop_length`), or None. Defaults to None.
    """

    def __init__(self, element_spec, capacity=4096, frames=None, frames_per_second=None):
        if capacity < 16:
            raise ValueError(f"`capacity` must be >= 16. Received: capacity={capacity}")
        if frames is not None and not callable(frames):
            raise ValueError("`frames` must be a function of one element returning its "
                             f"feature lengths. Received: frames={frames!r}")
        if frames_per_second is not None and (frames is None or not frames_per_second > 0):
            raise ValueError(
                "`frames_per_second` must be > 0 and given with `frames`. Received: "
                f"frames_per_second={frames_per_second!r}, frames={frames!r}")
        self.capacity = capacity
        self.element_spec = element_spec
        self.frames = frames
        self.frames_per_second = None if frames_per_second is None else float(frames_per_second)
        specs = tf.nest.flatten(element_spec)
        self.ranks = [
            s.shape.rank if isinstance(s, tf.TensorSpec) and s.shape.rank is not None else None
            for s in specs
        ]
        # A shape row holds every ranked tensor's dimensions, then (with
        # `frames`) the batch's real frames: one table, one read.
        width = max(1, sum(r for r in self.ranks if r)) + (frames is not None)
        table = tf.lookup.experimental.MutableHashTable
        with tf.init_scope():
            self._count = table(tf.int64, tf.int64, default_value=0)
            self._ready = table(tf.int64, tf.float64, default_value=np.nan)
            self._local = table(tf.int64, tf.int64, default_value=-1)
            self._shapes = table(tf.int64, tf.int32, default_value=tf.fill([width], -1))
            self._count_key = tf.constant([0], tf.int64)  # made once: produced() is frequent
        self._keys = {}
        with _LOCK:
            _PROBES.add(self)

    def stamp(self, local, element):
        """Records one element (runs inside `tf.data`); returns it unchanged.

        Args:
            local: the element's index within its iterator.
            element: the element.
        """
        dims = [
            tf.shape(t, out_type=tf.int32)
            for t, r in zip(tf.nest.flatten(element), self.ranks) if r
        ]
        shape = tf.concat(dims, 0) if dims else tf.zeros([1], tf.int32)
        if self.frames is not None:
            real = tf.reduce_sum(tf.cast(self.frames(element), tf.int64))
            shape = tf.concat([shape, tf.reshape(tf.cast(real, tf.int32), [1])], 0)
        zero = tf.constant([0], tf.int64)
        index = self._count.lookup(zero)  # the map is sequential: no race
        counted = self._count.insert(zero, index + 1)
        with tf.control_dependencies([counted]):
            now = tf.timestamp()
        slot = index % self.capacity
        ready = self._ready.insert(slot, tf.reshape(now, [1]))
        shapes = self._shapes.insert(slot, tf.reshape(shape, [1, -1]))
        first = self._local.insert(slot, tf.reshape(local, [1]))
        with tf.control_dependencies([ready, shapes, first]):
            return tf.nest.map_structure(tf.identity, element)

    def produced(self):
        """Number of elements produced so far."""
        return int(self._count.lookup(self._count_key).numpy()[0])

    def read(self, start, stop, produced=None):
        """Ready times, shape rows and real frames of elements [start, stop).

        Args:
            start, stop: element indices.
            produced: `produced()`, when the caller has just read it (one
                read for several calls). Defaults to None (read here).

        Returns:
            `(ready, shapes, frames)`: ready times (s, epoch), shape rows,
            and each element's real (unpadded) feature frames, or None
            when this probe records no frames. Elements already
            overwritten in the ring or not yet produced come back as NaN
            times, -1 shapes and -1 frames.
        """
        if produced is None:
            produced = self.produced()
        idx = np.arange(start, stop)
        valid = (idx >= max(0, produced - self.capacity)) & (idx < produced)
        slots = tf.constant(idx % self.capacity, tf.int64)
        ready = self._ready.lookup(slots).numpy()
        shapes = self._shapes.lookup(slots).numpy().reshape(len(idx), -1)
        ready = np.where(valid, ready, np.nan)
        shapes = np.where(valid[:, None], shapes, -1)
        if self.frames is None:
            return ready, shapes, None
        return ready, shapes[:, :-1], shapes[:, -1].astype(np.int64)

    def iterator_starts(self, start, stop, produced=None):
        """Indices in [start, stop) of elements that began a new iterator.

        `produced` as in `read`.
        """
        if produced is None:
            produced = self.produced()
        idx = np.arange(max(start, produced - self.capacity), min(stop, produced))
        if not len(idx):
            return idx
        local = self._local.lookup(tf.constant(idx % self.capacity, tf.int64)).numpy()
        return idx[local == 0]

    def shape_key(self, row):
        """A hashable, readable form of one shape row: ((B, T), (B,), ...)."""
        raw = row.tobytes()
        key = self._keys.get(raw)
        if key is None:  # few distinct shapes: each is converted once
            out, pos = [], 0
            for rank in self.ranks:
                if rank:
                    out.append(tuple(int(d) for d in row[pos:pos + rank]))
                    pos += rank
            key = self._keys[raw] = tuple(out)
        return key

    @staticmethod
    def batch_size(key):
        """The leading dimension of the first tensor of a shape key."""
        return key[0][0] if key and key[0] else None

    @staticmethod
    def all():
        with _LOCK:
            return list(_PROBES)


def instrument(dataset, capacity=4096, frames=None, frames_per_second=None):
    """Returns `dataset` with its production observable by the monitors.

    Args:
        dataset: a `tf.data.Dataset` (batched: each element is one step's
            input).
        capacity: ring size in batches. Defaults to 4096.
        frames: a function of one element (the structure as one argument)
            returning the batch's unpadded feature lengths, e.g.
            `lambda batch: batch[1][1]` for `((ids, ids_len), (mel,
            mel_len))`. The monitors then report `real_frames_per_s`.
            Defaults to None (no frames recorded: those figures are None).
        frames_per_second: feature frames per second of audio
            (`AudioConfig.frames_per_second`, i.e. `sample_rate /
            hop_length`); with `frames`, the monitors also report
            `audio_seconds_per_s`. Defaults to None.

    Returns:
        A `tf.data.Dataset` with the same elements; `dataset.input_probe`
        is its `InputProbe`.

    Example:

    >>> ds = kg.data.instrument(ds.batch(32)).prefetch(tf.data.AUTOTUNE)
    >>> model.fit(ds, callbacks=[kg.GPUOscillationMonitor()])
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            f"`dataset` must be a tf.data.Dataset. Received: {type(dataset).__name__}"
        )
    probe = InputProbe(dataset.element_spec, capacity=capacity, frames=frames,
                       frames_per_second=frames_per_second)

    @tf.autograph.experimental.do_not_convert
    def _stamp(local, element):
        return probe.stamp(local, element)

    # enumerate() counts per iterator; the map is sequential, so the
    # recorded order is the consumption order.
    out = dataset.enumerate().map(_stamp)
    out.input_probe = probe
    return out


def instrumented(dataset, depth=64) -> bool:
    """Whether `dataset` or one of its inputs (any branch) went through `instrument`."""
    from keras_gpufix.keras_internals import input_datasets

    todo = [dataset]
    for _ in range(depth):
        if not todo:
            return False
        current = todo.pop(0)
        if getattr(current, "input_probe", None) is not None:
            return True
        todo.extend(input_datasets(current))
    return False


class InputCursor:
    """Follows consumption of the instrumented dataset `fit` is reading.

    At `start()` it snapshots every live probe; at the first `take` it picks
    the probe whose production advanced most since (the training dataset,
    not a validation one). `take(hooks)` maps steps to elements.
    """

    def __init__(self):
        self.probe = None
        self._baseline = {}
        self._next = 0
        self._anchor = None
        self._repeats = False
        self._epoch_first = 0

    def start(self):
        self.probe = None
        self._anchor = None
        self._repeats = False
        self._baseline = {id(p): (p, p.produced()) for p in InputProbe.all()}

    def epoch_begin(self):
        self._anchor = time.time()

    def _reanchor(self):
        """At an epoch's first read: skip what a discarded iterator prefetched.

        A new iterator's first element (index 0) is made after the epoch
        began, and a discarded iterator's batches before it. So the cursor
        moves to the first start made after the epoch began when every
        batch before it was made earlier. It never moves once a start was
        seen inside an epoch: the dataset is repeated after `instrument`
        (every pass restarts the index), and `fit` goes on with one
        iterator (`steps_per_epoch`).
        """
        began, self._anchor = self._anchor, None
        if not self._repeats:
            produced = self.probe.produced()
            starts = self.probe.iterator_starts(self._next, produced, produced)
            if len(starts):
                ready = self.probe.read(self._next, produced, produced)[0]
                made = np.nonzero(ready >= began)[0]
                if len(made) and self._next + made[0] in starts:
                    self._next += int(made[0])
        self._epoch_first = self._next

    def _pick(self):
        best, advance = None, 0
        for probe in InputProbe.all():
            before = self._baseline.get(id(probe), (probe, 0))[1]
            gained = probe.produced() - before
            if gained > advance:
                best, advance = probe, gained
        if best is not None:
            self.probe = best
            self._next = self._baseline.get(id(best), (best, 0))[1]
        return best

    def take(self, begins, ends, counts):
        """Per hook: input wait (s), last shape row, real frames (each or None).

        Args:
            begins, ends: wall times (`time.time()`) of each hook's begin/end.
            counts: steps (batches) each hook consumed.

        Returns:
            Three lists, one item per hook: the input wait in seconds, the
            shape row of the hook's last batch, and the real (unpadded)
            feature frames of all its batches. An item is None where an
            element could not be read (overwritten in the ring), and the
            frames are None where the probe records none.
        """
        n = len(counts)
        if self.probe is None and self._pick() is None:
            return [None] * n, [None] * n, [None] * n
        if self._anchor is not None:
            self._reanchor()
        total = int(sum(counts))
        produced = self.probe.produced()
        if not self._repeats:
            inside = self.probe.iterator_starts(self._next, self._next + total, produced)
            self._repeats = bool(np.any(inside != self._epoch_first))
        ready, shapes, frames = self.probe.read(self._next, self._next + total, produced)
        self._next += total
        begins, ends = np.asarray(begins, np.float64), np.asarray(ends, np.float64)
        counts = np.asarray(counts, np.int64)
        first = np.repeat(np.cumsum(counts) - counts, counts)  # each element's hook start
        hook = np.repeat(np.arange(n), counts)
        per = (ends - begins) / counts
        # Step k of a hook cannot start before its element is ready.
        lag = ready - (begins[hook] + per[hook] * (np.arange(total) - first))
        worst = np.full(n, -np.inf)
        with np.errstate(invalid="ignore"):
            np.maximum.at(worst, hook, lag)  # NaN (element not readable) propagates
        waits = np.clip(worst, 0.0, ends - begins)
        last = np.cumsum(counts) - 1
        missing = np.isnan(waits)
        real = [None] * n
        if frames is not None:
            starts = last - counts + 1
            unread = np.add.reduceat(frames < 0, starts) > 0
            sums = np.add.reduceat(frames, starts)
            real = [None if u else f for f, u in zip(sums.tolist(), (unread | missing).tolist())]
        # Python lists (tolist) make the per-hook loops cheap.
        missing = missing.tolist()
        return ([None if m else w for w, m in zip(waits.tolist(), missing)],
                [None if m else shapes[i] for i, m in zip(last.tolist(), missing)], real)
