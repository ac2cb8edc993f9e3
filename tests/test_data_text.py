import pytest
import tensorflow as tf

from keras_gpufix.data.text import (DEFAULT_VOCABULARY, TextConfig, encode_text, encode_transcripts,
                                     normalize_text)


def _normalized(text, **kwargs):
    return normalize_text([text], TextConfig(**kwargs)).numpy()[0].decode()


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("  Hello,\tWORLD!  ", "hello, world!"),
        ("Mr. Smith met Dr. Jones on St. James St.", "mister smith met doctor jones on saint james saint"),
        ("Mrs. Brown", "misess brown"),
        ("in 1963, room 42", "in one nine six three , room four two"),
        ("“Quoted” — it’s…", "\"quoted\" - it's..."),
        ("ÉCOLE", "école"),
        ("Amr. Dram", "amr. dram"),  # abbreviations only as whole words
    ],
)
def test_normalisation(raw, expected):
    assert _normalized(raw) == expected


def test_normalisation_steps_can_be_turned_off():
    assert _normalized("Mr. 7", lowercase=False, expand_abbreviations=False,
                       expand_digits=False) == "Mr. 7"
    assert _normalized("Dr. 7", lowercase=False, expand_digits=False) == "doctor 7"


def test_ids_padding_and_vocabulary_order():
    ids = encode_text(["ab a"], TextConfig()).to_list()[0]
    a = DEFAULT_VOCABULARY.index("a") + 1
    assert ids == [a, a + 1, DEFAULT_VOCABULARY.index(" ") + 1, a]
    assert 0 not in ids  # 0 is padding


def test_unknown_characters_drop_or_oov():
    drop = encode_text(["a#b"], TextConfig(vocabulary="ab")).to_list()[0]
    oov = encode_text(["a#b"], TextConfig(vocabulary="ab", unknown="oov")).to_list()[0]
    assert drop == [1, 2]
    assert oov == [1, 3, 2]
    assert TextConfig(vocabulary="ab", unknown="oov").num_ids == 4
    assert TextConfig(vocabulary="ab").num_ids == 3


def test_batch_is_ragged_and_works_inside_tf_data():
    config = TextConfig()
    texts = ["one", "twenty two", "x"]
    eager = encode_text(texts, config)
    assert eager.row_lengths().numpy().tolist() == [3, 10, 1]
    ds = tf.data.Dataset.from_tensor_slices(texts).batch(3).map(lambda t: encode_text(t, config))
    assert next(iter(ds)).to_list() == eager.to_list()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"vocabulary": "aab"}, "`vocabulary` must be a non-empty string of distinct characters"),
        ({"vocabulary": ""}, "`vocabulary` must be a non-empty string"),
        ({"unknown": "keep"}, "`unknown` must be \"drop\" or \"oov\". Received: unknown='keep'"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextConfig(**kwargs)


def test_tokenizer_ids_unchanged_with_reasons_for_bad_transcripts():
    calls = []

    def tokenizer(text):
        calls.append(text)
        if text == "boom":
            raise KeyError("no phoneme")
        return {"ok": [0, 5, 9], "long": list(range(1, 8)), "range": [3, 10],
                "empty": [], "float": [1.5]}[text]

    config = TextConfig(tokenizer=tokenizer, vocab_size=10, max_tokens=5)
    texts = ["ok", "long", "range", "empty", "float", "boom", "ok"]
    ids, reasons = encode_transcripts(texts, config)
    assert calls == texts  # once per transcript, raw (no normalisation)
    assert ids.to_list()[0] == [0, 5, 9] and ids.to_list()[6] == [0, 5, 9] and ids.dtype == tf.int32
    assert reasons == [
        None,
        "transcript of 7 tokens is longer than max_tokens=5",
        "tokenizer returned id 10 outside [0, vocab_size=10)",
        "tokenizer returned 0 ids in shape (0,) (expected a non-empty 1-D list)",
        "tokenizer returned float64 values (expected integer ids)",
        "tokenizer raised KeyError: 'no phoneme'",
        None,
    ]
    assert config.num_ids == 10
    assert config.description()["tokenizer"].endswith("tokenizer")


def test_characters_through_encode_transcripts():
    ids, reasons = encode_transcripts(["ab", "###", "abc"], TextConfig(vocabulary="abc", max_tokens=2))
    assert ids.to_list() == [[1, 2], [], [1, 2, 3]]
    assert reasons == [None, "transcript has no character of the vocabulary after normalisation",
                       "transcript of 3 tokens is longer than max_tokens=2"]


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer": "abc", "vocab_size": 3}, "`tokenizer` must be a callable"),
    ({"tokenizer": len}, "`tokenizer` and `vocab_size` go together"),
    ({"vocab_size": 3}, "`tokenizer` and `vocab_size` go together"),
    ({"tokenizer": len, "vocab_size": 0}, "`vocab_size` must be an integer >= 1"),
    ({"max_tokens": 0}, "`max_tokens` must be an integer >= 1"),
])
def test_tokenizer_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextConfig(**kwargs)


def test_text_functions_pass_the_shared_layer_checks():
    import numpy as np
    from layer_checks import check_config_round_trip, check_dataset_function

    config = TextConfig(vocabulary=DEFAULT_VOCABULARY, unknown="oov", max_tokens=50)
    check_config_round_trip(config)  # the path of the YAML `data.text` and the cache fingerprint
    examples = [np.array(t, dtype=object) for t in ("Mr. Smith, 42", "ok", "a#b")]
    eager = check_dataset_function(lambda t: encode_text(t[None], config).flat_values, examples)
    batch = encode_text([str(x) for x in examples], config).to_list()
    assert [ids.tolist() for ids in eager] == batch  # one at a time == the batch
