"""StepShapes: the input shapes of every `fit` step, seen inside the train step.

Under `jit_compile=True` XLA compiles the step once per concrete input
shape, while Keras traces it once (`reduce_retracing=True`): trace counts
see nothing, the shapes show it. A dataset that went through
`kg.data.instrument` hands them over; a plain `tf.data` dataset does not.
So the step stream of the callbacks (and `kg.compile_model`, before its
sample steps trace the step `fit` reuses) puts a probe on the path of each
step inside `model.train_function` (`keras_internals.step_on_data_cell`),
before Keras first traces it: in the graph, next to the step and outside its XLA
cluster, it writes the shapes of the batch (the batch itself is neither
read nor changed) into a ring of `CAPACITY` rows in a host variable, with
a step counter. The stream reads the ring with its other measurements
(every quarter second and at epoch end: two variable reads), never per
step. One probe per train function: it stays in the traced graph (later
fits of the model reuse it), where it costs a few small host ops per step:
60-130 us on a loaded 2-core CPU host (`benchmarks/step_shapes_overhead.py`).

Under a `tf.distribute` strategy the batch is per replica: the shape of a
tensor is its first replica's with the rows of all replicas, i.e. the
shape of the batch the dataset made.
"""

import numpy as np

from keras_gpufix.keras_internals import plain_variable, step_on_data_cell, traced_functions

__all__ = ["StepShapes"]


