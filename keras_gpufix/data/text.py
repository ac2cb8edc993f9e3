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
"""

import dataclasses

import tensorflow as tf

__all__ = ["TextConfig", "normalize_text", "encode_text", "ABBREVIATIONS", "DEFAULT_VOCABULARY"]

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
    """How transcripts become character ids.

    Args:
        vocabulary: the characters, in id order (id of `vocabulary[i]` is
            `i + 1`; 0 is padding). Defaults to space, `a`-`z` and
            `'".,:;?!-`.
        unknown: `"drop"` or `"oov"` (see the module docstring). Defaults
            to `"drop"`.
        lowercase: Defaults to True.
        expand_abbreviations: Defaults to True.
        expand_digits: Defaults to True.
    """

    vocabulary: str = DEFAULT_VOCABULARY
    unknown: str = "drop"
    lowercase: bool = True
    expand_abbreviations: bool = True
    expand_digits: bool = True

    def __post_init__(self):
        if not self.vocabulary or len(set(self.vocabulary)) != len(self.vocabulary):
            raise ValueError(
                "`vocabulary` must be a non-empty string of distinct characters. "
                f"Received: vocabulary={self.vocabulary!r}"
            )
        if self.unknown not in ("drop", "oov"):
            raise ValueError(f'`unknown` must be "drop" or "oov". Received: unknown={self.unknown!r}')

    @property
    def num_ids(self) -> int:
        """Size of an embedding table over the ids (padding and OOV included)."""
        return len(self.vocabulary) + 1 + (self.unknown == "oov")


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
    chars = tf.strings.unicode_split(normalize_text(texts, config), "UTF-8")
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(list(config.vocabulary)),
            tf.range(1, len(config.vocabulary) + 1, dtype=tf.int32),
        ),
        default_value=-1,
    )
    ids = tf.ragged.map_flat_values(table.lookup, chars)
    if config.unknown == "oov":
        return tf.ragged.map_flat_values(
            lambda x: tf.where(x < 0, len(config.vocabulary) + 1, x), ids
        )
    return tf.ragged.boolean_mask(ids, ids >= 0)
