"""Train a small Transformer-TTS (text -> log-mel) with plain `model.fit`, the fast way.

    python examples/train_tts.py --output runs/tts                  # generated corpus
    python examples/train_tts.py --corpus data/LJSpeech-1.1 --output runs/lj
    python examples/train_tts.py --output runs/tts --epochs 6       # resumes at epoch 4

Every piece of keras_gpufix in one script:

- `kg.setup_strategy()` picks the distribution strategy (default strategy on
  CPU, `OneDeviceStrategy` on one GPU, `MirroredStrategy` on two);
- `kg.enable_mixed_precision()` sets the dtype policy before the model is
  built, `kg.compile_model` compiles with XLA and a measured
  `steps_per_execution`;
- `kg.data.SpeechDatasetBuilder` turns the corpus into bucketed batches of
  `((text_ids, text_len), (mel, mel_len))` from a persistent feature cache;
- `kg.StepTimer`, `kg.GPUOscillationMonitor`, `kg.RetracingMonitor` and
  `kg.ProfilerTrigger` watch the run (TensorBoard scalars and traces under
  `OUTPUT/logs`).

The model is a Transformer-TTS-style encoder/decoder trained with teacher
forcing: a character encoder (self-attention with a key-padding mask from
`text_len`), a decoder that predicts `reduction` mel frames per step from the
previous frames (causal self-attention, cross-attention to the text), and a
convolutional post-net. The L1 loss counts only real frames: the padding is
masked out by `mel_len` through the sample weights.

The checkpoint (`OUTPUT/checkpoint/`, weights with optimizer state and the
epoch reached, by `keras.callbacks.BackupAndRestore`) is written at every
epoch end; running the same command again with a larger `--epochs` resumes
from it, and loads its XLA compiles from `OUTPUT/cache/xla` (`CompileCache`,
turned on before TensorFlow starts) instead of compiling them again. The
trained model is saved as `OUTPUT/tts.keras` and the loss per epoch as
`OUTPUT/history.json`.
"""

import argparse
import json
import math
import os
import sys
import time

import keras
import tensorflow as tf
from keras import layers, ops

import keras_gpufix as kg
from keras_gpufix.compile import CompileCache

MEL_OFFSET = 5.0  # log-mel of speech lies around -11.5 (floor) .. 2; centre it near 0


@keras.saving.register_keras_serializable(package="train_tts")
class PositionalEncoding(layers.Layer):
    """Adds a sinusoidal position encoding scaled by a trained `alpha`."""

    def build(self, input_shape):
        self.alpha = self.add_weight(shape=(), initializer="ones", name="alpha")

    def call(self, x):
        length, dim = ops.shape(x)[1], x.shape[-1]
        position = ops.cast(ops.arange(length), "float32")[:, None]
        rate = ops.exp(ops.arange(0, dim, 2, dtype="float32") * (-math.log(10000.0) / dim))
        angles = position * rate[None, :]
        encoding = ops.reshape(ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1),
                               (length, dim))
        return x + ops.cast(self.alpha * encoding, x.dtype)[None]


@keras.saving.register_keras_serializable(package="train_tts")
class LengthMask(layers.Layer):
    """`(lengths (B,), sequence (B, T, ...)) -> (B, T)` bool, True on real positions.

    With `reduction > 1` positions are groups of `reduction` frames.
    """

    def __init__(self, reduction=1, **kwargs):
        super().__init__(**kwargs)
        self.reduction = reduction

    def call(self, lengths, sequence):
        groups = (lengths + self.reduction - 1) // self.reduction
        return ops.arange(ops.shape(sequence)[1])[None, :] < groups[:, None]

    def get_config(self):
        return {**super().get_config(), "reduction": self.reduction}


@keras.saving.register_keras_serializable(package="train_tts")
class FrameGroups(layers.Layer):
    """`(B, T, n_mels) -> (B, ceil(T / r), r * n_mels)`: `r` frames per decoder step.

    Also returns the teacher-forcing input: for each group, the last frame of
    the previous group (a zero "go" frame for the first), shifted and
    centred.
    """

    def __init__(self, reduction, **kwargs):
        super().__init__(**kwargs)
        self.reduction = reduction

    def call(self, mel):
        r, n_mels = self.reduction, mel.shape[-1]
        frames = ops.shape(mel)[1]
        groups = (frames + r - 1) // r
        mel = ops.pad(mel, [[0, 0], [0, groups * r - frames], [0, 0]],
                      constant_values=-MEL_OFFSET)
        grouped = ops.reshape(mel, (-1, groups, r * n_mels))
        previous = grouped[:, :-1, -n_mels:] + MEL_OFFSET
        go = ops.zeros_like(grouped[:, :1, -n_mels:])
        return ops.concatenate([go, previous], axis=1)

    def get_config(self):
        return {**super().get_config(), "reduction": self.reduction}


