"""The factory's BPE tokenizer, and its word-consistent variant (the demo-model trainer's
``--word-consistent-tokenizer``): a word or number splits into the same tokens whatever
character stands before it, so copying it from a request into a tool call is copying token ids."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mlx_tandem.testing import make_tiny_model

# Words the training texts below never contain, and some they do.
WORDS = ["vowels", "Chicago", "stellar", "procedure", "population", "xqzt", "the", "function"]
# What the chat template and JSON put before a word: a space, an underscore in a tool name,
# a quote in a JSON string, a bracket, a newline, a dash.
BEFORE = [" ", "_", '"', "(", "\n", "-", ' "']
NUMBERS = ["-20", "-3", "42"]
NUMBER_BEFORE = [" ", "(", "[", ' "', ", "]


def _texts() -> list[str]:
    lines = ['{"name": "get_weather", "description": "Get the weather in a city.", "arguments": {"a": -2}}',
             "What is the weather in Paris? Call get_weather(-1) with the function.", "Tell me the answer, (please)."]
    return lines * 50


def _splits_like_alone(tok, before: str, item: str) -> bool:
    ids = tok.encode(before + item, add_special_tokens=False)
    return ids == tok.encode(before, add_special_tokens=False) + tok.encode(item, add_special_tokens=False)


@pytest.fixture(scope="module")
def word_consistent(tmp_path_factory):
    path = make_tiny_model("qwen3_5", tmp_path_factory.mktemp("wc") / "m", tokenizer_texts=_texts(),
                           word_consistent_tokenizer=True)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def plain(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models.get("qwen3_5"))


def _inconsistent(tok) -> list[tuple[str, str]]:
    return ([(b, w) for w in WORDS for b in BEFORE if not _splits_like_alone(tok, b, w)]
            + [(b, n) for n in NUMBERS for b in NUMBER_BEFORE if not _splits_like_alone(tok, b, n)])


def test_word_consistent_tokenizer_splits_words_and_numbers_the_same_wherever_they_stand(word_consistent):
    assert _inconsistent(word_consistent) == []
    # It is still a lossless byte-level tokenizer with the chat markup as single tokens.
    text = 'Hi <tool_call>\n{"name": "count_vowels", "arguments": {"n": -20}}\n</tool_call> 你好 🙂 café'
    ids = word_consistent.encode(text, add_special_tokens=False)
    assert word_consistent.decode(ids) == text
    assert word_consistent.convert_tokens_to_ids("<tool_call>") in ids


def test_training_texts_become_whole_tokens(word_consistent, plain):
    # The texts given to the trainer are learned: their words merge into fewer tokens.
    line = _texts()[0]
    assert len(word_consistent.encode(line)) < len(plain.encode(line))


def test_the_test_models_keep_the_plain_qwen_split(plain):
    # Merges there may join a leading space to a word (" stellar" is not " " + "stellar"):
    # the random-weight test models keep the tokenizer their tests were written against.
    assert _inconsistent(plain)

