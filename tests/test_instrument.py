import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gpufix as kg
from keras_gpufix.data import instrument
from keras_gpufix.data.audio import AudioConfig
from keras_gpufix.data.builder import SpeechDatasetBuilder
from keras_gpufix.data.input_probe import InputCursor
from keras_gpufix.data.synthetic import make_synthetic_corpus
from planted import FEATURES, tiny_model


def batches(n=10, batch=4):
    x = np.arange(n * batch * FEATURES, dtype=np.float32).reshape(n * batch, FEATURES)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(batch)


def test_elements_unchanged_and_recorded_in_order():
    ds = instrument(batches(), capacity=16)
    plain = [a.numpy() for a, _ in batches()]
    got = [a.numpy() for a, _ in ds]
    assert all(np.array_equal(p, g) for p, g in zip(plain, got))
    probe = ds.input_probe
    assert probe.produced() == 10
    ready, shapes, frames = probe.read(0, 10)
    assert frames is None  # no `frames=`: none recorded
    assert np.all(np.diff(ready) >= 0)
    assert probe.shape_key(shapes[0]) == ((4, FEATURES), (4, 1))
    assert probe.batch_size(probe.shape_key(shapes[0])) == 4


def test_ring_reports_overwritten_and_future_elements_as_missing():
    ds = instrument(batches(n=20), capacity=16)
    for _ in ds:
        pass
    ready, shapes, _ = ds.input_probe.read(0, 22)
    assert np.isnan(ready[:4]).all() and (shapes[:4] == -1).all()  # overwritten
    assert np.isfinite(ready[4:20]).all()
    assert np.isnan(ready[20:]).all()  # not produced yet


def test_instrumented_inside_a_strategy_scope():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        ds = instrument(batches())
        model = tiny_model()
    model.fit(ds.prefetch(2), epochs=1, verbose=0)
    assert ds.input_probe.produced() >= 10


def test_rejects_non_datasets():
    with pytest.raises(ValueError, match="`dataset` must be a tf.data.Dataset"):
        instrument([1, 2, 3])


def test_public_name_is_the_function_after_the_builder_loaded():
    import keras_gpufix as kg
    import keras_gpufix.data.builder  # noqa: F401  imports the probe module

    assert callable(kg.data.instrument) and kg.data.instrument is instrument


# -- speech throughput: real (unpadded) frames and seconds of audio ----------

def lengths_dataset(lengths, batch=2):
    """((x, y), lengths) batches whose lengths column is the real frames."""
    n = len(lengths)
    x = np.zeros((n, FEATURES), np.float32)
    return tf.data.Dataset.from_tensor_slices(
        ((x, x[:, :1]), np.asarray(lengths, np.int32))).batch(batch)


def test_frames_recorded_per_batch_and_summed_per_hook():
    lengths = [3, 5, 7, 11, 13, 17, 19, 23]
    ds = instrument(lengths_dataset(lengths), frames=lambda batch: batch[1],
                    frames_per_second=100.0)
    for _ in ds:
        pass
    probe = ds.input_probe
    assert probe.frames_per_second == 100.0
    assert probe.read(0, 5)[2].tolist() == [8, 18, 30, 42, -1]  # the 5th: not produced
    cursor = InputCursor()
    cursor.probe = probe
    ready = probe.read(0, 4)[0]
    waits, rows, frames = cursor.take(ready[[0, 1, 3]], ready[[0, 2, 3]] + 1.0, [1, 2, 1])
    assert frames == [8, 18 + 30, 42]  # a hook of 2 steps sums its 2 batches
    assert len(waits) == len(rows) == 3
    assert cursor.take([ready[3] + 2], [ready[3] + 3], [1])[2] == [None]  # not produced


@pytest.mark.parametrize("kwargs, match", [
    ({"frames": 3}, "`frames` must be a function"),
    ({"frames_per_second": 100.0}, "`frames_per_second` must be > 0 and given with `frames`"),
    ({"frames": lambda b: b[1], "frames_per_second": 0}, "`frames_per_second` must be > 0"),
])
def test_bad_frames_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        instrument(lengths_dataset([1, 2]), **kwargs)


