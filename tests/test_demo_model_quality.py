"""The embedded demo model reads the tool list, as docs/demo_model.md reports.

The adapters' tool-calling and agent-loop tests bind one tool, so a model that picks tools
at random passes them (run 40, put in the shipped model's place, did). This checks the
choice itself, on the evaluation's standard held-out set (``eval_demo_model.py --n 200
--seed 1``: tools and phrasings training never used), through the engine as users call
it. The floors are set well under what the shipped model measures (docs/demo_model.md:
tool choice among two or more tools 82.8%, exact arguments 84.3%) so that float
differences between backends cannot flip it, and well over what a model that ignores the
request gets (a random pick 44.8%; run 40: 31.0% and 23.5%).
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from mlx_tandem import Engine
from mlx_tandem.default_model import is_packaged

EVAL_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_demo_model.py"


def _eval_module():
    spec = importlib.util.spec_from_file_location("eval_demo_model", EVAL_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not is_packaged(), reason="a source tree without the packaged weights: the default is random")
def test_demo_model_picks_listed_tools_from_the_request():
    ev = _eval_module()
    turns = [(r, ev.first_answer(r)) for r in ev.held_out_examples(200, seed=1) if r["kind"] == "tool"]

    async def run():
        async with Engine(show_progress=False, mtp="off", max_batch_size=32) as engine:
            return await asyncio.gather(*(engine.chat(r["messages"][:k], {"max_tokens": 96}, tools=r["tools"])
                                          for r, k in turns))

    score = {k: [] for k in ("tool_choice", "tool_args", "tool_choice_multi", "tool_choice_multi_chance",
                             "tool_choice_multi_named", "tool_choice_multi_named_chance", "tool_call_unwanted")}
    for (r, k), out in zip(turns, asyncio.run(run())):
        ev._score_call(score, "", r["messages"][k], out, len(r["tools"]), r["messages"][k - 1]["content"] or "")
    rate = {k: sum(v) / len(v) for k, v in score.items()}
    assert len(score["tool_choice_multi"]) >= 25  # the set has 29 choices among 2+ tools
    assert rate["tool_choice_multi"] >= 0.65 > rate["tool_choice_multi_chance"] + 0.15, rate
    assert rate["tool_choice"] >= 0.75 and rate["tool_args"] >= 0.65, rate


@pytest.mark.skipif(not is_packaged(), reason="a source tree without the packaged weights: the default is random")
def test_without_tools_a_call_cannot_be_opened():
    """Held-out prompts sent with no tools, where the demo model, left alone, opens a tool
    call (13 of the standard set's 128 such prompts do): the engine bans the call marker, as
    tool_choice="none" does, so the answer is text."""
    prompts = ["Farewell!", "Much appreciated!", "Find 8 multiplied by 13."]

    async def run():
        async with Engine(show_progress=False, mtp="off") as engine:
            msgs = [[{"role": "user", "content": p}] for p in prompts]
            params = {"max_tokens": 32}
            raw = await asyncio.gather(*(engine.complete(engine.apply_chat_template(m), params) for m in msgs))
            plain = await asyncio.gather(*(engine.chat(m, params) for m in msgs))
            none = await asyncio.gather(*(engine.chat(m, params, tool_choice="none") for m in msgs))
            return raw, plain, none, engine.encode("<tool_call>")

    raw, plain, none, marker = asyncio.run(run())
    assert len(marker) == 1
    assert all(marker[0] in r.token_ids for r in raw)  # unbanned, the model opens a call
    for p, n in zip(plain, none):
        assert marker[0] not in p.token_ids and "<tool_call>" not in p.text and not p.tool_calls
        assert p.token_ids == n.token_ids
