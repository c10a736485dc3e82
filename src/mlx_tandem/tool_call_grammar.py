"""Hold the tool calls a model opens on its own (tool_choice="auto") to the request's tools.

Under "auto" the model decides whether to call a tool, so nothing is masked until it emits
the tool-call start token. From there to the end token the call must be
``{"name": <a listed tool>, "arguments": <valid for that tool's schema>}``; after the end
token the text is free again, and a further start token re-arms the grammar. This is the
"lazy grammar" llama.cpp applies to tool calls; vLLM and SGLang offer the same through
xgrammar's structural tags.

Why by default (engine option ``constrain_tool_calls``): a small local model's call then
always names a real tool with arguments its schema accepts, so an agent loop never gets a
call it cannot run; a strong model's calls were valid already and are unchanged. Whether to
call, and which listed tool, stays the model's choice.

Applied where the grammar writes the template's native call body (``json_tools``: Hermes,
Qwen2.5, Qwen3; ``qwen3_coder``: Qwen3.5's XML, xml_calls.py) and the start marker is one
token. Other syntaxes stay unconstrained under "auto" (their calls are parsed as before).

Reasoning: a start token the model writes inside its reasoning is reasoning text, as
ChatOutputParser reads it, so it arms nothing (``think_ids``: the single-token reasoning
markers; ``<think>`` opens reasoning only before any other token but whitespace, the
parser's rule). Before, the call was held to the grammar and then read as reasoning.

Speculative decoding: the row drafts inside calls and out. A speculative step walks the
row's drafts through this processor (``walk_take`` / ``walk_allowed``, spec/walks.py's
``GrammarWalk``) as plain steps would feed it: free text is unmasked, a start token arms
the call grammar, whose masks then hold the drafts and the verified positions, and the end
marker disarms it; ``state`` / ``restore`` take it back to where verification stopped.
Until 2026-11-29 a row decoded an open call plainly, and a step accepted nothing after a
drafted start token. Before that (2026-11-28) the reasoning state lagged a speculative
block: a row whose reasoning ended inside one drafted the call that followed unmasked.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from .closing import GrammarProcessor


class LazyToolCallGrammar:
    """mlx-lm logits processor for one row: pass-through until a call opens, then masked.

    It reads the row's token context rather than assuming one new token per call, so it
    stays in step after speculative steps that emit several tokens at once (the batch
    appends them to the context; see spec/batch.py).
    """

    def __init__(self, compile_call: Callable[[], Any], *, start_id: int, tiers,
                 eos_token_ids: Sequence[int], max_tokens: int, vocab_size: int,
                 hints: Sequence[Sequence[int]] = (), think_ids: Optional[tuple[int, int]] = None,
                 starts_in_reasoning: bool = False, text_markup: bool = False):
        self._compile = compile_call  # a fresh matcher for the rest of one call
        self._text_markup = text_markup
        self._think = think_ids
        self._reasoning = think_ids is not None and starts_in_reasoning
        self._answered = False  # a token but whitespace came: <think> opens nothing any more
        self._hints = hints
        self.start_id = int(start_id)
        self._tiers = tiers
        self._eos = list(eos_token_ids)
        self._max_tokens = int(max_tokens)
        self._vocab = int(vocab_size)
        self._origin: Optional[int] = None  # context length at the first call
        self._seen = 0
        self._open: Optional[GrammarProcessor] = None

    def cap_budget(self, max_tokens: int) -> None:
        """Lower the row's token budget before it starts (the vision lane learns the real
        one only once the images are expanded)."""
        self._max_tokens = min(self._max_tokens, int(max_tokens))

    @property
    def is_open(self) -> bool:
        """A call is open: every token goes through the mask."""
        return self._open is not None

    @property
    def eos(self) -> frozenset[int]:
        return frozenset(self._eos)

    # ------------------------------------------------------------------ speculative steps
    def walk_start(self, context_size: int) -> None:
        """A speculative step's walk begins; the row's context holds ``context_size``
        tokens. If none of the answer went through the processor yet (a speculative step
        came first), the budget counts from here."""
        if self._origin is None:
            self._origin = self._seen = int(context_size)

    def walk_take(self, tok: int) -> None:
        """Follow ``tok`` as the next plain call would find it in the row's context."""
        self._seen += 1
        self._advance(int(tok), self._seen)

    def walk_allowed(self, vocab: int) -> Optional[np.ndarray]:
        """The next position's mask: the call grammar's while a call is open, else None."""
        return None if self._open is None else self._open.next_allowed(vocab)

    def takes(self, tok: int) -> bool:
        return self._open is None or self._open.takes(tok)

    def state(self) -> tuple:
        call = self._open
        return (self._seen, self._origin, self._reasoning, self._answered, call,
                call.state() if call is not None else None)

    def restore(self, state: tuple) -> None:
        self._seen, self._origin, self._reasoning, self._answered, call, call_state = state
        if call is not None:
            call.restore(call_state)
        self._open = call

    def __call__(self, tokens, logits):
        n = int(tokens.shape[0])
        if self._origin is None:
            self._origin = self._seen = n  # the prompt ends here
        elif n > self._seen:
            for tok in tokens[self._seen:n].tolist():
                self._advance(int(tok), n)
            self._seen = n
        return logits if self._open is None else self._open.mask(logits)

    def _advance(self, tok: int, n: int) -> None:
        if self._open is None:
            if self._think is not None:
                if self._reasoning:
                    self._reasoning = tok != self._think[1]
                    return
                if tok == self._think[0] and not self._answered:
                    self._reasoning = True
                    return
                blank = self._tiers.blank  # ids past it: padded logits, no text
                self._answered = self._answered or tok >= blank.shape[0] or not blank[tok]
            if tok == self.start_id:
                # Budget for the call: what the request has left from this step on, so the
                # mask's closing logic finishes the call within max_tokens.
                left = max(1, self._max_tokens - (n - self._origin))
                self._open = GrammarProcessor(self._compile(), tiers=self._tiers, eos_token_ids=self._eos,
                                              max_tokens=left, vocab_size=self._vocab, hints=self._hints,
                                              text_markup=self._text_markup)
            return
        self._open.consume(tok)
        if self._open.matcher.is_accepting():  # the end marker closed the call
            self._open = None
