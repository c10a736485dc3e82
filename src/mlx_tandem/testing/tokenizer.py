"""A byte-level BPE tokenizer trained offline on local text (the Python standard library).

Deterministic for a given Python installation: the corpus is a fixed, sorted list of
stdlib sources plus a fixed multilingual sample (plus any extra texts the caller gives, such
as the demo model's training dialogues), and the BPE trainer is deterministic.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Sequence

from .chat_template import CHAT_TEMPLATE

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added, not special: they stay in decoded text, so reasoning and tool calls can be parsed.
# Qwen3.5's pre-tokenizer regex: transformers rebuilds a `qwen3_5` tokenizer with it from the
# vocab and merges whatever tokenizer.json says, so the BPE must be trained with it too.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Word-consistent merges (an option of the demo-model trainer): while training, letter runs, single
# digits, "-" and other character runs are split apart, so no merge ever joins a letter to
# the space, quote or underscore before it. Served with the regex above, which glues one such
# character to the word after it, a word then ends in the same pieces wherever it stands:
# " vowels", "_vowels" and '"vowels' all end in the tokens of "vowels", and "-" before a digit
# is always its own token. Copying a word or number from a request into a tool call (or
# matching it against a tool list) is then copying the same token ids, with no need to learn
# that " st"+"e" pairs with "ste". What it did for the demo model is in docs/demo_model.md
# (run 9). Punctuation and whitespace are learned in the runs the serving regex cuts them
# into (`", "` is `",` + ` "`), so the JSON of a tool list is as few tokens as the split allows.
# The test models keep the plain Qwen split.
WORD_CONSISTENT_TRAIN_REGEX = (r"[\p{L}\p{M}]+|\p{N}|-| ?[^\s\p{L}\p{M}\p{N}-]+[\r\n]*"
                               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_STDLIB_FILES = [
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py", "string.py",
    "functools.py", "collections/__init__.py", "argparse.py", "pathlib.py", "datetime.py",
    "statistics.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py", "calendar.py",
]
_SAMPLE = (
    "Hello world! The quick brown fox jumps over the lazy dog. 12 + 30 = 42. "
    "Unicode: café, naïve, 東京, 北京欢迎你, こんにちは, 안녕하세요, emoji 🙂🚀👍🏽, ∑∫√. "
    "You are a helpful assistant. What is the weather in Paris? Call the tool get_weather. "
)


def corpus(max_chars: int = 1_200_000) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [_SAMPLE] * 20
    total = 0
    for rel in _STDLIB_FILES:
        path = stdlib / rel
        if path.exists():
            text = path.read_text(encoding="utf-8", errors="replace")
            texts.append(text)
            total += len(text)
            if total >= max_chars:
                break
    return texts


def train_tokenizer(vocab_size: int = 2048, extra_texts: Sequence[str] = (), word_consistent: bool = False):
    """The BPE tokenizer, trained on ``corpus()`` plus ``extra_texts``; ``word_consistent``
    learns merges within words only (see ``WORD_CONSISTENT_TRAIN_REGEX``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    def pre_tokenizer(regex: str):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer(WORD_CONSISTENT_TRAIN_REGEX if word_consistent else QWEN3_5_PRETOKENIZE_REGEX)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus() + list(extra_texts), trainer=trainer)
    # Served with Qwen3.5's split, whatever the merges were learned with (see the regex above).
    tok.pre_tokenizer = pre_tokenizer(QWEN3_5_PRETOKENIZE_REGEX)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def write_tokenizer(path: Path, vocab_size: int = 2048, model_max_length: int = 4096,
                    extra_texts: Sequence[str] = (), word_consistent: bool = False) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json; return the ids of the named tokens."""
    tok = train_tokenizer(vocab_size, extra_texts, word_consistent)
    tok.save(str(path / "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS + MARKUP_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS,
        }
    config = {
        "tokenizer_class": "TokenizersBackend",
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS} | {"__vocab_size__": tok.get_vocab_size()}
