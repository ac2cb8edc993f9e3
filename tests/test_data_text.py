import pytest
import tensorflow as tf

from keras_gpufix.data.text import DEFAULT_VOCABULARY, TextConfig, encode_text, normalize_text


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
