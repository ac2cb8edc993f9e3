import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gpufix.data import audio as audio_lib
from keras_gpufix.data.builder import SpeechDatasetBuilder
from keras_gpufix.data.corpus import Corpus, read_wav_header
from keras_gpufix.data.synthetic import BAD_KINDS, make_synthetic_corpus, write_wav
from keras_gpufix.data.text import TextConfig, encode_text
from keras_gpufix.exceptions import GpufixWarning

AUDIO = audio_lib.AudioConfig(sample_rate=16000, n_fft=512, hop_length=160, win_length=400,
                              n_mels=40, max_seconds=2.0)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANDLED = ("stereo", "pcm8", "pcm24", "pcm32", "float32", "other_rate")
SKIPPED = sorted(set(BAD_KINDS) - set(HANDLED))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_synthetic_corpus(tmp_path_factory.mktemp("corpus"), 30, sample_rate=16000,
                       min_seconds=0.3, max_seconds=1.5, bad_files=BAD_KINDS)


@pytest.fixture(scope="module")
def cached(corpus, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    return SpeechDatasetBuilder(corpus, audio=AUDIO, cache_dir=cache_dir, verbose=0)


def _epoch(dataset):
    return [tuple(t.numpy() for t in tf.nest.flatten(batch)) for batch in dataset]


def _frames(utterance):
    """Feature frames of an utterance, from its WAV header (public facts only)."""
    samples = audio_lib.resampled_length(utterance.info.frames, utterance.info.sample_rate,
                                         AUDIO.sample_rate)
    return AUDIO.num_frames(samples)


def _by_utterance(batches):
    """(text ids, mel) of every utterance of an epoch, keyed by its text ids."""
    out = {}
    for ids, text_len, mel, mel_len in batches:
        for i in range(len(text_len)):
            key = tuple(ids[i, : text_len[i]])
            assert key not in out
            out[key] = mel[i, : mel_len[i]]
    return out


def test_elements_report_and_bounded_shapes(cached):
    dataset = cached.build(batch_size=4, num_buckets=3, seed=0)
    spec = dataset.element_spec
    assert spec[0][0].dtype == tf.int32 and spec[0][0].shape.as_list() == [None, None]
    assert spec[0][1].dtype == tf.int32 and spec[0][1].shape.as_list() == [None]
    assert spec[1][0].dtype == tf.float32 and spec[1][0].shape.as_list() == [None, None, 40]
    assert spec[1][1].dtype == tf.int32 and spec[1][1].shape.as_list() == [None]
    report = cached.report
    assert set(report) >= {"utterances", "skipped", "bucket_boundaries", "padding_efficiency",
                           "distinct_shapes", "cache"}
    assert report["utterances"] == 30 + len(HANDLED)
    assert report["converted"] == {"mixed_down": 1, "resampled": 1, "re_encoded": 4}
    assert report["cache"] in ("hit", "miss")
    batches = _epoch(dataset)
    shapes = {(ids.shape, mel.shape) for ids, _, mel, _ in batches}
    assert len(shapes) == report["distinct_shapes"] <= 3 + 1
    assert len(batches) == report["batches_per_epoch"] == dataset.cardinality().numpy()
    assert sorted(np.concatenate([b[3] for b in batches])) == sorted(
        _frames(u) for u in cached.utterances)  # every utterance once, at its header's length
    real = sum(b[3].sum() for b in batches)
    padded = sum(b[2].shape[0] * b[2].shape[1] for b in batches)
    assert report["padding_efficiency"] == pytest.approx(real / padded, abs=1e-4)
    for ids, text_len, mel, mel_len in batches:
        assert mel.shape[1] in report["bucket_boundaries"]
        assert np.all(ids[np.arange(ids.shape[1]) >= text_len[:, None]] == 0)
        padding = np.arange(mel.shape[1])[None, :] >= mel_len[:, None]
        assert np.allclose(mel[padding], np.log(AUDIO.log_floor))
    assert dataset.input_probe.produced() == len(batches)  # went through kg.data.instrument


def test_cached_and_uncached_features_and_ids_agree(cached, corpus):
    with_cache = _by_utterance(_epoch(cached.build(4, 3, shuffle=False)))
    uncached = SpeechDatasetBuilder(corpus, audio=AUDIO, verbose=0)
    without = _by_utterance(_epoch(uncached.build(4, 3, shuffle=False)))
    assert with_cache.keys() == without.keys()
    for key, mel in with_cache.items():
        np.testing.assert_allclose(mel, without[key], atol=1e-5)
    first = cached.utterances[0]
    ids = tuple(encode_text([first.text], TextConfig()).to_list()[0])
    signal = audio_lib.decode_wav(tf.io.read_file(first.path), first.info.data_offset,
                                  first.info.data_bytes, first.info.format_code, first.info.channels)
    np.testing.assert_allclose(with_cache[ids], audio_lib.log_mel(signal, AUDIO).numpy(), atol=1e-5)


def test_features_computed_in_the_pipeline_run_on_every_core(cached, corpus):
    uncached = SpeechDatasetBuilder(corpus, audio=AUDIO, verbose=0).build(4, 3).options()
    assert uncached.autotune.enabled is False
    assert uncached.threading.max_intra_op_parallelism == 1
    assert cached.build(4, 3).options().autotune.enabled is not False  # reading a cache


def test_handled_kinds_are_converted(cached):
    by_id = {u.id: i for i, u in enumerate(cached.utterances)}
    other = cached.utterances[by_id["bad_other_rate"]]
    assert other.info.sample_rate == 8000
    samples = audio_lib.resampled_length(other.info.frames, 8000, 16000)
    entry = cached.prepare().cache_entry()
    frames = entry.open()["frames"]  # what the cache build recorded
    assert frames[by_id["bad_other_rate"]] == AUDIO.num_frames(samples) == _frames(other)
    for kind in HANDLED:
        index = by_id[f"bad_{kind}"]
        mel = entry.read(index)
        assert mel.shape == (frames[index], 40) == (_frames(cached.utterances[index]), 40)
        assert np.isfinite(mel).all() and mel.max() > np.log(AUDIO.log_floor) + 5


def test_skip_mode_reports_every_bad_kind(cached):
    skipped = {s["id"]: s for s in cached.report["skipped"]}
    for kind in SKIPPED:
        uid = "LJ000-0000" if kind == "duplicate_id" else f"bad_{kind}"
        assert uid in skipped, kind
        assert set(skipped[uid]) == {"id", "path", "line", "reason"} and skipped[uid]["reason"]


@pytest.mark.parametrize("kind", SKIPPED)
def test_raise_mode_names_file_line_and_reason(tmp_path, kind):
    path = make_synthetic_corpus(tmp_path, 2, sample_rate=16000, min_seconds=0.3, max_seconds=1.5,
                       bad_files=[kind])
    with pytest.raises(ValueError, match=r"metadata.csv, 1 utterance\(s\): line 3 \(id '.*', file .*\.wav\): "):
        SpeechDatasetBuilder(path, audio=AUDIO, on_bad_input="raise", verbose=0)


@pytest.mark.parametrize("kind", HANDLED)
def test_raise_mode_converts_handled_kinds(tmp_path, kind):
    path = make_synthetic_corpus(tmp_path, 1, sample_rate=16000, min_seconds=0.3, max_seconds=0.5,
                       bad_files=[kind])
    builder = SpeechDatasetBuilder(path, audio=AUDIO, on_bad_input="raise", verbose=0)
    assert builder.report["utterances"] == 2 and builder.report["skipped"] == []


def test_transcript_without_vocabulary_characters(tmp_path):
    pairs = []
    for name, text in (("a", "日本語"), ("b", "fine")):
        wav = str(tmp_path / f"{name}.wav")
        write_wav(wav, np.random.default_rng(0).uniform(-0.3, 0.3, 8000), 16000)
        pairs.append((wav, text))
    pairs.append((str(tmp_path / "gone.wav"), "missing"))
    builder = SpeechDatasetBuilder(pairs, audio=AUDIO, verbose=0)
    assert builder.report["utterances"] == 1
    reasons = {item["id"]: item["reason"] for item in builder.report["skipped"]}
    assert "no character of the vocabulary" in reasons["a"] and reasons["gone"] == "missing file"
    with pytest.raises(ValueError) as info:  # one error for the scan's and the text pass's items
        SpeechDatasetBuilder(pairs, audio=AUDIO, on_bad_input="raise", verbose=0)
    message = str(info.value)
    assert "the list of (wav_path, text) pairs, 2 utterance(s): line 1 (id 'a'" in message
    assert "no character of the vocabulary" in message and "line 3 (id 'gone'" in message


def test_batch_frames_drop_remainder_and_nondeterministic(cached):
    dataset = cached.build(batch_size=16, num_buckets=4, batch_frames=600,
                           drop_remainder=True, deterministic=False, seed=1)
    batches = _epoch(dataset)
    assert len({(b[0].shape, b[2].shape) for b in batches}) <= 4
    for ids, text_len, mel, mel_len in batches:
        assert mel.shape[0] * mel.shape[1] <= 600
    assert cached.report["batch_sizes"][0] > cached.report["batch_sizes"][-1]


def test_service_with_dispatcher_and_two_workers(cached):
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
    address = dispatcher.target.split("://")[1]
    workers = [service.WorkerServer(service.WorkerConfig(dispatcher_address=address, port=0))
               for _ in range(2)]
    local = _by_utterance(_epoch(cached.build(4, 3, shuffle=False)))
    dataset = cached.build(4, 3, seed=2, service=dispatcher.target)
    for _ in range(2):  # each epoch: every utterance exactly once
        remote = _by_utterance(_epoch(dataset))
        assert remote.keys() == local.keys()
        for key, mel in remote.items():
            np.testing.assert_array_equal(mel, local[key])
    named = cached.build(4, 3, seed=2, service=dispatcher.target, as_dict=True)
    ids = [i.decode() for batch in named for i in batch["id"].numpy()]
    assert sorted(ids) == sorted(u.id for u in cached.utterances)
    assert len(workers) == 2


def _fit_model(num_ids, n_mels):
    ids = keras.Input((None,), dtype="int32")
    text_len = keras.Input((), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(num_ids, 8, mask_zero=True)(ids))
    scale = keras.ops.expand_dims(keras.ops.cast(text_len, "float32"), -1) / 100.0
    hidden = keras.layers.Concatenate()([pooled, scale])
    model = keras.Model((ids, text_len), (keras.layers.Dense(n_mels)(hidden), keras.layers.Dense(1)(hidden)))

    def mel_loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(keras.ops.mean(y_true, axis=1) - y_pred))

    model.compile("adam", loss=(mel_loss, "mse"), jit_compile=False)
    return model


