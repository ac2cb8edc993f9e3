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

import dataclasses

import numpy as np
import tensorflow as tf

__all__ = ["TextConfig", "normalize_text", "encode_text", "encode_transcripts", "ABBREVIATIONS",
           "DEFAULT_VOCABULARY"]

DEFAULT_VOCABULARY = " abcdefghijklmnopqrstuvwxyz'\".,:;?!-"

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


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """How transcripts become ids: characters, or a tokenizer of yours.

    Args:
        vocabulary: the characters, in id order (id of `vocabulary[i]` is
            `i + 1`; 0 is padding). Defaults to space, `a`-`z` and
            `'".,:;?!-`.
        unknown: `"drop"` or `"oov"` (see the module docstring). Defaults
            to `"drop"`.
        lowercase: Defaults to True.
        expand_abbreviations: Defaults to True.
        expand_digits: Defaults to True.
        tokenizer: a callable `str -> list[int]` (or a 1-D integer array
            or tensor) run once per raw transcript at scan time; the
            character options above are then not used. Defaults to None.
        vocab_size: with `tokenizer`, ids must be in `[0, vocab_size)`
            (`num_ids`); an utterance with another id is bad input.
        max_tokens: the most ids of a transcript; what happens to longer
            ones is `on_too_long`. Defaults to None (no limit).
        on_too_long: `"skip"`: transcripts with more than `max_tokens` ids
            are bad input (skipped and reported, or raised); `"crop"`: the
            dataset builder keeps their first `max_tokens` ids and lists
            them in `builder.report["cropped"]`. Defaults to `"skip"`.

    Example:

    >>> phonemes = {p: i + 1 for i, p in enumerate(PHONEME_SET)}
    >>> text = kg.data.TextConfig(
    ...     tokenizer=lambda s: [phonemes[p] for p in g2p(s)],
    ...     vocab_size=len(phonemes) + 1, max_tokens=400)
    """

    vocabulary: str = DEFAULT_VOCABULARY
    unknown: str = "drop"
    lowercase: bool = True
    expand_abbreviations: bool = True
    expand_digits: bool = True
    tokenizer: object = None
    vocab_size: int = None
    max_tokens: int = None
    on_too_long: str = "skip"

    def __post_init__(self):
        if not self.vocabulary or len(set(self.vocabulary)) != len(self.vocabulary):
            raise ValueError(
                "`vocabulary` must be a non-empty string of distinct characters. "
                f"Received: vocabulary={self.vocabulary!r}"
            )
        if self.unknown not in ("drop", "oov"):
            raise ValueError(f'`unknown` must be "drop" or "oov". Received: unknown={self.unknown!r}')
        if self.tokenizer is not None and not callable(self.tokenizer):
            raise ValueError(f"`tokenizer` must be a callable str -> list[int]. Received: tokenizer={self.tokenizer!r}")
        if (self.tokenizer is None) != (self.vocab_size is None):
            raise ValueError(
                "`tokenizer` and `vocab_size` go together (the ids are checked against "
                f"vocab_size). Received: tokenizer={self.tokenizer!r}, vocab_size={self.vocab_size!r}"
            )
        for name in ("vocab_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
        if self.on_too_long not in ("skip", "crop"):
            raise ValueError(
                f'`on_too_long` must be "skip" or "crop". Received: on_too_long={self.on_too_long!r}'
            )
        if self.on_too_long == "crop" and self.max_tokens is None:
            raise ValueError(
                '`on_too_long="crop"` needs `max_tokens` (the length to crop to). '
                f"Received: on_too_long={self.on_too_long!r}, max_tokens=None"
            )

    @property
    def num_ids(self) -> int:
        """Size of an embedding table over the ids (padding and OOV included)."""
        if self.tokenizer is not None:
            return self.vocab_size
        return len(self.vocabulary) + 1 + (self.unknown == "oov")

    def description(self) -> dict:
        """The settings as plain values (the tokenizer by its qualified name)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.tokenizer is not None:
            tokenizer = self.tokenizer
            fields["tokenizer"] = f"{getattr(tokenizer, '__module__', '')}." + getattr(
                tokenizer, "__qualname__", type(tokenizer).__qualname__)
        return fields


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
