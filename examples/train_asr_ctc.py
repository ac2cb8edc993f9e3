"""Train a small CTC speech recogniser (linear spectrogram -> characters) from a manifest.

    python examples/train_asr_ctc.py --output runs/asr                     # generated corpus
    python examples/train_asr_ctc.py --manifest data/train.jsonl --output runs/asr

The recipe of keras-io's "CTC ASR" on the keras_gpufix input path:

- the corpus is a JSON Lines manifest (NeMo's convention: `audio_filepath`
  relative to the manifest, `text`, optional `speaker`, ...); without
  `--manifest` one is written next to a small generated corpus;
- `corpus.split(val_fraction)` holds out a validation set by hashing ids
  (the same utterances every run, whatever is added to the manifest);
- `kg.data.SpeechDatasetBuilder` computes linear spectrograms (log
  `|STFT|`, `n_fft // 2 + 1` bins, normalised per utterance, padded with 0)
  once into a feature cache and yields bucketed named batches (`build(as_dict=True)`:
  `features`, `features_len`, `tokens`, `tokens_len`, `id`, ...);
- the model (two 1-D convolutions, the first with stride 2, then a
  character classifier; id 0, the padding id, is the CTC blank) is compiled
  by `kg.compile_model` with XLA; the CTC loss counts only real frames and
  tokens (`features_len`, `tokens_len`);
- after training, greedy CTC decoding gives the character error rate on the
  validation split.

The last line printed is a JSON summary (loss per epoch, validation CER,
batch shapes); the trained model is saved as `OUTPUT/asr.keras`.
"""

import argparse
import json
import os
import sys

import keras
from keras import layers, ops

import keras_gpufix as kg

STRIDE = 2


@keras.saving.register_keras_serializable(package="train_asr_ctc")
class CTCModel(keras.Model):
    """A functional model whose loss is CTC over the real frames and tokens."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        frames = (y["features_len"] + STRIDE - 1) // STRIDE
        loss = ops.ctc_loss(y["tokens"], ops.cast(y_pred, "float32"), y["tokens_len"], frames,
                            mask_index=0)
        return ops.mean(loss)


def build_model(num_features, num_ids, width):
    features = keras.Input((None, num_features), name="features")
    x = layers.Conv1D(width, 5, strides=STRIDE, padding="same", activation="gelu")(features)
    x = layers.LayerNormalization()(x)
    x = layers.Conv1D(width, 5, padding="same", activation="gelu")(x)
    logits = layers.Dense(num_ids)(x)
    return CTCModel(features, logits, name="asr_ctc")


def split_batch(batch):
    """Named batch -> (model inputs, loss targets)."""
    targets = {name: batch[name] for name in ("tokens", "tokens_len", "features_len")}
    return batch["features"], targets


def write_manifest(folder, utterances, seed):
    """A generated corpus and a manifest of it with relative paths and two speakers."""
    corpus = kg.data.make_synthetic_corpus(os.path.join(folder, "corpus"), utterances, seed=seed,
                                           sample_rate=16000, min_seconds=1.0, max_seconds=2.0)
    path = os.path.join(folder, "train.jsonl")
    with open(os.path.join(corpus, "metadata.csv"), encoding="utf-8") as f, \
            open(path, "w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            uid, text, _ = line.rstrip("\n").split("|")
            item = {"audio_filepath": os.path.join("corpus", "wavs", uid + ".wav"), "text": text,
                    "speaker": ("a", "b")[i % 2]}
            out.write(json.dumps(item) + "\n")
    return path


def edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def character_error_rate(model, dataset):
    errors = total = 0
    for batch in dataset:
        logits = model(batch["features"], training=False)
        frames = (batch["features_len"] + STRIDE - 1) // STRIDE
        decoded = ops.convert_to_numpy(ops.ctc_decode(logits, frames, strategy="greedy",
                                                      mask_index=0)[0][0])
        for i, length in enumerate(batch["tokens_len"].numpy()):
            target = batch["tokens"][i, :length].numpy().tolist()
            errors += edit_distance([t for t in decoded[i] if t > 0], target)
            total += length
    return errors / max(total, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", help="JSON Lines manifest (default: a generated corpus)")
    parser.add_argument("--output", default="runs/asr_ctc")
    parser.add_argument("--utterances", type=int, default=64, help="of the generated corpus")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-buckets", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output, exist_ok=True)
    manifest = args.manifest or write_manifest(args.output, args.utterances, args.seed)

    train_corpus, val_corpus = kg.data.Corpus.from_manifest(manifest).split(args.val_fraction,
                                                                            seed=args.seed)
    # keras-io's CTC ASR features: log |STFT| (257 bins), normalised per utterance, padded with 0
    audio = kg.data.AudioConfig(sample_rate=16000, n_fft=512, hop_length=160, win_length=400,
                                features="linear", feature_norm="utterance", pad_value=0.0)
    text = kg.data.TextConfig()
    cache_dir = os.path.join(args.output, "cache")
    train_builder = kg.data.SpeechDatasetBuilder(train_corpus, audio=audio, text=text,
                                                 cache_dir=cache_dir)
    val_builder = kg.data.SpeechDatasetBuilder(val_corpus, audio=audio, text=text,
                                               cache_dir=cache_dir, verbose=0)
    train = train_builder.build(args.batch_size, args.num_buckets, seed=args.seed,
                                drop_remainder=True, as_dict=True)
    val = val_builder.build(args.batch_size, 1, shuffle=False, as_dict=True)

    model = build_model(audio.num_features, text.num_ids, args.width)
    inputs = train.map(split_batch)
    kg.compile_model(model, keras.optimizers.Adam(args.learning_rate), loss=None,
                     mixed_precision="float32", steps_per_execution=1)
    history = model.fit(inputs, validation_data=val.map(split_batch), epochs=args.epochs,
                        shuffle=False,  # the builder shuffles; fit cannot shuffle a dataset
                        verbose=2)
    model.save(os.path.join(args.output, "asr.keras"))
    summary = {
        "loss": [round(v, 4) for v in history.history["loss"]],
        "val_loss": [round(v, 4) for v in history.history["val_loss"]],
        "val_cer": round(character_error_rate(model, val), 4),
        "train_utterances": train_builder.report["utterances"],
        "val_utterances": val_builder.report["utterances"],
        "speakers": train_builder.report["speakers"],
        "batch_shapes": train_builder.report["distinct_shapes"],
        "padding_efficiency": train_builder.report["padding_efficiency"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