def test_fit_under_the_default_strategy(cached):
    dataset = cached.build(batch_size=8, num_buckets=2, seed=0)
    model = _fit_model(TextConfig().num_ids, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(dataset, epochs=2, verbose=0)
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert len(history.history["loss"]) == 2
    assert np.isfinite(history.history["loss"]).all()


def test_prefetch_to_device_is_reported_and_ignored_under_a_strategy(cached):
    dataset = cached.build(4, 2, prefetch_to_device="/cpu:0")
    assert cached.report["prefetch_to_device"] == "/cpu:0"
    assert len(_epoch(dataset)) == cached.report["batches_per_epoch"]
    cached.build(4, 2)
    assert cached.report["prefetch_to_device"] is None

    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        with pytest.warns(GpufixWarning, match="prefetch_to_device") as caught:
            cached.build(4, 2, prefetch_to_device="/cpu:0")
    assert cached.report["prefetch_to_device"] is None
    assert caught[0].filename == __file__  # the build(...) line above


MIRRORED = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sys.path.insert(0, sys.argv[3])
    from test_data_builder import AUDIO, _fit_model
    from keras_gpufix.data.builder import SpeechDatasetBuilder
    from keras_gpufix.data.text import TextConfig
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    builder = SpeechDatasetBuilder(sys.argv[1], audio=AUDIO, cache_dir=sys.argv[2], verbose=0)
    dataset = builder.build(batch_size=8, num_buckets=2, seed=0)
    with strategy.scope():
        model = _fit_model(TextConfig().num_ids, 40)
    history = model.fit(dataset, epochs=2, verbose=0)
    named = strategy.experimental_distribute_dataset(builder.build(8, 2, seed=0, as_dict=True))
    parts = strategy.experimental_local_results(next(iter(named))["id"])
    assert len(parts) == 2 and all(p.dtype == tf.string for p in parts), parts
    assert strategy.num_replicas_in_sync == 2
    assert np.isfinite(history.history["loss"]).all(), history.history
    print("FIT_OK", builder.report["cache"], builder.report["batches_per_epoch"])
    """
)


def test_fit_under_mirrored_strategy_with_two_replicas(cached, corpus):
    cached.prepare()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED, corpus, cached.cache_dir, os.path.join(REPO, "tests")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FIT_OK hit" in result.stdout


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "`batch_size` must be an integer >= 1. Received: batch_size=0"),
        ({"batch_size": 4, "num_buckets": 0}, "`num_buckets` must be an integer >= 1"),
        ({"batch_size": 4, "service": "localhost:5000"}, '`service` must be "grpc://host:port"'),
        ({"batch_size": 1000, "drop_remainder": True}, "No batch to build"),
    ],
)
def test_build_argument_errors(cached, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cached.build(**kwargs)


def test_constructor_argument_errors(corpus, tmp_path):
    with pytest.raises(ValueError, match='`on_bad_input` must be "skip" or "raise"'):
        SpeechDatasetBuilder(corpus, on_bad_input="ignore")
    with pytest.raises(ValueError, match="`audio` must be a kg.data.AudioConfig"):
        SpeechDatasetBuilder(corpus, audio={"n_mels": 80})
    with pytest.raises(ValueError, match="`corpus` must be a folder with metadata.csv"):
        SpeechDatasetBuilder(42)
    empty = make_synthetic_corpus(tmp_path, 1, sample_rate=16000, min_seconds=0.3, max_seconds=0.4)
    os.remove(os.path.join(empty, "wavs", "LJ000-0000.wav"))
    with pytest.raises(ValueError, match="No usable utterance .* LJ000-0000: missing file"):
        SpeechDatasetBuilder(empty, verbose=0)


def test_public_names_load_lazily():
    import keras_gpufix as kg

    for name in ("SpeechDatasetBuilder", "AudioConfig", "TextConfig", "log_mel",
                 "LogMelSpectrogram", "make_synthetic_corpus", "Corpus",
                 "instrument", "InputProbe"):
        assert getattr(kg.data, name) is not None
    assert isinstance(Corpus.from_pairs([]), kg.data.Corpus)
    assert read_wav_header is kg.data.read_wav_header



def _two_speaker_manifest(folder):
    """Six utterances of two speakers (relative paths), one bad line, one NaN float WAV."""
    rng = np.random.default_rng(0)
    lines, expected = [], {}
    for i in range(7):
        speaker = ("anna", "bob")[i % 2]
        rel = os.path.join("clips", speaker, f"c{i}.wav")
        os.makedirs(os.path.join(folder, "clips", speaker), exist_ok=True)
        samples = 0.1 * rng.standard_normal(int(16000 * (0.3 + 0.1 * i)))
        write_wav(os.path.join(folder, rel), samples, 16000,
                  sample_format="float32" if i == 6 else "pcm16")
        text = f"clip {'abd'[i % 3] * (i + 1)}"
        item = {"audio_filepath": rel, "text": text, "speaker": speaker,
                "language": "en" if i < 3 else "fr", "duration": 0.3 + 0.1 * i}
        lines.append(__import__("json").dumps(item))
        expected[f"c{i}"] = item
        if i == 2:
            lines.append('{"text": "no audio"}')
    nan_path = os.path.join(folder, "clips", "anna", "c6.wav")
    info = read_wav_header(nan_path)
    with open(nan_path, "r+b") as f:
        f.seek(info.data_offset + 40)
        f.write(np.array([np.nan], "<f4").tobytes())
    del expected["c6"]
    path = os.path.join(folder, "train.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path, expected


def _tokenize(text):
    return [ord(c) % 50 for c in text]  # 'd' (100) is id 0: it must reach the batch too


def test_named_batches_from_a_two_speaker_manifest_with_a_tokenizer(tmp_path):
    path, expected = _two_speaker_manifest(str(tmp_path))
    text = TextConfig(tokenizer=_tokenize, vocab_size=50)
    cached = SpeechDatasetBuilder(path, audio=AUDIO, text=text, cache_dir=tmp_path / "cache", verbose=0)
    plain = SpeechDatasetBuilder(Corpus.from_manifest(path), audio=AUDIO, text=text, verbose=0)
    report = cached.report
    assert report["speakers"] == ["anna", "bob"] and report["languages"] == ["en", "fr"]
    assert [(s["line"], s["reason"][:25]) for s in report["skipped"]] == [
        (4, "manifest line has no `aud"), (8, "NaN or infinite samples i")]
    for builder in (cached, plain):
        seen, zeros = {}, 0
        for batch in builder.build(batch_size=2, num_buckets=2, seed=1, as_dict=True):
            assert set(batch) == {"id", "tokens", "tokens_len", "features", "features_len",
                                  "speaker", "language"}
            for i, uid in enumerate(batch["id"].numpy()):
                item = expected[uid.decode()]
                n, frames = batch["tokens_len"][i], batch["features_len"][i]
                assert batch["tokens"][i, :n].numpy().tolist() == _tokenize(item["text"])
                zeros += _tokenize(item["text"]).count(0)
                assert not batch["tokens"][i, n:].numpy().any()
                assert report["speakers"][batch["speaker"][i]] == item["speaker"]
                assert report["languages"][batch["language"][i]] == item["language"]
                assert frames == AUDIO.num_frames(int(16000 * item["duration"]))
                seen[uid.decode()] = batch["features"][i, :frames].numpy()
        assert seen.keys() == expected.keys()
        assert zeros == 3 + 6  # c2 and c5 carry 'd' (id 0) inside their tokens
        if builder is cached:
            from_cache = seen
    for uid, features in seen.items():
        np.testing.assert_allclose(features, from_cache[uid], atol=1e-5)
    assert cached.report["cache"] == "miss" and len(cached.cache_entry().open()["frames"]) == 6
    tuples = cached.build(batch_size=2, num_buckets=2, seed=1)
    assert len(tuples.element_spec) == 2  # the default layout is unchanged


def _float_wavs(folder, peaks):
    """(path, text) pairs of 0.25 s float WAVs, each holding one value."""
    pairs = []
    for i, peak in enumerate(peaks):
        path = os.path.join(folder, f"w{i}.wav")
        write_wav(path, np.zeros(4000), 16000, sample_format="float32")
        info = read_wav_header(path)
        with open(path, "r+b") as f:
            f.seek(info.data_offset)
            f.write(np.full(4000, peak, "<f4").tobytes())
        pairs.append((path, "some text"))
    return pairs


@pytest.mark.parametrize("cache", [False, True])
def test_float_samples_that_would_overflow_never_reach_a_batch(tmp_path, cache):
    pairs = _float_wavs(str(tmp_path), (0.5, 0.5, 3e38))
    builder = SpeechDatasetBuilder(pairs, audio=AUDIO, verbose=0,
                                   cache_dir=tmp_path / "cache" if cache else None)
    batches = list(builder.build(batch_size=4, num_buckets=1))
    assert [s["id"] for s in builder.report["skipped"]] == ["w2"]
    assert "peak 3e+38" in builder.report["skipped"][0]["reason"]
    assert sum(len(ids) for (ids, _), _ in batches) == 2
    assert all(np.isfinite(mel.numpy()).all() for _, (mel, _) in batches)
    with pytest.raises(ValueError, match=r"w2.wav.*peak 3e\+38"):
        SpeechDatasetBuilder(pairs, audio=AUDIO, verbose=0, on_bad_input="raise")


def test_non_finite_features_never_reach_the_cache(tmp_path, monkeypatch):
    compute_features = SpeechDatasetBuilder._compute_features

    def poisoned(self):  # the backstop: features that are not finite all the same
        compute = compute_features(self)
        return lambda index: tf.where(index == 2, compute(index) * np.inf, compute(index))

    monkeypatch.setattr(SpeechDatasetBuilder, "_compute_features", poisoned)
    pairs = _float_wavs(str(tmp_path), (0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"features of .*w2.wav \(line 3, id 'w2'\) are not finite"):
        SpeechDatasetBuilder(pairs, audio=AUDIO, cache_dir=tmp_path / "cache", verbose=0).prepare()
    assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []


def test_max_tokens_and_tokenizer_failures_are_bad_input(tmp_path, capsys):
    path, _ = _two_speaker_manifest(str(tmp_path))
    text = TextConfig(tokenizer=_tokenize, vocab_size=50, max_tokens=8)
    builder = SpeechDatasetBuilder(path, audio=AUDIO, text=text, verbose=1)
    line = capsys.readouterr().out.strip()
    assert line.startswith("Skipped 5 of 8 utterances: ") and "train.jsonl (line 4): manifest line" in line
    assert line.endswith("; and 2 more: builder.report['skipped'].")
    long = sorted(s["id"] for s in builder.report["skipped"] if "max_tokens=8" in s["reason"])
    assert long == ["c3", "c4", "c5"]
    with pytest.raises(ValueError, match=r"5 utterance\(s\): line 4 .*longer than max_tokens=8"):
        SpeechDatasetBuilder(path, audio=AUDIO, text=text, on_bad_input="raise", verbose=0)


def test_crop_caps_audio_and_tokens_before_bucketing_and_reports_them(corpus):
    whole = audio_lib.AudioConfig(**{**AUDIO.__dict__, "max_seconds": None})
    audio = audio_lib.AudioConfig(**{**AUDIO.__dict__, "max_seconds": 0.8, "on_too_long": "crop"})
    text = TextConfig(max_tokens=20, on_too_long="crop")
    reference = SpeechDatasetBuilder(corpus, audio=whole, verbose=0)
    builder = SpeechDatasetBuilder(corpus, audio=audio, text=text, verbose=0)
    assert builder.report["utterances"] == reference.report["utterances"]  # none skipped for length
    tokens = {u.id: len(encode_text([u.text])[0]) for u in reference.utterances}
    long_audio = {u.id for u in reference.utterances if u.info.seconds > 0.8}
    long_text = {uid for uid, n in tokens.items() if n > 20}
    assert long_audio and long_text
    reasons = {c["id"]: c["reason"] for c in builder.report["cropped"]}
    assert set(reasons) == long_audio | long_text
    assert all(("cropped to max_seconds=0.8" in reasons[i]) == (i in long_audio) for i in reasons)
    assert all(("cropped to max_tokens=20" in reasons[i]) == (i in long_text) for i in reasons)
    max_frames = audio.num_frames(audio.max_samples)
    full = _by_utterance(_epoch(reference.build(batch_size=4, num_buckets=3, shuffle=False)))
    batches = _epoch(builder.build(batch_size=4, num_buckets=3, shuffle=False))
    assert max(b[2].shape[1] for b in batches) == max_frames  # shapes bounded by the cap
    assert max(b[0].shape[1] for b in batches) <= 20
    assert sum(len(b[1]) for b in batches) == builder.report["utterances"]
    interior = (audio.max_samples - audio.n_fft // 2) // audio.hop_length  # frames the crop leaves whole
    for ids, text_len, mel, mel_len in batches:
        for i in range(len(text_len)):
            match = [k for k in full if k[: text_len[i]] == tuple(ids[i, : text_len[i]])]
            whole = full[match[0]]
            assert mel_len[i] == min(len(whole), max_frames)
            np.testing.assert_allclose(mel[i, :min(interior, mel_len[i])],
                                       whole[:min(interior, mel_len[i])], atol=1e-4)


def test_crop_needs_a_cap():
    with pytest.raises(ValueError, match='`on_too_long="crop"` needs `max_tokens`'):
        TextConfig(on_too_long="crop")
    with pytest.raises(ValueError, match="`on_too_long` must be \"skip\" or \"crop\". Received: on_too_long='cut'"):
        TextConfig(max_tokens=5, on_too_long="cut")


def test_batch_frames_batches_by_audio_budget(cached):
    budget = 4 * int(max(_frames(u) for u in cached.utterances))
    dataset = cached.build(num_buckets=3, batch_frames=budget, batch_multiple=2, seed=3,
                           as_dict=True)
    for _ in range(2):  # two epochs: every utterance once in each
        batches = list(dataset.as_numpy_iterator())
        ids = [i.decode() for b in batches for i in b["id"]]
        assert sorted(ids) == sorted(u.id for u in cached.utterances)
        shapes = {b["features"].shape for b in batches}
        assert len(shapes) == cached.report["distinct_shapes"] <= 3 + 1
        assert all(b["features"].shape[0] * b["features"].shape[1] <= budget for b in batches)
    sizes = cached.report["batch_sizes"]
    assert sizes[0] > sizes[-1] >= 4 and all(n % 2 == 0 for n in sizes)
    with pytest.raises(ValueError, match=r"`batch_frames` must hold the longest utterance"):
        cached.build(batch_frames=budget // 8)