class StepShapes:
    """Each train step's input shapes, written by a probe inside the step.

    Use `StepShapes.attach(model)` at `on_train_begin`, then `take(counts)`
    with the steps of each hook, in order.
    """

    # Rows of the ring: steps between two reads (the stream reads at least
    # every 1024 hooks; with steps_per_execution > 4 older rows are lost,
    # and their hooks have no shape).
    CAPACITY = 4096
    # Distinct shape keys remembered to tell a hook's new shape (bounded).
    MAX_KEYS = 4096

    def __init__(self, strategy):
        import tensorflow as tf

        self._strategy = strategy
        with tf.init_scope(), tf.device("/cpu:0"):
            self._count = plain_variable(tf.zeros((), tf.int64))
        self._ring = None
        self._layout = None  # per tensor of the batch: (rank, replicas)
        self._next = 0
        self._seen = set()
        self.error = None  # why the probe stopped recording (it never raises)

    @classmethod
    def attach(cls, model):
        """The probe of `model.train_function`, installed on first use.

        Returns:
            `(probe, note)`: the `StepShapes` to read (None when the shapes
            cannot be watched) and, when they cannot, why (None when there
            is nothing to say: no Keras train function). It never raises.
        """
        try:
            return cls._attach(model)
        except Exception as exc:  # a monitor must never stop training
            return None, f"the train step's input shapes cannot be watched: {exc!r}"

    @classmethod
    def _attach(cls, model):
        train_function = getattr(model, "train_function", None)
        if train_function is None:
            return None, None
        cell = step_on_data_cell(train_function)
        if cell is None:
            return None, ("model.train_function is not the one Keras 3 makes: its steps' "
                          "input shapes cannot be watched")
        probe = getattr(cell.cell_contents, "step_shapes", None)
        if probe is None:
            traced = traced_functions(train_function)
            if any(f.experimental_get_tracing_count() for f in traced.values()):
                return None, ("the train step was traced before keras_gpufix callbacks joined "
                              "(an earlier fit without them): its input shapes cannot be "
                              "watched in this fit")
            probe = cls(model.distribute_strategy)
            cell.cell_contents = probe._wrap(cell.cell_contents)
        probe._next = int(probe._count.numpy())  # steps of fits not watched are skipped
        return probe, None

    def _wrap(self, step):
        def probed_step(data):
            if self.error is None:
                try:
                    self._record(data)
                except Exception as exc:  # the probe must never stop training
                    self.error = f"the train step's input shapes cannot be watched: {exc!r}"
            return step(data)

        probed_step.step_shapes = self
        probed_step.__wrapped__ = step
        return probed_step

    def _record(self, data):
        """Writes the batch's shapes into the ring (graph or eager)."""
        import tensorflow as tf

        layout, shapes = [], []
        for value in tf.nest.flatten(data):
            parts = self._strategy.experimental_local_results(value)
            if not parts or not all(isinstance(p, tf.Tensor) and p.shape.rank is not None
                                    for p in parts):
                continue
            layout.append((parts[0].shape.rank, len(parts)))
            shapes.extend(parts)
        width = sum(rank * replicas for rank, replicas in layout)
        if self._ring is None and width:
            with tf.init_scope(), tf.device("/cpu:0"):
                self._ring = plain_variable(tf.fill((self.CAPACITY, width), -1))
            self._layout = layout
        # No device scope for the Shape ops: TensorFlow places a metadata op
        # with its input (on a GPU its output is in host memory), so no batch
        # is copied to read its shape. The rest is a few small host ops.
        dims = None
        if self._ring is not None and layout == self._layout:
            dims = [tf.shape(s, out_type=tf.int32) for s in shapes]
        with tf.device("/cpu:0"):
            count = self._count.assign_add(1)  # step k's row goes to (k + 1) % CAPACITY
            if self._ring is None:
                return
            # Another structure than the ring's: this step's shape is unknown.
            row = tf.fill((self._ring.shape[1],), -1) if dims is None else tf.concat(dims, 0)
            self._ring.scatter_update(tf.IndexedSlices(row[None], count[None] % self.CAPACITY))

    def take(self, counts):
        """The shape key of each hook, for hooks of `counts` steps each, in order.

        A hook's key is that of its first batch at a shape this probe had
        not seen, else of its last batch: `((B, T, F), (B, 1), ...)`, one
        tuple per tensor of rank >= 1, as `kg.data.instrument`'s. None for
        a hook whose rows were overwritten or never written (a step that
        did not run: the end of an epoch of unknown length).
        """
        total = int(self._count.numpy())
        first = max(self._next, total - self.CAPACITY)  # older rows are overwritten
        if total <= first or self._ring is None:
            self._next = total
            return [None] * len(counts)
        # One pass over the new rows: few distinct shapes, each converted once.
        ring = self._ring.numpy()
        rows = ring[np.arange(first + 1, total + 1) % self.CAPACITY]
        as_bytes = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1] * 4)))
        _, at, which = np.unique(as_bytes.ravel(), return_index=True, return_inverse=True)
        shape_keys = [self._key(rows[i]) for i in at]
        new_at = np.sort(np.array([i for i, k in zip(at, shape_keys)
                                   if k is not None and k not in self._seen], np.int64))
        if len(self._seen) < self.MAX_KEYS:
            self._seen.update(k for k in shape_keys if k is not None)
        counts = np.asarray(counts, np.int64)
        ends = self._next + np.cumsum(counts)
        lo = np.maximum(ends - counts - first, 0)  # each hook's rows, from `first`
        hi = np.minimum(ends, total) - first
        if len(new_at):  # the first new shape at or after each hook's first row
            new = new_at[np.minimum(np.searchsorted(new_at, lo), len(new_at) - 1)]
            has_new = (new >= lo) & (new < hi)
        else:
            new, has_new = lo, np.zeros(len(lo), bool)
        pick = which[np.clip(np.where(has_new, new, hi - 1), 0, len(which) - 1)]
        keys = [shape_keys[k] if ok else None for k, ok in zip(pick.tolist(), (hi > lo).tolist())]
        self._next = total
        return keys

    def _key(self, row):
        return None if np.any(row < 0) else self._to_key(row)

    def _to_key(self, row):
        out, pos = [], 0
        for rank, replicas in self._layout:
            parts = [row[pos + r * rank:pos + (r + 1) * rank] for r in range(replicas)]
            pos += rank * replicas
            if rank:
                out.append((int(sum(p[0] for p in parts)),) + tuple(int(d) for d in parts[0][1:]))
        return tuple(out)
