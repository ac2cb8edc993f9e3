"""Length bucketing with a bounded number of batch shapes.

Under XLA every new input shape is a compile (seconds on CPU, more on GPU),
so a loader that pads each batch to its longest clip, or leaves the text
length free, recompiles on almost every step. `BucketPlan` fixes the shapes
before the first epoch, from the lengths the corpus scan measured:

- buckets are runs of the utterances sorted by frames, chosen by dynamic
  programming to minimise the padded frames of an epoch
  (`padding_buckets`): without `batch_frames` every bucket but the first
  holds whole batches (the first also the one partial batch), so no
  leftover is padded to a longer bucket; every batch is padded to its
  bucket's boundary, the longest clip of the bucket
  (`pad_to_bucket_boundary`). On 600 clips of 1-10 s (log-normal), batch
  16, 8 buckets: 0.907 real frames where equal-count (quantile) buckets
  gave 0.879, 9 batch shapes each (`benchmarks/padding.py`);
- the text dimension is padded per bucket too, to the longest transcript of
  that bucket or any shorter one (so it never grows across buckets);
- each bucket's batch size is `batch_size`, or with `batch_frames` (an
  audio budget, as NeMo/Lhotse's `batch_duration`) `batch_frames //
  boundary` (at most `batch_size` when given), optionally rounded down to a
  multiple of `batch_multiple`: short buckets carry as many padded frames
  as long ones, so memory per step is flat and short clips come in larger
  batches;
- the leftovers of every bucket (fewer than a batch) are regrouped from the
  longest down into full batches of the bucket shape of their longest
  member, so only the very last group can be a partial batch.

So one epoch has at most `num_buckets` distinct `(batch, text, frames)`
shapes, plus one for the partial batch unless `drop_remainder`. The layout
is fixed by the lengths; each epoch draws which utterances of a bucket go
together and the order of the batches.
"""

import numpy as np
import tensorflow as tf

from keras_gpufix.data.checks import check_batching

__all__ = ["BucketPlan", "padding_buckets", "MAX_CUTS"]

# Most cut positions the bucket search considers (its cost grows with their square).
MAX_CUTS = 2048


def _argsort(values):
    return tf.cast(tf.argsort(values, stable=True), tf.int64)


def padding_buckets(lengths, num_buckets: int, step: int = 1):
    """Buckets of sorted lengths that minimise the padded total.

    The utterances, sorted by length, are cut into at most `num_buckets`
    runs; each is padded to its longest member, and the cuts minimise
    `sum(run size * run max)` (exact dynamic programming over the allowed
    cut positions; beyond `MAX_CUTS` of them, over `MAX_CUTS` evenly spaced
    ones, so a million utterances take about a second). With `step > 1` every run but the first holds a
    multiple of `step` utterances (whole batches; the first holds the
    remainder too); with `step == 1` cuts go only between different
    lengths.

    Args:
        lengths: length of each utterance.
        num_buckets: most buckets.
        step: run sizes are multiples of this (the batch size).
            Defaults to 1.

    Returns:
        `(boundaries, bucket_of)`: int64 ascending padded lengths, and the
        bucket of each utterance.
    """
    lengths = np.asarray(lengths, np.int64)
    if num_buckets < 1:
        raise ValueError(f"`num_buckets` must be >= 1. Received: num_buckets={num_buckets}")
    if lengths.size == 0:
        raise ValueError("`lengths` must not be empty: there is no utterance to bucket.")
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order]
    total = np.concatenate([[0], np.cumsum(ordered)])
    n = len(ordered)
    if step > 1:
        cuts = np.arange(n % step or step, n, step)
    else:
        cuts = np.flatnonzero(np.diff(ordered)) + 1
    if len(cuts) > MAX_CUTS:  # the search is quadratic in the cut positions
        cuts = np.unique(cuts[np.linspace(0, len(cuts) - 1, MAX_CUTS).round().astype(np.int64)])
    points = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    atoms = len(points) - 1
    count = min(num_buckets, atoms)
    best = np.full(atoms + 1, np.inf)
    best[0] = 0.0
    choices = []
    for _ in range(count):
        new, choice = np.full(atoms + 1, np.inf), np.zeros(atoms + 1, np.int64)
        for end in range(1, atoms + 1):
            start = points[:end]
            cost = best[:end] + (points[end] - start) * ordered[points[end] - 1] - (
                total[points[end]] - total[start])
            choice[end] = np.argmin(cost)
            new[end] = cost[choice[end]]
        choices.append(choice)
        best = new
    ends, end = [], atoms
    for choice in reversed(choices):
        ends.append(points[end])
        end = choice[end]
        if end == 0:
            break
    ends = np.array(ends[::-1])
    run_of = np.searchsorted(ends, np.arange(n), side="right")
    boundaries, run_bucket = np.unique(ordered[ends - 1], return_inverse=True)
    bucket_of = np.empty(n, np.int64)
    bucket_of[order] = run_bucket[run_of]
    return boundaries.astype(np.int64), bucket_of


