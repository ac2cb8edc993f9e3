"""`SpeechDatasetBuilder`: a speech corpus -> a fast, bounded-shape `tf.data.Dataset`.

The builder is the input path a TTS/ASR team would want as the default:

1. `__init__` scans the corpus (transcripts and WAV headers only), encodes
   every transcript with TF string ops in one vectorised call, and decides
   what is bad input (skipped and reported, or raised) before any decoding.
2. `prepare()` (called by `build`) computes the features once, in
   parallel with a progress bar, into the fingerprinted `FeatureCache` when
   `cache_dir` is set; later runs open the cache (a hit) in well under a
   second. Without `cache_dir` features are computed in the pipeline, every
   epoch.
3. `build()` lays out length buckets with at most `num_buckets` (+1) batch
   shapes (`BucketPlan`), loads and pads elements in parallel (AUTOTUNE from
   a cache; on every core when features are computed in the pipeline),
   groups them into batches, optionally runs all of that on tf.data service
   workers, passes the batches through `kg.data.instrument` with their
   feature lengths (so the monitors see input readiness and report
   `real_frames_per_s` and `audio_seconds_per_s`) and prefetches (or
   `prefetch_to_device`, last).

`builder.report` keys:

| key                       | meaning                                            |
|---------------------------|----------------------------------------------------|
| `utterances`              | utterances kept                                    |
| `skipped`                 | list of dicts `id`, `path`, `line`, `reason`       |
| `cropped`                 | kept but cropped (`on_too_long="crop"` of `AudioConfig` / `TextConfig`), dicts like `skipped`'s |
| `speakers`                | speaker names; speaker id `i` is `speakers[i]` (None when the corpus has none) |
| `languages`               | language names, like `speakers`                    |
| `converted`               | counts of files handled: `mixed_down`, `resampled`, `re_encoded` (not 16-bit PCM) |
| `seconds`                 | audio kept, in seconds                             |
| `cache`                   | `"hit"`, `"miss"` or `"off"` (None before `prepare`) |
| `cache_path`              | the cache entry's folder (None without cache)      |
| `bucket_boundaries`       | padded frames per bucket (set by `build`)          |
| `text_boundaries`         | padded text length per bucket                      |
| `batch_sizes`             | batch size per bucket                              |
| `batches_per_epoch`       | batches in one epoch                               |
| `padding_efficiency`      | real / padded mel frames over an epoch             |
| `text_padding_efficiency` | real / padded text ids over an epoch               |
| `distinct_shapes`         | distinct `(batch, text, frames)` shapes per epoch  |
| `remainder`               | utterances left out of each epoch (the partial batch with `drop_remainder`) |
| `shuffle_seed`            | the shuffle's seed: `seed`, or under a multi-worker cluster the one every worker derives alike (`distribute.cluster_seed`) |
| `prefetch_to_device`      | the device `build` prefetches to; None when not asked or ignored under a strategy |
"""

import dataclasses
import os

import numpy as np
import tensorflow as tf

from keras_gpufix import __version__
from keras_gpufix.compile.hardware import usable_cpus
from keras_gpufix.data import audio as audio_lib
from keras_gpufix.data.bucketing import BucketPlan
from keras_gpufix.data.cache import CACHE_FORMAT, FeatureCache, fingerprint
from keras_gpufix.data.checks import check_build_args
from keras_gpufix.data.corpus import Corpus, bad_input_error
from keras_gpufix.data.input_probe import instrument
from keras_gpufix.data.text import TextConfig, encode_transcripts
from keras_gpufix.data_service import service_epochs
from keras_gpufix.distribute import cluster_seed
from keras_gpufix.exceptions import warn
from keras_gpufix.output import emit, progress

__all__ = ["SpeechDatasetBuilder"]

AUTOTUNE = tf.data.AUTOTUNE
# Transcripts per vectorised encoding call of the scan.
_ENCODE_CHUNK = 1024