AUDIO = AudioConfig(sample_rate=16000, n_fft=512, hop_length=160, win_length=400, n_mels=8,
                    max_seconds=1.0)


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    corpus = make_synthetic_corpus(tmp_path_factory.mktemp("corpus"), 10, sample_rate=16000,
                                   min_seconds=0.2, max_seconds=0.8)
    return SpeechDatasetBuilder(corpus, audio=AUDIO, verbose=0)


def mel_model(steps_per_execution=1):
    model = keras.Sequential([keras.Input((None, AUDIO.n_mels)),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    return model


def features_len(batch):
    return batch["features_len"] if isinstance(batch, dict) else batch[1][1]


def frames_of_one_pass(dataset):
    return sum(int(np.sum(features_len(batch))) for batch in dataset.as_numpy_iterator())


def check_throughput(summary, frames):
    """The figures account for exactly `frames` real frames."""
    assert summary["real_frames_per_s"] * summary["total_s"] == pytest.approx(frames, rel=1e-9)
    assert summary["audio_seconds_per_s"] == pytest.approx(
        summary["real_frames_per_s"] * AUDIO.hop_length / AUDIO.sample_rate, rel=1e-12)


@pytest.mark.parametrize("as_dict, steps_per_execution", [(False, 1), (True, 2)])
def test_fit_over_builder_batches_reports_the_frames_it_consumed(builder, as_dict,
                                                                 steps_per_execution):
    train = builder.build(batch_size=3, num_buckets=2, seed=0, as_dict=as_dict)
    steps, frames = builder.report["batches_per_epoch"], frames_of_one_pass(train)
    if as_dict:
        fit_data = train.map(lambda b: (b["features"], tf.cast(b["features_len"], tf.float32)))
    else:
        fit_data = train.map(lambda text, feats: (feats[0], tf.cast(feats[1], tf.float32)))
    val = builder.build(batch_size=2, num_buckets=1, seed=1).map(
        lambda text, feats: (feats[0], tf.cast(feats[1], tf.float32)))
    timer, monitor = kg.StepTimer(), kg.GPUOscillationMonitor(warmup=1, verbose=0, nvml=False)
    mel_model(steps_per_execution).fit(fit_data, validation_data=val, epochs=2, verbose=0,
                                       callbacks=[timer, monitor])
    summary = timer.summary()
    assert summary["count"] == 2 * steps
    check_throughput(summary, 2 * frames)  # each epoch consumes every utterance once
    report = monitor.report()["step_time"]  # after warm-up: fewer frames, the same rule
    assert 0 < report["real_frames_per_s"] * report["total_s"] < 2 * frames
    check_throughput(report, report["real_frames_per_s"] * report["total_s"])


def test_watch_over_builder_batches_reports_the_frames_it_consumed(builder):
    train = builder.build(batch_size=3, num_buckets=2, seed=0)
    steps = builder.report["batches_per_epoch"]
    timer = kg.StepTimer()
    consumed = 0
    with kg.watch(train, callbacks=[timer]) as watched:
        for step, (_, (mel, mel_len)) in enumerate(watched):  # an epoch left early
            consumed += int(np.sum(mel_len))
            if step == 1:
                break
        for _, (mel, mel_len) in watched:
            consumed += int(np.sum(mel_len))
    assert timer.summary()["count"] == 2 + steps
    check_throughput(timer.summary(), consumed)


def test_batches_without_lengths_give_none_not_zero():
    timer = kg.StepTimer()
    tiny_model().fit(instrument(batches()), epochs=1, verbose=0, callbacks=[timer])
    summary = timer.summary()
    assert summary["samples_per_s"] > 0
    assert summary["real_frames_per_s"] is None and summary["audio_seconds_per_s"] is None


def test_watch_over_an_iterator_made_before_the_run_gives_none_not_a_shifted_count(builder):
    iterator = iter(builder.build(batch_size=3, num_buckets=2, seed=0).repeat())
    next(iterator)  # read before the loop is watched: the probe's order is not the loop's
    timer = kg.StepTimer()
    with kg.watch((batch for batch in iterator), callbacks=[timer]) as watched:
        for step, _ in enumerate(watched):
            if step == 5:
                time.sleep(0.2)  # the prefetch refills: every step has a recorded batch
                break
    assert timer.summary()["count"] == 6 and timer.summary()["samples_per_s"] > 0
    assert timer.summary()["real_frames_per_s"] is None
