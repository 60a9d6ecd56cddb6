"""Incremental detokenization equals decoding the whole output at once (the tokenizer is the oracle)."""

import pytest

from runtime.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café — 東京 🚀 emoji and accents",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    assert d._backend is not None  # a fast tokenizer without clean-up: its Rust backend decodes
    for t in ids:
        d.add([t])
    d.flush()
    assert d.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_clean_up_tokenization_spaces_keeps_the_wrapper(tokenizer):
    """With the clean-up pass on, the HF wrapper decodes (the backend alone would skip it)."""
    import copy

    wrapped = copy.deepcopy(tokenizer)
    wrapped.clean_up_tokenization_spaces = True
    d = IncrementalDetokenizer(wrapped)
    assert d._backend is None
    ids = wrapped.encode(TEXTS[0], add_special_tokens=False)
    d.add(ids)
    d.flush()
    assert d.text == wrapped.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_text(tokenizer):
    text = "alpha beta STOP gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    hit = None
    for t in ids:
        hit = d.add([t])
        if hit:
            break
    assert hit == "STOP"
    assert d.text == "alpha beta "
    d2 = IncrementalDetokenizer(tokenizer, stop=("STOP",), include_stop_str_in_output=True)
    for t in ids:
        if d2.add([t]):
            break
    assert d2.text == "alpha beta STOP"