@keras.saving.register_keras_serializable(package="train_tts")
class UngroupFrames(layers.Layer):
    """`(B, G, r * n_mels)` and the target `(B, T, n_mels)` -> `(B, T, n_mels)`."""

    def __init__(self, reduction, n_mels, **kwargs):
        super().__init__(**kwargs)
        self.reduction = reduction
        self.n_mels = n_mels

    def call(self, grouped, mel):
        frames = ops.reshape(grouped, (ops.shape(grouped)[0], -1, self.n_mels))
        return frames[:, : ops.shape(mel)[1]] - MEL_OFFSET

    def get_config(self):
        return {**super().get_config(), "reduction": self.reduction, "n_mels": self.n_mels}


@keras.saving.register_keras_serializable(package="train_tts")
class AttentionMask(layers.Layer):
    """`(query_mask (B, Tq), key_mask (B, Tk))` bool -> `(B, Tq, Tk)`; optionally causal."""

    def __init__(self, causal=False, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal

    def call(self, query_mask, key_mask):
        mask = ops.logical_and(query_mask[:, :, None], key_mask[:, None, :])
        if self.causal:
            tq, tk = ops.shape(query_mask)[1], ops.shape(key_mask)[1]
            order = ops.arange(tk)[None, :] <= ops.arange(tq)[:, None]
            mask = ops.logical_and(mask, order[None])
        return mask

    def get_config(self):
        return {**super().get_config(), "causal": self.causal}


def _block(x, mask, d_model, heads, ff, dropout, name, memory=None, memory_mask=None):
    """Pre-norm Transformer block: self-attention, optional cross-attention, FFN."""
    h = layers.LayerNormalization(name=f"{name}_ln1")(x)
    h = layers.MultiHeadAttention(heads, d_model // heads, dropout=dropout,
                                  name=f"{name}_self")(h, h, attention_mask=mask)
    x = layers.Add()([x, h])
    if memory is not None:
        h = layers.LayerNormalization(name=f"{name}_ln2")(x)
        h = layers.MultiHeadAttention(heads, d_model // heads, dropout=dropout,
                                      name=f"{name}_cross")(h, memory, attention_mask=memory_mask)
        x = layers.Add()([x, h])
    h = layers.LayerNormalization(name=f"{name}_ln3")(x)
    h = layers.Dense(ff, activation="relu", name=f"{name}_ff1")(h)
    h = layers.Dense(d_model, name=f"{name}_ff2")(layers.Dropout(dropout)(h))
    return layers.Add()([x, h])


def build_model(vocab_size, n_mels=80, d_model=64, heads=2, encoder_layers=2,
                decoder_layers=2, ff=256, reduction=4, dropout=0.1, postnet_channels=0):
    """The text-to-mel model.

    Inputs `(text_ids (B, T_text) int32, text_len (B,), mel (B, T, n_mels),
    mel_len (B,))`; output the predicted mel `(B, T, n_mels)` float32 (the
    input mel is only used shifted, for teacher forcing).
    """
    text_ids = keras.Input((None,), dtype="int32", name="text_ids")
    text_len = keras.Input((), dtype="int32", name="text_len")
    mel = keras.Input((None, n_mels), dtype="float32", name="mel")
    mel_len = keras.Input((), dtype="int32", name="mel_len")

    x = layers.Embedding(vocab_size, d_model, name="char_embedding")(text_ids)
    x = PositionalEncoding(name="encoder_position")(x)
    text_mask = LengthMask(name="text_mask")(text_len, text_ids)
    enc_mask = AttentionMask(name="encoder_mask")(text_mask, text_mask)
    for i in range(encoder_layers):
        x = _block(x, enc_mask, d_model, heads, ff, dropout, name=f"encoder{i}")
    memory = layers.LayerNormalization(name="encoder_norm")(x)

    previous = FrameGroups(reduction, name="teacher_forcing")(mel)
    y = layers.Dense(d_model, activation="relu", name="prenet1")(previous)
    prenet_dropout = max(0.5, dropout) if dropout else 0.0
    y = layers.Dropout(prenet_dropout, name="prenet_dropout1")(y)
    y = layers.Dense(d_model, activation="relu", name="prenet2")(y)
    y = layers.Dropout(prenet_dropout, name="prenet_dropout2")(y)
    y = PositionalEncoding(name="decoder_position")(y)
    group_mask = LengthMask(reduction, name="frame_mask")(mel_len, y)
    self_mask = AttentionMask(causal=True, name="decoder_mask")(group_mask, group_mask)
    cross_mask = AttentionMask(name="cross_mask")(group_mask, text_mask)
    for i in range(decoder_layers):
        y = _block(y, self_mask, d_model, heads, ff, dropout, name=f"decoder{i}",
                   memory=memory, memory_mask=cross_mask)
    y = layers.LayerNormalization(name="decoder_norm")(y)
    grouped = layers.Dense(reduction * n_mels, dtype="float32", name="mel_projection")(y)
    coarse = UngroupFrames(reduction, n_mels, name="ungroup")(grouped, mel)

    out = coarse
    if postnet_channels:
        p = coarse
        for i in range(2):
            p = layers.Conv1D(postnet_channels, 5, padding="same", activation="tanh",
                              name=f"postnet{i}")(p)
        p = layers.Conv1D(n_mels, 5, padding="same", dtype="float32", name="postnet_out")(p)
        out = layers.Add(dtype="float32", name="mel_out")([coarse, p])
    return keras.Model([text_ids, text_len, mel, mel_len], out, name="tiny_transformer_tts")


def to_training_batches(dataset):
    """`((ids, text_len), (mel, mel_len))` -> `((ids, text_len, mel, mel_len), mel, weight)`.

    `weight` is 1 on real frames and 0 on padding, scaled so that Keras's
    default loss reduction (sum over the batch's B x T entries) gives the
    mean over real frames only.
    """

    def arrange(text, audio):
        (ids, text_len), (mel, mel_len) = text, audio
        mask = tf.sequence_mask(mel_len, tf.shape(mel)[1], dtype=tf.float32)
        weight = mask * tf.cast(tf.size(mask), tf.float32) / tf.reduce_sum(mask)
        return (ids, text_len, mel, mel_len), mel, weight

    return dataset.map(arrange, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def make_builder(args):
    """The corpus (generated unless `--corpus`) and its dataset builder."""
    corpus = args.corpus
    if corpus is None:
        corpus = os.path.join(args.output, "corpus")
        if not os.path.exists(os.path.join(corpus, "metadata.csv")):
            print(f"Generating {args.utterances} utterances into {corpus} ...")
            kg.data.make_synthetic_corpus(corpus, args.utterances, seed=args.seed,
                                min_seconds=args.min_seconds, max_seconds=args.max_seconds)
    audio = kg.data.AudioConfig(sample_rate=22050, n_mels=args.n_mels,
                                max_seconds=args.max_seconds if args.corpus else None)
    return kg.data.SpeechDatasetBuilder(corpus, audio=audio,
                                        cache_dir=os.path.join(args.output, "cache"),
                                        on_bad_input="skip", verbose=args.verbose)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="LJSpeech-format folder (default: a generated one)")
    parser.add_argument("--output", default="runs/tts", help="checkpoint, cache, logs, model")
    parser.add_argument("--epochs", type=int, default=4, help="total epochs (resume included)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per epoch (default: one pass over the corpus)")
    parser.add_argument("--batch-size", type=int, default=16, help="per replica")
    parser.add_argument("--num-buckets", type=int, default=4)
    parser.add_argument("--utterances", type=int, default=160, help="generated corpus size")
    parser.add_argument("--min-seconds", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=4.0)
    parser.add_argument("--n-mels", type=int, default=80)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2, help="encoder and decoder blocks each")
    parser.add_argument("--reduction", type=int, default=4, help="mel frames per decoder step")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="attention/FFN dropout; the prenet uses max(0.5, this) unless 0")
    parser.add_argument("--postnet-channels", type=int, default=0,
                        help="convolutional post-net width (0: none; see the module docstring)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--mixed-precision", default="auto",
                        help='dtype policy for kg.enable_mixed_precision ("auto", "float32", ...)')
    parser.add_argument("--steps-per-execution", default="auto",
                        help='"auto" (measured by kg.compile_model) or an integer')
    parser.add_argument("--profile-step", type=int, default=None,
                        help="also take a profiler trace at this global step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=1)
    args = parser.parse_args(argv)
    if args.steps_per_execution != "auto":
        args.steps_per_execution = int(args.steps_per_execution)
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    # before TensorFlow starts (it reads TF_XLA_FLAGS once): XLA compiles kept beside the
    # feature cache, so a restarted or resumed run loads them instead of compiling
    compile_cache = CompileCache.enable(beside=os.path.join(args.output, "cache"))
    kept = {e["name"] for e in compile_cache.entries()}
    keras.utils.set_random_seed(args.seed)

    strategy = kg.setup_strategy()
    policy = kg.enable_mixed_precision(args.mixed_precision)  # before the model is built
    builder = make_builder(args)
    batch_size = kg.global_batch_size(args.batch_size, strategy)
    train = builder.build(batch_size=batch_size, num_buckets=args.num_buckets,
                          drop_remainder=True, seed=args.seed)
    report = builder.report
    print(f"Data: {report['utterances']} utterances ({report['seconds']:.0f} s), "
          f"{len(report['skipped'])} skipped, cache {report['cache']}, "
          f"{report['distinct_shapes']} batch shapes, padding efficiency "
          f"{report['padding_efficiency']:.2f}, {report['batches_per_epoch']} batches/epoch")
    train = to_training_batches(train).repeat()
    steps_per_epoch = args.steps or report["batches_per_epoch"]

    # Callbacks fire once per execution: keep >= 8 observations per epoch for the
    # monitors (under 16 steps an epoch that is 1: nothing to calibrate).
    cap = max(1, steps_per_epoch // 8)
    with strategy.scope():
        model = build_model(len(builder.text.vocabulary) + 2, n_mels=args.n_mels,
                            d_model=args.d_model, heads=2, encoder_layers=args.layers,
                            decoder_layers=args.layers, ff=4 * args.d_model,
                            reduction=args.reduction, dropout=args.dropout,
                            postnet_channels=args.postnet_channels)
        compiled = kg.compile_model(
            model, keras.optimizers.Adam(args.learning_rate, clipnorm=1.0), "mae",
            mixed_precision=policy,
            steps_per_execution=1 if cap == 1 else args.steps_per_execution,
            sample_batch=train,
        )
    print(f"Model: {model.count_params():,} parameters; compile_model: "
          + str(compiled).replace("\n", "; "))
    if model.steps_per_execution > cap:
        print(f"steps_per_execution {model.steps_per_execution} -> {cap} "
              f"({steps_per_epoch} steps per epoch)")
        model.steps_per_execution = cap
        model.make_train_function(force=True)  # Keras bakes the value into its train function

    log_dir = os.path.join(args.output, "logs")
    profile_trigger = ["oscillation"] + ([args.profile_step] if args.profile_step is not None
                                          else [])
    monitor = kg.GPUOscillationMonitor(log_dir=log_dir, window=32)
    timer = kg.StepTimer(log_dir=log_dir, warmup=2)
    retracing = kg.RetracingMonitor(max_new_shapes=args.num_buckets + 1)
    profiler = kg.ProfilerTrigger(log_dir, trigger=profile_trigger, steps=5, max_traces=2)
    checkpoint = keras.callbacks.BackupAndRestore(os.path.join(args.output, "checkpoint"),
                                                  delete_checkpoint=False)
    start = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
                        shuffle=False,  # the builder shuffles; fit cannot shuffle a dataset
                        verbose=2 if args.verbose else 0,
                        callbacks=[checkpoint, timer, monitor, retracing, profiler])
    seconds = time.perf_counter() - start

    model.save(os.path.join(args.output, "tts.keras"))
    record = _update_history(args.output, history)
    summary = timer.summary()
    verdict = monitor.report()
    print(json.dumps({
        "epochs_run": history.epoch,
        "loss": [round(v, 4) for v in history.history.get("loss", [])],
        "fit_seconds": round(seconds, 1),
        "samples_per_s": summary.get("samples_per_s"),
        "audio_seconds_per_s": summary.get("audio_seconds_per_s"),
        "real_frames_per_s": summary.get("real_frames_per_s"),
        "verdict": verdict["verdict"],
        "input_wait": verdict["input_wait"],
        "retracing": {k: retracing.report().get(k) for k in ("trace_count", "recompile_ms")},
        "traces": [t["path"] for t in profiler.traces],
        "history": record,
        # compiles this run added to the cache (fresh); the others it loaded from there
        "compile_cache": {"directory": compile_cache.directory,
                          "fresh": len({e["name"] for e in compile_cache.entries()} - kept)},
    }, default=str))
    return 0


def _update_history(output, history):
    """Appends this run's epochs to OUTPUT/history.json; returns the whole record."""
    path = os.path.join(output, "history.json")
    record = {"epoch": [], "loss": []}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    for epoch, loss in zip(history.epoch, history.history.get("loss", [])):
        record["epoch"].append(int(epoch))
        record["loss"].append(float(loss))
    with open(path, "w") as f:
        json.dump(record, f)
    return record


if __name__ == "__main__":
    sys.exit(main())