class BucketPlan:
    """Which utterances are batched together, and to which padded shape.

    Args:
        frames: frames of each utterance's features.
        text_lengths: ids in each utterance's transcript.
        batch_size: utterances per batch; with `batch_frames` the most
            (None: no cap).
        num_buckets: number of length buckets. Defaults to 8.
        batch_frames: padded frames per batch; each bucket's batch size is
            `batch_frames // boundary` (capped by `batch_size`), so
            `batch size x boundary <= batch_frames` for every batch.
            Defaults to None (every bucket uses `batch_size`).
        drop_remainder: leave out the one partial batch. Defaults to False.
        batch_multiple: with `batch_frames`, round each bucket's batch size
            down to a multiple of this (e.g. 8 for GPU kernels, or the
            number of replicas) where one fits the budget. Defaults to None.

    Raises:
        ValueError: for invalid arguments, and when the longest utterance
            alone has more than `batch_frames` frames.

    Attributes:
        boundaries: padded frames of each bucket (ascending).
        text_boundaries: padded text length of each bucket.
        bucket_sizes: batch size of each bucket.
        bucket_of: bucket of each utterance.
        num_batches: batches per epoch.
        padding_efficiency: real / padded frames over an epoch.
        text_padding_efficiency: real / padded text ids over an epoch.
        shapes: the set of `(batch, text, frames)` shapes of an epoch.
    """

    def __init__(self, frames, text_lengths, batch_size=None, num_buckets=8,
                 batch_frames=None, drop_remainder=False, batch_multiple=None):
        check_batching(batch_size, batch_frames, batch_multiple)
        self.frames = np.asarray(frames, np.int64)
        self.text_lengths = np.asarray(text_lengths, np.int64)
        if batch_frames is not None and self.frames.max() > batch_frames:
            raise ValueError(
                f"`batch_frames` must hold the longest utterance ({self.frames.max()} frames). "
                f"Received: batch_frames={batch_frames}. Raise it, or cap the clips with "
                'AudioConfig(max_seconds=..., on_too_long="crop")'
            )
        self.boundaries, self.bucket_of = padding_buckets(
            self.frames, num_buckets, batch_size if batch_frames is None else 1)
        text_max = np.zeros(len(self.boundaries), np.int64)
        np.maximum.at(text_max, self.bucket_of, self.text_lengths)
        self.text_boundaries = np.maximum(np.maximum.accumulate(text_max), 1)
        if batch_frames is None:
            sizes = np.full(len(self.boundaries), batch_size)
        else:
            sizes = batch_frames // self.boundaries
            if batch_size is not None:
                sizes = np.minimum(sizes, batch_size)
            if batch_multiple is not None:
                sizes = np.where(sizes >= batch_multiple, sizes // batch_multiple * batch_multiple,
                                 sizes)
        self.bucket_sizes = sizes.astype(np.int64)
        self._layout(drop_remainder)

    def _layout(self, drop_remainder):
        """Batches as slot lists; slot `s` is the s-th utterance in bucket order."""
        counts = np.bincount(self.bucket_of, minlength=len(self.boundaries))
        slot_bucket = np.repeat(np.arange(len(counts)), counts)
        batches, leftovers, start = [], [], 0
        for bucket, count in enumerate(counts):
            size = self.bucket_sizes[bucket]
            full = count // size
            for j in range(full):
                batches.append((np.arange(start + j * size, start + (j + 1) * size), bucket))
            leftovers.extend(range(start + full * size, start + count))
            start += count
        while leftovers:
            bucket = slot_bucket[leftovers[-1]]
            size = self.bucket_sizes[bucket]
            if len(leftovers) < size and drop_remainder:
                break
            batches.append((np.array(leftovers[-size:]), bucket))
            leftovers = leftovers[:-size]
        self.batch_slots = [slots for slots, _ in batches]
        self.batch_buckets = np.array([bucket for _, bucket in batches], np.int64)
        self.num_batches = len(batches)
        sizes = np.array([len(slots) for slots in self.batch_slots], np.int64)
        self.max_batch = int(sizes.max()) if len(sizes) else 0
        self.shapes = {
            (int(n), int(self.text_boundaries[b]), int(self.boundaries[b]))
            for n, b in zip(sizes, self.batch_buckets)
        }
        used = np.concatenate(self.batch_slots) if batches else np.zeros(0, np.int64)
        order = np.argsort(self.bucket_of, kind="stable")
        real = self.frames[order][used].sum()
        padded = (sizes * self.boundaries[self.batch_buckets]).sum()
        self.padding_efficiency = float(real / padded) if padded else 0.0
        real_text = self.text_lengths[order][used].sum()
        padded_text = (sizes * self.text_boundaries[self.batch_buckets]).sum()
        self.text_padding_efficiency = float(real_text / padded_text) if padded_text else 0.0

    def _element_vectors(self, slot_to_utt, batch_order):
        """Per-element `(utterance, key, pad_frames, pad_text)` in batch order.

        `key` identifies the batch within the epoch and carries its size:
        `ordinal * (max_batch + 1) + size`.
        """
        slots = tf.RaggedTensor.from_row_lengths(
            np.concatenate(self.batch_slots), [len(s) for s in self.batch_slots]
        )
        slots = tf.gather(slots, batch_order)
        sizes = slots.row_lengths()
        utterances = tf.gather(slot_to_utt, slots.flat_values)
        ordinal = tf.range(tf.size(sizes, out_type=tf.int64), dtype=tf.int64)
        keys = tf.repeat(ordinal * (self.max_batch + 1) + sizes, sizes)
        buckets = tf.repeat(tf.gather(self.batch_buckets, batch_order), sizes)
        return (
            utterances,
            keys,
            tf.gather(self.boundaries, buckets),
            tf.gather(self.text_boundaries, buckets),
        )

    def _slot_to_utt(self, seed):
        utterances = tf.range(len(self.frames), dtype=tf.int64)
        if seed is not None:
            noise = tf.random.stateless_uniform([len(self.frames)], seed)
            utterances = _argsort(noise)
        buckets = tf.gather(self.bucket_of, utterances)
        return tf.gather(utterances, _argsort(buckets))

    def epoch_dataset(self, shuffle=True, seed=None) -> tf.data.Dataset:
        """One epoch of `(utterance, key, pad_frames, pad_text)` elements.

        With `shuffle`, each iteration draws new bucket members and a new
        batch order (deterministic per iteration when `seed` is set).
        """
        if not shuffle:
            order = tf.range(self.num_batches, dtype=tf.int64)
            return tf.data.Dataset.from_tensor_slices(self._element_vectors(self._slot_to_utt(None), order))

        @tf.autograph.experimental.do_not_convert  # plain TF ops: tracing stays fast
        def draw(value):
            members = self._slot_to_utt(tf.stack([value, tf.constant(0, tf.int64)]))
            noise = tf.random.stateless_uniform([self.num_batches], tf.stack([value, tf.constant(1, tf.int64)]))
            order = _argsort(noise)
            return self._element_vectors(members, order)

        epoch = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1)
        return epoch.map(draw).unbatch()

    def static_dataset(self, shuffle=True, seed=None) -> tf.data.Dataset:
        """Like `epoch_dataset`, but with a splittable source and no random op.

        For tf.data service `distributed_epoch`: the source is
        `Dataset.range(num_batches)` (each batch goes whole to one worker)
        and there is no random op in the pipeline (TF 2.21 then silently
        stops splitting: every worker produces the whole epoch). With
        `shuffle`, bucket members and batch order are computed from `seed`
        (an int or a scalar int64 tensor: `keras_gpufix.data_service.service_epochs`
        gives a new one each epoch; None is 0).
        """
        if shuffle:
            value = tf.stack([tf.cast(0 if seed is None else seed, tf.int64),
                              tf.constant(0, tf.int64)])
            members = self._slot_to_utt(value)
            noise = tf.random.stateless_uniform([self.num_batches], value + [0, 1])
            order = _argsort(noise)
        else:
            members = self._slot_to_utt(None)
            order = tf.range(self.num_batches, dtype=tf.int64)
        vectors = self._element_vectors(members, order)
        sizes = tf.gather([len(s) for s in self.batch_slots], order)
        per_batch = tuple(tf.RaggedTensor.from_row_lengths(v, sizes) for v in vectors)
        batches = tf.data.Dataset.range(self.num_batches)
        return batches.map(lambda k: tuple(tf.gather(v, k) for v in per_batch)).unbatch()
