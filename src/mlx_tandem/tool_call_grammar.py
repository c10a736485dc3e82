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

Applied where the template's native call body is JSON (``json_tools``: Hermes, Qwen2.5,
Qwen3) and the start marker is one token. Other syntaxes stay unconstrained under "auto"
(their calls are parsed and validated as before).

Reasoning: a start token the model writes inside its reasoning is reasoning text, as
ChatOutputParser reads it, so it arms nothing (``think_ids``: the single-token reasoning
markers; ``<think>`` opens reasoning only before any other token but whitespace, the
parser's rule). Before, the call was held to the grammar and then read as reasoning.

Speculative decoding: a row whose call is not open keeps drafting. A speculative step
follows each drafting row's accepted block through ``observe``, so the row's reasoning state
is current when the next step decides whether it drafts; it accepts nothing after a token
that opens a call, and draws the token after it through the mask (spec/batch.py), so every
token of a call goes through the mask. Before, the state lagged a speculative block: a row
whose reasoning ended inside one and whose next token opened a call was still taken to be
reasoning, drafted the call unmasked, and the mask then refused tokens already accepted.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

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
                 starts_in_reasoning: bool = False):
        self._compile = compile_call  # a fresh matcher for the rest of one call
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

    def blocks_drafting(self, next_token: int) -> bool:
        """Must this row decode plainly this step (``next_token`` is the one it feeds)?"""
        return self._open is not None or (int(next_token) == self.start_id and not self._reasoning)

    def start_at(self, n: int) -> None:
        """The context holds ``n`` tokens and none of this row's answer went through the
        processor yet (a speculative step came first): count the budget from here."""
        if self._origin is None:
            self._origin = self._seen = int(n)

    def observe(self, tokens: Sequence[int]) -> Optional[int]:
        """Follow tokens the row's context gains without a processor call (a speculative
        step's accepted block), up to the one that opens a call; return its index, or None.
        The caller appends exactly the tokens followed to the row's context, and
        ``start_at`` came first."""
        for j, tok in enumerate(tokens):
            self._seen += 1
            self._advance(int(tok), self._seen)
            if self._open is not None:
                return j
        return None

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
                                              max_tokens=left, vocab_size=self._vocab, hints=self._hints)
            return
        self._open.consume(tok)
        if self._open.matcher.is_accepting():  # the end marker closed the call
            self._open = None
