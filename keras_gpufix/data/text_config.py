"""`TextConfig`: how transcripts become ids; its checks need no TensorFlow
(`keras-gpufix validate` runs them without importing it)."""

import dataclasses

import numpy as np

__all__ = ["DEFAULT_VOCABULARY", "TextConfig"]

DEFAULT_VOCABULARY = " abcdefghijklmnopqrstuvwxyz'\".,:;?!-"


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """How transcripts become ids: characters, or a tokenizer of yours.

    Args:
        vocabulary: the characters, in id order (id of `vocabulary[i]` is
            `i + 1`; 0 is padding). Defaults to space, `a`-`z` and
            `'".,:;?!-`.
        unknown: `"drop"` or `"oov"` (see `keras_gpufix.data.text`). Defaults
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
