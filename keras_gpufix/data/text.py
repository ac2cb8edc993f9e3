"""Transcript normalisation and character ids in TensorFlow string ops.

`TextConfig` says how transcripts become ids; `encode_text(texts, config)`
maps a batch of strings to a `tf.RaggedTensor` of int32 ids with
`tf.strings` and a `tf.lookup` table only (no Python per element). The
builder calls it once over the whole corpus, vectorised.

Normalisation, in order (each step can be turned off):

1. `lowercase`: Unicode lower case (`tf.strings.lower(encoding="utf-8")`).
2. punctuation: curly quotes become `'` or `"`, en/em dashes `-`,
   `…` becomes `...`.
3. `expand_abbreviations`: `mr.` -> `mister`, `dr.` -> `doctor`, ... (the
   LJSpeech/Tacotron list in `ABBREVIATIONS`, whole words only).
4. `expand_digits`: every digit is spelled out (`42` -> `four two`);
   corpora with numbers that should be read as numbers need a normalised
   transcript (LJSpeech's third column, which `Corpus` uses by default).
5. whitespace runs become one space; leading and trailing space goes.

Ids: 0 is padding; `vocabulary[i]` is id `i + 1`. Characters not in the
vocabulary follow `unknown`: `"drop"` removes them, `"oov"` maps them all to
one id, `len(vocabulary) + 1`.

A recipe's own tokenizer (a phonemizer, a keras-hub tokenizer) replaces all
of that: `TextConfig(tokenizer=fn, vocab_size=N)` calls `fn(transcript)`
once per transcript when the corpus is scanned (never per epoch), and its
ids reach the batches unchanged; padding positions hold 0 (mask them with
the lengths). `encode_transcripts` is what the builder calls: ids of every
transcript and, for each, why it is unusable (or None).
"""

import numpy as np
import tensorflow as tf

from keras_gpufix.data.text_config import DEFAULT_VOCABULARY, TextConfig

__all__ = ["TextConfig", "normalize_text", "encode_text", "encode_transcripts", "ABBREVIATIONS",
           "DEFAULT_VOCABULARY"]

ABBREVIATIONS = (
    ("mrs", "misess"),
    ("mr", "mister"),
    ("drs", "doctors"),
    ("dr", "doctor"),
    ("st", "saint"),
    ("co", "company"),
    ("jr", "junior"),
    ("maj", "major"),
    ("gen", "general"),
    ("rev", "reverend"),
    ("lt", "lieutenant"),
    ("hon", "honorable"),
    ("sgt", "sergeant"),
    ("capt", "captain"),
    ("esq", "esquire"),
    ("ltd", "limited"),
    ("col", "colonel"),
    ("ft", "fort"),
)
_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_PUNCTUATION = (("[‘’`´]", "'"), ("[“”„]", '"'), ("[–—]", "-"), ("…", "..."))


def normalize_text(texts, config: TextConfig = TextConfig()) -> tf.Tensor:
    """Normalises a string tensor of any shape (see the module docstring)."""
    texts = tf.convert_to_tensor(texts, tf.string)
    if config.lowercase:
        texts = tf.strings.lower(texts, encoding="utf-8")
    for pattern, replacement in _PUNCTUATION:
        texts = tf.strings.regex_replace(texts, pattern, replacement)
    if config.expand_abbreviations:
        for short, long in ABBREVIATIONS:
            flags = "" if config.lowercase else "(?i)"
            texts = tf.strings.regex_replace(texts, rf"{flags}\b{short}\.", long)
    if config.expand_digits:
        for digit, word in enumerate(_DIGITS):
            texts = tf.strings.regex_replace(texts, str(digit), f" {word} ")
    texts = tf.strings.regex_replace(texts, r"\s+", " ")
    return tf.strings.strip(texts)


def encode_text(texts, config: TextConfig = TextConfig()) -> tf.RaggedTensor:
    """Normalised character ids of a 1-D batch of strings.

    Args:
        texts: 1-D string tensor or list of str.
        config: a `TextConfig`.

    Returns:
        int32 `tf.RaggedTensor` `(batch, None)`.
    """
    # Code points (4 bytes a character), not one tf.string per character.
    chars = tf.strings.unicode_decode(normalize_text(texts, config), "UTF-8")
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant([ord(c) for c in config.vocabulary], tf.int64),
            tf.range(1, len(config.vocabulary) + 1, dtype=tf.int32),
        ),
        default_value=-1,
    )
    ids = tf.ragged.map_flat_values(lambda codes: table.lookup(tf.cast(codes, tf.int64)), chars)
    if config.unknown == "oov":
        return tf.ragged.map_flat_values(
            lambda x: tf.where(x < 0, len(config.vocabulary) + 1, x), ids
        )
    return tf.ragged.boolean_mask(ids, ids >= 0)


def _tokenize(text, config):
    """`(ids, reason)` of one transcript through the user's tokenizer."""
    try:
        ids = np.asarray(config.tokenizer(text))
    except Exception as exc:  # the user's tokenizer: report, never crash the scan
        return None, f"tokenizer raised {type(exc).__name__}: {exc}"
    if ids.ndim != 1 or ids.size == 0:
        return None, f"tokenizer returned {ids.size} ids in shape {ids.shape} (expected a non-empty 1-D list)"
    if not np.issubdtype(ids.dtype, np.integer):
        return None, f"tokenizer returned {ids.dtype} values (expected integer ids)"
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        return None, f"tokenizer returned id {int(bad[0])} outside [0, vocab_size={config.vocab_size})"
    return ids.astype(np.int32), None


def encode_transcripts(texts, config: TextConfig = TextConfig()):
    """Ids of every transcript, and why each one is unusable (or None).

    Characters go through `encode_text` in one vectorised call (the
    builder calls it on chunks of a few thousand, so the string ops'
    temporaries stay small at a million transcripts); a `config.tokenizer`
    is called once per transcript. A transcript is
    unusable when it has no id, when the tokenizer fails or returns ids
    outside `[0, vocab_size)`, or when it has more than `max_tokens` ids
    with `on_too_long="skip"` (with `"crop"` the caller crops).

    Args:
        texts: list of str, or a 1-D string tensor (UTF-8).
        config: a `TextConfig`.

    Returns:
        `(ids, reasons)`: int32 `tf.RaggedTensor` `(len(texts), None)`
        (unusable transcripts have no ids) and a list of str or None.
    """
    texts = tf.convert_to_tensor(texts, tf.string)
    if config.tokenizer is None:
        ids = encode_text(texts, config)
        reasons = [None if n else "transcript has no character of the vocabulary after normalisation"
                   for n in ids.row_lengths().numpy()]
    else:
        rows, reasons = [], []
        for text in texts.numpy():
            row, reason = _tokenize(text.decode("utf-8"), config)
            rows.append(np.zeros(0, np.int32) if row is None else row)
            reasons.append(reason)
        values = np.concatenate(rows) if rows else np.zeros(0, np.int32)
        ids = tf.RaggedTensor.from_row_lengths(values, [len(r) for r in rows])
    if config.max_tokens is not None and config.on_too_long == "skip":
        for i, n in enumerate(ids.row_lengths().numpy()):
            if reasons[i] is None and n > config.max_tokens:
                reasons[i] = f"transcript of {n} tokens is longer than max_tokens={config.max_tokens}"
    return ids, reasons
