"""What closing mode knows of each token: its class over the vocabulary, and the mask.

``token_classes`` reads an llguidance tokenizer's vocabulary once per engine (the grammar
compiler keeps the result); ``allowed_tokens`` turns a matcher's bitmask into a bool array.
Closing mode (closing.py) ranks choices by these classes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

# Closing-mode preferences: lower tier first. Closers end strings, arrays and objects (and
# parentheses, in Lark and regex grammars); separators move on to the next required key.
# EOS ends the answer once it is complete.
_CLOSERS = frozenset(b'"}])')
_SEPARATORS = frozenset(b",:")
_BLANKS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_STRUCTURE = frozenset(b'"{}[](),: \t\n\r')


class TokenClasses(NamedTuple):
    """What closing mode needs to know of each token id (arrays over the vocabulary)."""

    tier: np.ndarray  # closing preference: 0 EOS, 1 closers, 2 separators, 3 digits, 4 the rest
    length: np.ndarray  # bytes
    quote_first: np.ndarray  # starts with a quote
    awkward: np.ndarray  # holds a backslash (an escape, in a JSON string)
    partial: np.ndarray  # bytes that are not whole UTF-8 characters
    structural: np.ndarray  # only JSON punctuation and whitespace (or EOS): no content
    blank: np.ndarray  # whitespace only (tool_call_grammar: what may come before <think>)
    special: np.ndarray  # special tokens but EOS (markers such as </think>, matched by id)
    # Special token id -> the ordinary token that starts its text (``<`` for ``<think>``):
    # what ``allowed_tokens`` allows instead where the matcher refuses the special token.
    respelled: dict[int, int] = {}


def token_classes(llt, vocab_size: int, eos_token_ids: Sequence[int]) -> TokenClasses:
    """``TokenClasses`` of an llguidance tokenizer's vocabulary."""
    tier = np.full(vocab_size, 4, dtype=np.int64)
    length = np.zeros(vocab_size, dtype=np.int64)
    quote_first = np.zeros(vocab_size, dtype=bool)
    awkward = np.zeros(vocab_size, dtype=bool)
    partial = np.zeros(vocab_size, dtype=bool)
    structural = np.zeros(vocab_size, dtype=bool)
    blank = np.zeros(vocab_size, dtype=bool)
    special = np.zeros(vocab_size, dtype=bool)
    ordinary: dict[bytes, int] = {}
    for i in range(vocab_size):
        special[i] = llt.is_special_token(i)
        b = llt.decode_bytes([i])
        if b and not special[i]:
            ordinary.setdefault(b, i)
        length[i] = len(b)
        blank[i] = bool(b) and not b.decode("utf-8", "replace").strip()
        quote_first[i] = b[:1] == b'"'
        structural[i] = bool(b) and all(ch in _STRUCTURE for ch in b)
        try:
            b.decode("utf-8")
            awkward[i] = b"\\" in b
        except UnicodeDecodeError:
            partial[i] = True
        if b and all(ch in _CLOSERS or ch in _BLANKS for ch in b) and any(ch in _CLOSERS for ch in b):
            tier[i] = 1  # closers, with the whitespace a template writes after them ("}}\n")
        elif b and all(ch in _SEPARATORS for ch in b):
            tier[i] = 2
        elif b and all(ch in _DIGITS for ch in b):
            tier[i] = 3  # numbers start with a digit, not "-"
    eos = list(eos_token_ids)
    tier[eos] = 0
    structural[eos] = True
    # Respelled before EOS leaves ``special``: forced text that spells an end token
    # (a JSON const "<|im_end|>") is tokenized as that token too (allowed_tokens).
    respelled_ids = np.flatnonzero(special)
    special[eos] = False
    respelled = {}
    for i in respelled_ids:
        text = llt.decode_bytes([int(i)])
        first = next((ordinary[text[:n]] for n in range(len(text), 0, -1) if text[:n] in ordinary), None)
        if first is not None:
            respelled[int(i)] = first
    return TokenClasses(tier, length, quote_first, awkward, partial, structural, blank, special, respelled)


def allowed_tokens(matcher, vocab_size: int, respelled: Optional[dict[int, int]] = None) -> np.ndarray:
    """The matcher's mask as a bool array, repaired for text that spells a special token.

    llguidance 1.9.1 turns forced bytes into tokens with the tokenizer, which reads the
    text of an added token (a JSON ``const`` or a Lark literal ``"<think>"``) as that token:
    the mask allows only the special token, and the matcher then refuses it (a grammar
    matches special tokens only by id), so the request failed mid-answer. The matcher takes
    the text spelled in ordinary tokens: ``respelled`` (``TokenClasses.respelled``) names the
    ordinary token that starts it, allowed instead where the matcher takes it. End tokens
    are among them: allowed where the matcher refuses them, one would end the answer
    mid-document (an MTP walk ends a row at an allowed EOS).
    """
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.shape[0])
    allowed[:n] = bits[:n].astype(bool)
    # Where the grammar may end, nothing is forced, and a stopped matcher refuses even the
    # EOS it allows: the repair would empty the mask.
    if respelled and not (matcher.is_stopped() or matcher.is_accepting()):
        for special, first in respelled.items():
            if special < vocab_size and allowed[special] and not matcher.validate_tokens([special]):
                allowed[special] = False
                if first < vocab_size and matcher.validate_tokens([first]):
                    allowed[first] = True
    return allowed