def _map_on_every_core(dataset, fn, deterministic):
    """`dataset.map(fn)` where `fn` computes features from audio and should
    keep every core busy: the cache build, the trimmed-length pass, and the
    loader of `build()` without a cache.

    tf.data's autotuning is off for the pipeline (the option reaches the
    transformations after it too), with a fixed `2 * usable_cpus()` calls in
    flight and single-threaded ops inside them: on a 2-core VM (TF 2.21) an
    autotuned map ran such a pass on one core in some of the runs (CPU time
    / wall time ~1.0 instead of ~1.8: half the throughput), whatever the
    map's own parallelism; with autotuning off every run used both cores
    (`benchmarks/map_parallelism.py`).
    """
    calls = 2 * usable_cpus()
    options = tf.data.Options()
    options.autotune.enabled = False
    options.threading.max_intra_op_parallelism = 1
    return dataset.map(fn, num_parallel_calls=calls, deterministic=deterministic).prefetch(
        calls).with_options(options)


class SpeechDatasetBuilder:
    """Builds a bucketed, cached, instrumented `tf.data.Dataset` from speech.

    Args:
        corpus: an LJSpeech-style folder (`metadata.csv` with
            `id|text|normalized_text`, `wavs/<id>.wav`), a JSON Lines
            manifest (`.jsonl` / `.json`, see `Corpus.from_manifest`), a
            list of `(wav_path, text)` pairs, or a `kg.data.Corpus` (from
            `Corpus.concat`, `corpus.split`, another metadata file, ...).
        audio: `kg.data.AudioConfig`. Defaults to `AudioConfig()` (22050 Hz,
            80 Slaney mels, librosa-compatible).
        text: `kg.data.TextConfig`. Defaults to `TextConfig()`.
        cache_dir: folder of the persistent feature cache; None computes
            features in the pipeline every epoch. Defaults to None.
        on_bad_input: `"skip"` (drop bad utterances and list them in
            `report["skipped"]`) or `"raise"` (one `ValueError` listing
            every bad utterance's file, metadata line and reason, up to
            ten, and their count). Defaults to `"skip"`.
        verbose: 1 shows a progress bar while the cache is built and a line
            about skipped utterances; 0 is silent. Defaults to 1.

    Raises:
        ValueError: for invalid arguments, with `on_bad_input="raise"` for
            all bad utterances at once, and when no utterance is usable.

    Example:

    >>> builder = kg.data.SpeechDatasetBuilder("data/LJSpeech-1.1",
    ...                                        cache_dir="cache/")
    >>> train = builder.build(batch_size=32, num_buckets=8)
    >>> (text_ids, text_len), (mel, mel_len) = next(iter(train))
    >>> builder.report["padding_efficiency"]
    0.93
    """

    def __init__(self, corpus, audio=None, text=None, cache_dir=None,
                 on_bad_input="skip", verbose=1):
        self.audio = audio_lib.AudioConfig() if audio is None else audio
        self.text = TextConfig() if text is None else text
        if not isinstance(self.audio, audio_lib.AudioConfig):
            raise ValueError(f"`audio` must be a kg.data.AudioConfig. Received: audio={audio!r}")
        if not isinstance(self.text, TextConfig):
            raise ValueError(f"`text` must be a kg.data.TextConfig. Received: text={text!r}")
        if on_bad_input not in ("skip", "raise"):
            raise ValueError(
                f'`on_bad_input` must be "skip" or "raise". Received: on_bad_input={on_bad_input!r}'
            )
        self.corpus = self._prepare_corpus(corpus)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.on_bad_input = on_bad_input
        self.verbose = verbose
        self._cache = None
        self._trim_bounds = None  # (n, 2) from the trim pass, without a cache
        self._prepared = False
        self._scan()

    @staticmethod
    def _prepare_corpus(corpus):
        if isinstance(corpus, Corpus):
            return corpus
        if isinstance(corpus, (str, os.PathLike)):
            return Corpus.from_path(corpus)
        if isinstance(corpus, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in corpus
        ):
            return Corpus.from_pairs(corpus)
        raise ValueError(
            "`corpus` must be a folder with metadata.csv, a JSON Lines manifest, a list of "
            f"(wav_path, text) pairs or a kg.data.Corpus. Received: corpus={corpus!r:.200}"
        )

    def _scan(self):
        crop_audio = self.audio.on_too_long == "crop"
        crop_text = self.text.on_too_long == "crop"
        kept, skipped = self.corpus.scan("skip", None if crop_audio else self.audio.max_seconds)
        values, text_lengths, reasons = self._encode(kept)
        samples = audio_lib.resampled_length(kept.column("frames"), kept.column("sample_rate"),
                                             self.audio.sample_rate)
        frames = self.audio.num_frames(samples)
        for index in np.flatnonzero(frames == 0):
            if reasons[index] is None:
                reasons[index] = (f"clip of {samples[index]} samples is shorter than one frame "
                                  f"(n_fft={self.audio.n_fft})")
        bad = np.array([reason is not None for reason in reasons], bool)
        skipped.extend(self._entry(kept, index, reasons[index]) for index in np.flatnonzero(bad))
        long_audio = crop_audio & (samples > (self.audio.max_samples or 0)) & ~bad
        long_text = crop_text & (text_lengths > (self.text.max_tokens or 0)) & ~bad
        cropped = []
        for index in np.flatnonzero(long_audio | long_text):
            what = []
            if long_audio[index]:
                seconds = kept.column("frames")[index] / kept.column("sample_rate")[index]
                what.append(f"audio of {seconds:.2f} s cropped to "
                            f"max_seconds={self.audio.max_seconds}")
            if long_text[index]:
                what.append(f"transcript of {text_lengths[index]} tokens cropped to "
                            f"max_tokens={self.text.max_tokens}")
            cropped.append(self._entry(kept, index, "; ".join(what)))
        if crop_audio:
            frames = np.minimum(frames, self.audio.num_frames(self.audio.max_samples))
        if skipped and self.on_bad_input == "raise":
            raise bad_input_error(self.corpus.source, sorted(skipped, key=lambda s: s["line"]))
        usable = np.flatnonzero(~bad)
        if not len(usable):
            reasons = "; ".join(f"{s['id']}: {s['reason']}" for s in skipped[:3])
            raise ValueError(
                f"No usable utterance in {self.corpus.source} "
                f"({len(skipped)} skipped; first: {reasons or 'the corpus is empty'})."
            )
        self.utterances = kept.take(usable)
        position = np.arange(len(values)) - np.repeat(np.cumsum(text_lengths) - text_lengths,
                                                      text_lengths)
        keep = np.repeat(~bad, text_lengths)
        if crop_text:
            keep &= position < self.text.max_tokens
            text_lengths = np.minimum(text_lengths, self.text.max_tokens)
        self._text_values = tf.constant(values[keep])  # held once, by TensorFlow
        self._text_lengths = text_lengths[usable].astype(np.int64)
        self._text_splits = np.concatenate([[0], np.cumsum(self._text_lengths)])
        self._frames = frames[usable].astype(np.int64)
        self._labels = {
            name: self.utterances.column(name)
            for name, table in (("speaker", self.corpus.speakers), ("language", self.corpus.languages))
            if table is not None
        }
        skipped.sort(key=lambda s: s["line"])
        column = self.utterances.column
        self.report = {
            "utterances": len(self.utterances),
            "skipped": skipped,
            "cropped": cropped,
            "speakers": self.corpus.speakers,
            "languages": self.corpus.languages,
            "converted": {
                "mixed_down": int(np.sum(column("channels") > 1)),
                "resampled": int(np.sum(column("sample_rate") != self.audio.sample_rate)),
                "re_encoded": int(np.sum((column("format_tag") != 1) | (column("bits") != 16))),
            },
            "seconds": float(np.sum(column("frames") / column("sample_rate"))),
            "cache": None,
            "cache_path": None,
            "bucket_boundaries": None,
            "text_boundaries": None,
            "batch_sizes": None,
            "batches_per_epoch": None,
            "padding_efficiency": None,
            "text_padding_efficiency": None,
            "distinct_shapes": None,
            "remainder": None,
            "shuffle_seed": None,
            "prefetch_to_device": None,
        }
        for verb, items in (("Skipped", skipped), ("Cropped", cropped)):
            if items:
                listed = "; ".join(f"{s['path']} (line {s['line']}): {s['reason']}"
                                   for s in items[:3])
                more = (f"; and {len(items) - 3} more: builder.report['{verb.lower()}']"
                        if len(items) > 3 else "")
                emit(f"{verb} {len(items)} of {len(skipped) + len(self.utterances)} utterances: "
                     f"{listed}{more}.", self.verbose)

    def _encode(self, kept):
        """Ids of every transcript: `(values, lengths, reasons)`.

        Encoded `_ENCODE_CHUNK` transcripts at a time, so the string ops'
        temporaries stay small; the ids are held in the smallest integer
        type that fits (uint8 for characters: a million transcripts of
        100 characters are then 100 MB, not 400).
        """
        dtype = next(t for t in (np.uint8, np.uint16, np.int32)
                     if self.text.num_ids <= np.iinfo(t).max + 1)
        values, lengths, reasons = [], [], []
        for start in range(0, len(kept), _ENCODE_CHUNK):
            texts = [kept.string("text", i)
                     for i in range(start, min(start + _ENCODE_CHUNK, len(kept)))]
            ids, chunk_reasons = encode_transcripts(texts, self.text)
            values.append(ids.flat_values.numpy().astype(dtype))
            lengths.append(ids.row_lengths().numpy())
            reasons.extend(chunk_reasons)
        if not values:
            return np.zeros(0, dtype), np.zeros(0, np.int64), reasons
        return np.concatenate(values), np.concatenate(lengths).astype(np.int64), reasons

    @staticmethod
    def _entry(utterances, index, reason):
        """A `report["skipped"]` / `["cropped"]` item for `utterances[index]`."""
        utterance = utterances[index]
        return {"id": utterance.id, "path": utterance.path, "line": utterance.line,
                "reason": reason}

    def fingerprint(self) -> str:
        """Hash of everything that determines the cached features."""
        return fingerprint({
            "version": __version__,
            "cache_format": CACHE_FORMAT,
            "audio": dataclasses.asdict(self.audio),
            "text": self.text.description(),
            "utterances": self.utterances.digest(),
        })

    def _waveform(self):
        """`index -> (samples,)` float32 waveform decoded from the WAV file at
        `audio.sample_rate`, cropped to `max_seconds` with `on_too_long="crop"`
        (TF ops)."""
        path = self.utterances.lookup("path")
        columns = {
            name: tf.constant(self.utterances.column(name), tf.int64)
            for name in ("data_offset", "data_bytes", "format_code", "channels", "sample_rate")
        }

        @tf.autograph.experimental.do_not_convert  # plain TF ops: tracing stays fast
        def waveform(index):
            field = {name: column[index] for name, column in columns.items()}
            samples = audio_lib.decode_wav(
                tf.io.read_file(path(index)), field["data_offset"], field["data_bytes"],
                field["format_code"], field["channels"],
            )
            return audio_lib.crop(
                audio_lib.resample(samples, field["sample_rate"], self.audio.sample_rate),
                self.audio)

        return waveform

    def _compute_features(self):
        """`index -> (frames, num_features)` features computed from the WAV file
        (TF ops), trimmed at the trim pass's bounds when there was one."""
        waveform = self._waveform()
        bounds = None if self._trim_bounds is None else tf.constant(self._trim_bounds)

        @tf.autograph.experimental.do_not_convert  # plain TF ops: tracing stays fast
        def compute(index):
            known = None if bounds is None else (bounds[index, 0], bounds[index, 1])
            return audio_lib.extract_features(waveform(index), self.audio, known)

        return compute

    def _trim_pass(self):
        """Where every utterance's sound starts and ends (`trim_bounds`), one
        parallel pass: int32 `(utterances, 2)`."""
        waveform = self._waveform()
        bounds = _map_on_every_core(
            tf.data.Dataset.range(len(self.utterances)),
            lambda index: tf.stack(audio_lib.trim_bounds(waveform(index), self.audio)),
            deterministic=True,
        )
        return np.stack(list(bounds.as_numpy_iterator())).astype(np.int32)

    def _read_features(self):
        """`index -> (frames, num_features)` features read from the cache."""
        num_features = self.audio.num_features
        path = self._cache.feature_path_tensor

        @tf.autograph.experimental.do_not_convert  # plain TF ops: tracing stays fast
        def read(index):
            features = FeatureCache.decode(tf.io.read_file(path(index)), num_features)
            return tf.ensure_shape(features, [None, num_features])

        return read

    def cache_entry(self):
        """This corpus and config's `FeatureCache` entry, not opened.

        Nothing is read or built (`keras-gpufix cache info|clear` use it);
        None without `cache_dir`.
        """
        if self.cache_dir is None:
            return None
        return FeatureCache(self.cache_dir, self.fingerprint(), len(self.utterances),
                            verbose=self.verbose)

    def prepare(self) -> "SpeechDatasetBuilder":
        """Opens or builds the feature cache.

        Without `cache_dir` there is nothing to build, except with
        `audio.trim_top_db`: one parallel pass then finds where every
        utterance's sound starts and ends, for the length buckets and for
        every epoch's trimming (with a cache the build records the frames).

        Returns:
            The builder; `report["cache"]` is then `"hit"`, `"miss"` or `"off"`.
        """
        if self._prepared:
            return self
        if self.cache_dir is None:
            if self.audio.trim_top_db is not None:
                self._trim_bounds = self._trim_pass()
                self._frames = np.array([self.audio.num_frames(int(end - start))
                                         for start, end in self._trim_bounds], np.int64)
            self.report["cache"] = "off"
            self._prepared = True
            return self
        self._cache = self.cache_entry()
        manifest, status = self._cache.open_or_build(
            self._write_features,
            needed_bytes=FeatureCache.estimate_bytes(self._frames, self.audio.num_features))
        frames = np.array(manifest["frames"], np.int64)
        # With trimming the scan's frame counts are upper bounds; the cache has the real ones.
        if len(frames) != len(self._frames) or (
            np.any(frames > self._frames) if self.audio.trim_top_db is not None
            else np.any(frames != self._frames)
        ):
            raise RuntimeError(f"The feature cache at {self._cache.path} does not match the corpus scan.")
        self._frames = frames
        self._prepared = True
        self.report["cache"] = status
        self.report["cache_path"] = self._cache.path
        return self

    def _write_features(self, paths):
        """Computes and fingerprints features in parallel; writes their
        buffers (`FeatureCache.file_bytes`, no copy) here, in the calling
        thread (after an error or Ctrl-C no parallel writer can put a file
        back into the temporary folder that the cache removes).

        Features that are still not finite (the scan already makes float
        WAVs with NaN, inf or overflowing samples bad input) raise a
        `ValueError` naming the file: the entry is then not committed and
        its temporary folder is removed.
        """
        compute = self._compute_features()

        @tf.autograph.experimental.do_not_convert  # plain TF ops: tracing stays fast
        def encode(index):
            features = compute(index)
            data = FeatureCache.file_bytes(features)
            # A sum of finite features (logs, or normalised) is finite; one NaN or inf is not.
            return (index, tf.shape(features)[0], data, FeatureCache.digest(data),
                    tf.math.is_finite(tf.reduce_sum(features)))

        count = len(self.utterances)
        encoded = _map_on_every_core(tf.data.Dataset.range(count), encode,
                                     deterministic=False)
        emit(f"Computing the features of {count} utterances into {self._cache.path} ...",
             self.verbose)
        update = progress(count, "utterance", self.verbose)
        for done, (index, frames, data, digest, finite) in enumerate(
            encoded.as_numpy_iterator(), start=1
        ):
            if not finite:
                utterance = self.utterances[index]
                raise ValueError(
                    f"The features of {utterance.path} (line {utterance.line}, id "
                    f"{utterance.id!r}) are not finite (NaN or inf). Check the file and the "
                    "audio config, or remove the file; nothing was written to the cache."
                )
            with open(paths[index], "wb") as f:
                f.write(data)  # the uint8 array's buffer
            yield index, frames, data.nbytes, digest
            update(done)

    def build(self, batch_size=None, num_buckets=8, shuffle=True, seed=None,
              drop_remainder=False, prefetch_to_device=None, service=None,
              deterministic=None, batch_frames=None, batch_multiple=None,
              as_dict=False) -> tf.data.Dataset:
        """Returns the training dataset.

        Args:
            batch_size: utterances per batch; with `batch_frames` the
                largest batch (None: no cap). Under a distribution strategy
                this is the global batch. Defaults to None (then
                `batch_frames` is needed).
            num_buckets: length buckets; an epoch has at most this many
                batch shapes, plus one for the partial batch unless
                `drop_remainder`. Defaults to 8.
            shuffle: draw bucket members and batch order anew each epoch.
                Defaults to True.
            seed: makes the shuffling reproducible. Defaults to None (a
                new draw each run; under a multi-worker cluster the seed
                every worker derives alike, `keras_gpufix.distribute.cluster_seed()`,
                so each utterance is read once per epoch across workers).
            drop_remainder: leave out the one partial batch. Defaults to
                False.
            prefetch_to_device: a device string (e.g. `"/gpu:0"`) for
                single-device training; applied last. Ignored, with a
                warning, inside a distribution strategy scope (Keras
                distributes the dataset and fetches to the devices).
                Defaults to None.
            service: `"grpc://host:port"` of a tf.data service dispatcher:
                loading and batching run on its workers
                (`distributed_epoch`, each batch produced once per epoch);
                each epoch draws new bucket members and batch order here
                and sends that epoch's pipeline to the service
                (`keras_gpufix.data_service.service_epochs`). Start the servers with
                `keras-gpufix data-service`; workers must see the corpus
                (or cache) paths. Defaults to None.
            deterministic: passed to the parallel `map`; None keeps
                `tf.data.Options.deterministic`. Defaults to None.
            batch_frames: batches by audio budget (NeMo/Lhotse's
                `batch_duration`): each bucket's batch size becomes
                `batch_frames // boundary` (at most `batch_size`), so every
                batch holds at most `batch_frames` padded feature frames
                (`audio.frames_per_second` frames a second) and short
                clips come in larger batches; still one shape per bucket.
                Under a distribution strategy the budget is global, like
                `batch_size`: each batch is split across the replicas, so
                a replica gets about `batch_frames / num_replicas` frames;
                pass `batch_multiple=num_replicas` (or a multiple of it) for
                even splits. Defaults to None (`batch_size` for every
                bucket).
            batch_multiple: with `batch_frames`, round each bucket's batch
                size down to a multiple of this (8 suits GPU kernels) where
                one fits the budget. Defaults to None.
            as_dict: yield named batches (see Returns). Defaults to False.

        Returns:
            A `tf.data.Dataset` of `((text_ids, text_len), (mel, mel_len))`:
            int32 `(B, T_text)` (0-padded), int32 `(B,)`, float32
            `(B, T_frames, audio.num_features)` (padded with
            `audio.padding_value`), int32 `(B,)`. With `as_dict=True`, dicts
            with the same tensors as
            `tokens`, `tokens_len`, `features`, `features_len`, plus `id`
            (string `(B,)`, the corpus ids) and, when the corpus has them,
            `speaker` and `language` (int32 `(B,)`, indices into
            `report["speakers"]` / `report["languages"]`; -1 for an
            utterance without one).

        Raises:
            ValueError: for invalid arguments, and when `batch_frames`
                cannot hold the longest utterance.
        """
        self.check_build_args(batch_size, num_buckets, service, batch_frames, batch_multiple)
        self.prepare()
        if shuffle and seed is None:
            seed = cluster_seed()  # workers must draw the same epoch: Keras splits each batch
        plan = self.plan(batch_size, num_buckets, batch_frames, drop_remainder, batch_multiple)
        self.report.update(
            bucket_boundaries=plan.boundaries.tolist(),
            text_boundaries=plan.text_boundaries.tolist(),
            batch_sizes=plan.bucket_sizes.tolist(),
            batches_per_epoch=plan.num_batches,
            padding_efficiency=round(plan.padding_efficiency, 4),
            text_padding_efficiency=round(plan.text_padding_efficiency, 4),
            distinct_shapes=len(plan.shapes),
            remainder=len(self.utterances) - sum(len(s) for s in plan.batch_slots),
            shuffle_seed=seed if shuffle else None,
        )
        features = self._compute_features() if self._cache is None else self._read_features()

        def batches(elements):
            if self._cache is None:  # features computed here, every epoch
                loaded = _map_on_every_core(elements, self._loader(features), deterministic)
            else:
                loaded = elements.map(self._loader(features), num_parallel_calls=AUTOTUNE,
                                      deterministic=deterministic)
            window = plan.max_batch + 1
            return loaded.group_by_window(
                key_func=lambda key, *_: key,
                reduce_func=lambda key, batch: batch.batch(window),
                window_size_func=lambda key: key % window,
            ).map(self._batch_layout(as_dict))

        if service:
            dataset = service_epochs(lambda draw: batches(plan.static_dataset(shuffle, draw)),
                                     service, seed)
        else:
            dataset = batches(plan.epoch_dataset(shuffle, seed))
        # Known cardinality: Keras shows progress and does not warn that the
        # input "ran out of data" at the end of the first epoch.
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(plan.num_batches))
        if prefetch_to_device is not None and tf.distribute.has_strategy():
            warn(
                f"`prefetch_to_device={prefetch_to_device!r}` is ignored inside a "
                "distribution strategy scope: Keras distributes the dataset and fetches "
                "batches to each replica itself. Build without prefetch_to_device."
            )
            prefetch_to_device = None
        self.report["prefetch_to_device"] = prefetch_to_device
        dataset = instrument(dataset, frames=self._feature_lengths(as_dict),
                             frames_per_second=self.audio.frames_per_second)
        probe = dataset.input_probe
        if prefetch_to_device is not None:
            dataset = dataset.apply(tf.data.experimental.prefetch_to_device(prefetch_to_device))
        else:
            dataset = dataset.prefetch(AUTOTUNE)
        dataset.input_probe = probe
        return dataset

    check_build_args = staticmethod(check_build_args)

    def plan(self, batch_size=None, num_buckets=8, batch_frames=None, drop_remainder=False,
             batch_multiple=None) -> BucketPlan:
        """The length buckets and batches of an epoch (`build`'s arguments),
        from the frame counts known now (after `prepare()`, the trimmed
        ones); no feature is computed, no dataset made.

        Raises:
            ValueError: for invalid arguments, when `batch_frames` cannot
                hold the longest utterance, and when there is no batch.
        """
        plan = BucketPlan(self._frames, self._text_lengths, batch_size, num_buckets,
                          batch_frames, drop_remainder, batch_multiple)
        if plan.num_batches == 0:
            raise ValueError(
                f"No batch to build: {len(self.utterances)} utterances with "
                f"batch_size={batch_size} and drop_remainder=True."
            )
        return plan

    def _loader(self, features):
        """Loads one utterance and pads it to its batch's shape."""
        text_values = self._text_values
        text_splits = tf.constant(self._text_splits)
        mel_pad = self.audio.padding_value
        num_features = self.audio.num_features

        @tf.autograph.experimental.do_not_convert  # plain TF ops: tracing stays fast
        def load(utterance, key, pad_frames, pad_text):
            mel = features(utterance)
            mel_len = tf.shape(mel)[0]
            mel = tf.pad(mel, [[0, tf.cast(pad_frames, tf.int32) - mel_len], [0, 0]],
                         constant_values=mel_pad)
            ids = tf.cast(text_values[text_splits[utterance]:text_splits[utterance + 1]], tf.int32)
            text_len = tf.shape(ids)[0]
            ids = tf.pad(ids, [[0, tf.cast(pad_text, tf.int32) - text_len]])
            return key, utterance, ids, text_len, tf.ensure_shape(mel, [None, num_features]), mel_len

        return load

    @staticmethod
    def _feature_lengths(as_dict):
        """Batch of the user's layout -> its unpadded feature lengths (for the monitors)."""
        if as_dict:
            return lambda batch: batch["features_len"]
        return lambda batch: batch[1][1]

    def _batch_layout(self, as_dict):
        """Batched `(key, utterance, ids, text_len, mel, mel_len)` -> the user's layout."""
        if not as_dict:
            return lambda key, utterance, ids, text_len, mel, mel_len: ((ids, text_len), (mel, mel_len))
        names = self.utterances.lookup("id")
        labels = {name: tf.constant(values) for name, values in self._labels.items()}

        def named(key, utterance, ids, text_len, mel, mel_len):
            batch = {"id": names(utterance), "tokens": ids, "tokens_len": text_len,
                     "features": mel, "features_len": mel_len}
            batch.update({name: tf.gather(values, utterance) for name, values in labels.items()})
            return batch

        return named
