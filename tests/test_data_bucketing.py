import collections

import numpy as np
import pytest

from keras_gpufix.data.bucketing import BucketPlan, quantile_boundaries


def _lengths(n=203, seed=0):
    rng = np.random.default_rng(seed)
    frames = rng.integers(80, 900, n)
    text = (frames / 6 + rng.integers(-10, 10, n)).clip(1).astype(int)
    return frames, text


def _epoch(plan, dataset):
    """Batches of one epoch as (utterances, pad_frames, pad_text), grouped by key."""
    groups = collections.OrderedDict()
    for utterance, key, pad_frames, pad_text in dataset.as_numpy_iterator():
        groups.setdefault(key, []).append((utterance, pad_frames, pad_text))
    window = plan.max_batch + 1
    batches = []
    for key, members in groups.items():
        assert len(members) == key % window  # the key carries the batch size
        assert len({(f, t) for _, f, t in members}) == 1
        batches.append(([u for u, _, _ in members], members[0][1], members[0][2]))
    return batches


def test_quantile_boundaries():
    assert quantile_boundaries(np.arange(1, 101), 4).tolist() == [25, 50, 75, 100]
    assert quantile_boundaries([5] * 10, 8).tolist() == [5]
    with pytest.raises(ValueError, match="`num_buckets` must be >= 1. Received: num_buckets=0"):
        quantile_boundaries([1, 2], 0)


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("frame_budget", [None, 6000])
def test_epoch_covers_every_utterance_with_bounded_shapes(drop_remainder, frame_budget):
    frames, text = _lengths()
    plan = BucketPlan(frames, text, batch_size=16, num_buckets=5,
                      frame_budget=frame_budget, drop_remainder=drop_remainder)
    batches = _epoch(plan, plan.epoch_dataset(shuffle=True, seed=1))
    seen = [u for members, _, _ in batches for u in members]
    assert len(seen) == len(set(seen))
    if not drop_remainder:
        assert sorted(seen) == list(range(len(frames)))
    else:
        assert len(frames) - len(seen) < 16
    shapes = {(len(m), t, f) for m, f, t in batches}
    assert shapes == plan.shapes
    assert len(shapes) <= 5 + (0 if drop_remainder else 1)
    partial = [m for m, f, t in batches
               if len(m) < plan.bucket_sizes[list(plan.boundaries).index(f)]]
    assert len(partial) <= (0 if drop_remainder else 1)
    for members, pad_frames, pad_text in batches:
        assert frames[members].max() <= pad_frames
        assert text[members].max() <= pad_text
        if frame_budget:
            assert len(members) * pad_frames <= max(frame_budget, pad_frames)


def test_padding_efficiency_is_real_over_padded():
    frames, text = _lengths()
    plan = BucketPlan(frames, text, batch_size=16, num_buckets=8)
    batches = _epoch(plan, plan.epoch_dataset(shuffle=False))
    real = sum(frames[m].sum() for m, _, _ in batches)
    padded = sum(len(m) * f for m, f, _ in batches)
    assert plan.padding_efficiency == pytest.approx(real / padded)
    naive = BucketPlan(frames, text, batch_size=16, num_buckets=1)
    assert plan.padding_efficiency > naive.padding_efficiency + 0.2


def test_text_boundaries_never_shrink_across_buckets():
    frames, text = _lengths()
    plan = BucketPlan(frames, text, batch_size=8, num_buckets=6)
    assert np.all(np.diff(plan.text_boundaries) >= 0)
    assert np.all(np.diff(plan.boundaries) > 0)


def test_shuffle_draws_new_epochs_reproducibly():
    frames, text = _lengths()
    plan = BucketPlan(frames, text, batch_size=8, num_buckets=4)
    dataset = plan.epoch_dataset(shuffle=True, seed=7)
    first, second = _epoch(plan, dataset), _epoch(plan, dataset)
    assert [m for m, _, _ in first] != [m for m, _, _ in second]
    again = plan.epoch_dataset(shuffle=True, seed=7)
    assert [m for m, _, _ in _epoch(plan, again)] == [m for m, _, _ in first]
    ordered = plan.epoch_dataset(shuffle=False)
    assert _epoch(plan, ordered) == _epoch(plan, ordered)


def test_static_dataset_matches_plan_shapes():
    frames, text = _lengths()
    plan = BucketPlan(frames, text, batch_size=8, num_buckets=4)
    batches = _epoch(plan, plan.static_dataset(shuffle=True, seed=3))
    assert sorted(u for m, _, _ in batches for u in m) == list(range(len(frames)))
    assert {(len(m), t, f) for m, f, t in batches} == plan.shapes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "`batch_size` must be >= 1. Received: batch_size=0"),
        ({"batch_size": 4, "frame_budget": 0}, "`frame_budget` must be >= 1. Received: frame_budget=0"),
        ({"batch_size": 4, "num_buckets": 0}, "`num_buckets` must be >= 1. Received: num_buckets=0"),
    ],
)
def test_invalid_arguments(kwargs, message):
    frames, text = _lengths(10)
    with pytest.raises(ValueError, match=message):
        BucketPlan(frames, text, **kwargs)
