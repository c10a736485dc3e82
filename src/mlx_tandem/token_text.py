"""One token's text and bytes, for logprobs (``outputs.TokenLogprob``). Pure Python.

A token may hold part of a character (byte-level BPE splits emoji and CJK into byte
tokens), so decoding it alone gives U+FFFD; OpenAI's ``bytes`` carries it whole. The
bytes are read from the tokenizer's own vocabulary where its decoder says how: GPT-2's
byte-to-unicode table for a ``ByteLevel`` decoder (Qwen, Llama 3), ``<0xNN>`` pieces and
``▁`` for SentencePiece's byte fallback (Llama 2, Mistral); any other token, and the
added (special) tokens, as the UTF-8 of its decoded text.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Callable, Optional

from .outputs import TokenLogprob, TopLogprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(backend) -> set[str]:
    """The decoder types of a ``tokenizers.Tokenizer`` (a Sequence's members included)."""
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - an unknown backend: decode each token instead
        return set()
    kinds = {spec.get("type")}
    for d in spec.get("decoders") or ():
        kinds.add(d.get("type"))
    return {k for k in kinds if k}


class TokenTexts:
    """``token(id) -> (text, bytes)``, cached. ``tokenizer`` is a transformers fast
    tokenizer or its ``tokenizers.Tokenizer`` (the caller's own copy: one instance must not
    serve several threads), ``decode`` its decode of a list of ids."""

    def __init__(self, tokenizer, decode: Callable[[list[int]], str]):
        # The vocabulary and decoder are the Rust backend's: a transformers tokenizer's own
        # ``to_str`` is not it, and read so every byte token fell back to U+FFFD (a review).
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._decode = decode
        self._added: Optional[set[int]] = None  # read on first use: a real vocabulary's JSON is MBs
        self.token = lru_cache(maxsize=1 << 16)(self._token)

    def _read_vocabulary(self) -> None:
        kinds = _decoder_kinds(self._backend)
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        try:
            self._added = {int(i) for i in self._backend.get_added_tokens_decoder()}
        except Exception:  # noqa: BLE001 - older tokenizers: no added tokens known
            self._added = set()

    def _token(self, token_id: int) -> tuple[str, bytes]:
        if self._added is None:
            self._read_vocabulary()
        data = self._bytes_of_piece(token_id)
        if data is None:
            text = self._decode([token_id])
            return text, text.encode("utf-8")
        return data.decode("utf-8", errors="replace"), data

    def _bytes_of_piece(self, token_id: int) -> Optional[bytes]:
        if token_id in self._added or not (self._byte_level or self._byte_fallback):
            return None
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level:
            # GPT-2's byte-to-unicode table, inverted: mlx-lm's (0.32), which its BPE
            # streaming detokenizer reads too.
            from mlx_lm.tokenizer_utils import _byte_decoder

            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return None
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def logprob(self, token_id: int, raw) -> TokenLogprob:
        """The output of one ``token_logprobs.RawLogprob``: each token with its text and bytes."""
        logprob, top = raw
        text, data = self.token(token_id)
        alternatives = []
        for t, lp in top:
            t_text, t_data = self.token(t)
            alternatives.append(TopLogprob(t, t_text, lp, t_data))
        return TokenLogprob(token_id, text, logprob, data, tuple(alternatives))
