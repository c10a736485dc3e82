"""MTP with grammar-constrained rows (a response_format, a forced call): the rows draft what
their grammar allows, every verified position is masked as a plain step masks it, and the
grammar goes back to where verification stopped (spec/batch.py, ``GrammarWalk``).

The reference is the same engine with ``mtp="off"``: greedy output must be token for token
the same, closing mode included (budgets at the document's smallest size), and sampled
output must keep its distribution.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.default_model import is_packaged
from mlx_tandem.testing.mtp_distill import default_prompts

from .numerics import same_distribution

needs_demo = pytest.mark.skipif(not is_packaged(), reason="the demo model's weights are not in this tree")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "code": {"type": "string", "pattern": r"^[A-Z]{2}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "code", "tags"],
}
RF = {"type": "json_schema", "json_schema": {"name": "account", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PEOPLE = ["Rosa", "Ilse", "Tomas", "Amara", "Kenji", "Lucia"]


def _requests(smallest: int) -> list[tuple[list[dict], dict, dict]]:
    """(messages, sampling params, chat options): every kind of whole-answer grammar, at
    roomy budgets and at budgets from the schema's smallest document up (closing mode)."""
    out = []
    for i, who in enumerate(PEOPLE):
        ask = [{"role": "user", "content": f"Give {who}'s account, aged {20 + 3 * i}, as JSON."}]
        out.append((ask, {"max_tokens": 96}, {"response_format": RF}))
        out.append((ask, {"max_tokens": smallest + i}, {"response_format": RF}))
    weather = [{"role": "user", "content": f"What is the weather in {c}?"} for c in ("Oslo", "Lima", "Hanoi")]
    for w in weather:
        out.append(([w], {"max_tokens": 48}, {"tools": [WEATHER], "tool_choice": "get_weather"}))
        out.append(([w], {"max_tokens": 48}, {"tools": [WEATHER], "tool_choice": "required"}))
        out.append(([w], {"max_tokens": 64}, {"tools": [WEATHER], "response_format": RF}))  # call or answer
    out.append(([{"role": "user", "content": "A code, please."}], {"max_tokens": 16},
                {"response_format": {"type": "regex", "pattern": r"[A-Z]{2}-[0-9]{4}"}}))
    out.append(([{"role": "user", "content": "Yes or no, twice."}], {"max_tokens": 16},
                {"response_format": {"type": "lark", "grammar": 'start: a ", " a\na: "yes" | "no"'}}))
    out.append(([{"role": "user", "content": "Think, then give Rosa's account as JSON."}], {"max_tokens": 128},
                {"response_format": RF, "reasoning": True}))
    return out


async def _run(mode: str, requests, depth: int = 2):
    engine = Engine(None, show_progress=False, mtp=mode, mtp_depth=depth, max_batch_size=32)
    await engine.start()
    try:
        outs = await asyncio.gather(*[engine.chat(m, SamplingParams(**p), **o) for m, p, o in requests])
        return outs, engine.stats()
    finally:
        await engine.close()


def _smallest_document() -> int:
    from mlx_tandem.closing import closing_path
    from mlx_tandem.constraints import Constraint

    engine = Engine(None, show_progress=False).start_sync()
    try:
        grammar = engine._front.grammar
        constraint = Constraint.json_schema(SCHEMA)
        return len(closing_path(grammar.compile(constraint), grammar.tiers(), frozenset(grammar.eos_token_ids),
                                limit=10_000, hints=grammar.hint_ids(constraint)))
    finally:
        engine.close_sync()


@needs_demo
@pytest.mark.parametrize("depth", [1, 3])
def test_constrained_rows_draft_and_stay_lossless(depth):
    requests = _requests(_smallest_document())
    ref, _ = asyncio.run(_run("off", requests))
    got, stats = asyncio.run(_run("on", requests, depth))
    for (m, p, o), a, b in zip(requests, ref, got):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), (m, p, o)
    mtp = stats["mtp"]
    assert mtp["plain_steps"] == 0 and mtp["spec_steps"] > 0
    # Every row is constrained, so these are the grammar rows' drafts.
    assert mtp["acceptance_rate"] > 0.3, mtp
    assert stats["constrained_requests"] == len(requests)
    # What the grammars promise holds: documents validate, forced calls are calls.
    for (m, p, o), out in zip(requests, got):
        if o.get("tool_choice"):
            assert out.tool_calls and out.finish_reason == "tool_calls"
        elif o.get("response_format") is RF and not o.get("tools") and out.finish_reason == "stop":
            json.loads(out.content)


def test_sampled_constrained_rows_keep_their_distribution(qwen3_5_mtp_path):
    """Speculative sampling under a grammar: drafts drawn from the masked head, accepted
    against the masked target. top_k=2 after the mask leaves at most 8 joint values of the
    first three tokens; 1200 seeded samples per mode, chi-square test of homogeneity, reject
    only at p < 0.001 (fixed seeds: deterministic). The budget leaves room to close after
    them (at 3, closing mode keeps only the tokens that let the answer close in time)."""
    n = 1200
    prompt = default_prompts(64)[5]
    fmt = {"type": "regex", "pattern": "[a-h]{3,6}"}

    async def run(mode):
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode, max_batch_size=32, mtp_depth=2)
        await engine.start()
        try:
            outs = await asyncio.gather(*(engine.complete(prompt, {
                "max_tokens": 8, "temperature": 0.8, "top_k": 2, "seed": 1000 * (mode == "on") + i,
                "mtp": mode}, response_format=fmt) for i in range(n)))
            return [tuple(o.token_ids[:3]) for o in outs], [o.text for o in outs], engine.stats()["mtp"]
        finally:
            await engine.close()

    plain, _, _ = asyncio.run(run("off"))
    spec, texts, mtp = asyncio.run(run("on"))
    assert mtp["drafted"] > 2000 and mtp["accepted"] >= 100, mtp
    assert all(set(t) <= set("abcdefgh") for t in texts)
    same_distribution(plain, spec)
