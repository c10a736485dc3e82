"""The lazy tool-call grammar under tool_choice="auto" (src/mlx_tandem/tool_call_grammar.py).

A call the model opens on its own must name a listed tool with arguments its schema accepts;
text outside calls is untouched; and speculative decoding stays lossless around it.
Random-weight factory models give the structural checks (with the grammar off, the same
requests do produce invalid calls, so the checks can fail); the trained demo model opens
calls by itself, which the MTP checks need.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.chat_format import ChatFormat
from mlx_tandem.chat_plan import plan_chat
from mlx_tandem.default_model import is_packaged
from mlx_tandem.spec import batch as spec_batch
from mlx_tandem.tool_call_grammar import LazyToolCallGrammar

from .forcing import forcing_processor
from .test_constraints import TOOL_MODELS, TOOLS, USER

JSON_FMT = ChatFormat(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                      tool_call_end="</tool_call>", tool_format="json_tools",
                      tool_parser=lambda t, tools: json.loads(t))


def _plan(fmt=JSON_FMT, **kw):
    args = dict(tools=TOOLS, tool_choice=None, response_format=None, reasoning=None, parallel_tool_calls=None,
                template_kwargs=None, marker=json.dumps, encode=lambda s: [7])
    return plan_chat(fmt, **{**args, **kw})


def test_auto_plans_a_lazy_grammar_only_where_it_applies():
    for choice in (None, "auto", {"type": "auto"}):
        plan = _plan(tool_choice=choice)
        assert plan.constraint is None and plan.call_start_id == 7
        assert plan.open_call.description == f"open_tool_call({', '.join(TOOL_MODELS)})"
    # Not when the user turned it off, a grammar already governs the answer, no tools are
    # rendered, or the grammar cannot write the format's own body (tests/test_xml_calls.py
    # covers Qwen3.5's XML, which it can).
    assert _plan(constrain_calls=False).open_call is None
    assert _plan(tool_choice="required").open_call is None
    assert _plan(response_format={"type": "json_object"}).open_call is None
    assert _plan(tool_choice="none").open_call is None
    assert _plan(tools=None).open_call is None
    mistral = ChatFormat(tool_call_start="[TOOL_CALLS]", tool_call_end="", tool_format="mistral",
                         tool_parser=lambda t, tools: t)
    assert _plan(mistral).open_call is None
    assert _plan(encode=lambda s: [7, 8]).open_call is None  # a start marker of several tokens


def _opens_a_call(engine):
    """A user processor that emits the tool-call start token first, then lets the model go."""
    start = engine.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(start) == 1
    step = 0

    def push(tokens, logits):
        nonlocal step
        step += 1
        if step > 1:
            return logits
        import mlx.core as mx

        return mx.where(mx.arange(logits.shape[-1]) == start[0], 0.0, -1e9).astype(logits.dtype)[None]

    return push


async def _opened_calls(engine, seeds, max_tokens=64):
    return await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s,
                                         logits_processors=[_opens_a_call(engine)]), tools=TOOLS)
        for s in seeds])


async def test_calls_a_random_model_opens_are_valid(engine, model_path):
    """Random weights: every call opened under "auto" parses, names a listed tool and
    validates against its schema; without the grammar the same requests give broken calls."""
    seeds = range(8)
    outs = await _opened_calls(engine, seeds)
    for out in outs:
        assert out.invalid_tool_calls == [], out.text
        assert out.tool_calls, out.text  # the pushed start token opened a call, and it closed
        for c in out.tool_calls:
            TOOL_MODELS[c.name].model_validate_json(c.arguments_json, strict=True)

    free = Engine(model_path, show_progress=False, constrain_tool_calls=False)
    await free.start()
    try:
        raw = await _opened_calls(free, seeds)
    finally:
        await free.close()
    assert sum(bool(o.invalid_tool_calls) or not o.tool_calls for o in raw) >= len(seeds) // 2


PATTERNED = [{"type": "function", "function": {"name": "tag", "description": "tag a record", "parameters": {
    "type": "object", "properties": {"code": {"type": "string", "pattern": "foo"},
                                     "path": {"type": "string", "pattern": r"\\$"}},
    "required": ["code", "path"], "additionalProperties": False}}}]


async def test_opened_and_forced_calls_meet_their_patterns_within_the_budget(qwen3_5_engine):
    """Arguments held to an unanchored literal or to a trailing backslash: closing mode
    writes out what the pattern needs, so a random model's call still closes in budget,
    opened under "auto" or forced."""
    runs = [dict(params=SamplingParams(max_tokens=n, temperature=1.0, seed=s,
                                       logits_processors=[_opens_a_call(qwen3_5_engine)]))
            for n in (40, 80) for s in range(3)]
    runs += [dict(params=SamplingParams(max_tokens=n, temperature=1.0, seed=s), tool_choice="tag")
             for n in (40, 80) for s in range(2)]
    outs = await asyncio.gather(*[qwen3_5_engine.chat(USER, tools=PATTERNED, **r) for r in runs])
    for out in outs:
        assert out.invalid_tool_calls == [] and len(out.tool_calls) >= 1, out.text
        for call in out.tool_calls:
            assert "foo" in call.arguments["code"] and call.arguments["path"].endswith("\\"), call.arguments


async def test_text_before_a_call_is_not_masked(qwen3_5_engine):
    """Until a call opens, the grammar passes the logits through: greedy text without
    tools equals greedy text with tools whenever no call is opened."""
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(6)]
    params = SamplingParams(max_tokens=24)
    start = qwen3_5_engine.tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
    on = await asyncio.gather(*[qwen3_5_engine.chat(p, params, tools=TOOLS) for p in prompts])
    free = Engine(qwen3_5_engine.loaded.path, show_progress=False, constrain_tool_calls=False)
    await free.start()
    try:
        off = await asyncio.gather(*[free.chat(p, params, tools=TOOLS) for p in prompts])
    finally:
        await free.close()
    for a, b in zip(on, off):
        if start not in b.token_ids:
            assert a.token_ids == b.token_ids


@pytest.mark.parametrize("opened", [False, True])
async def test_a_call_marker_inside_reasoning_is_reasoning_text(qwen3_5_engine, opened):
    """A <tool_call> the model writes while reasoning is reasoning text, as the output parser
    reads it: the lazy grammar held it to a call (the model's own text was lost) and the stop
    matcher stopped matching for the rest of the answer. After the reasoning a call is held
    to the grammar as before. ``opened``: the prompt ends in <think> (Qwen3.5's template)."""
    engine = qwen3_5_engine
    eos = engine.loaded.eos_token_ids[0]
    chat, options = USER, {"reasoning": True}
    if opened:
        chat = USER + [{"role": "assistant", "content": "<think>\n"}]
        options = {"template_kwargs": {"continue_final_message": True}}
    thought = "maybe <tool_call> later"
    head = ("" if opened else "<think>") + thought + "</think>"

    async def run(answer, room=3, **params):
        ids = engine.tokenizer.encode(answer, add_special_tokens=False)
        return await engine.chat(chat, SamplingParams(max_tokens=len(ids) + room, **params,
                                                      logits_processors=[forcing_processor(ids, eos)]),
                                 tools=TOOLS, **options)

    out = await run(head + "The answer} is here")
    assert (out.reasoning, out.content, out.finish_reason) == (thought, "The answer} is here", "stop")
    stopped = await run(head + "The answer} is here", stop=["}"])
    assert (stopped.reasoning, stopped.content, stopped.finish_reason) == (thought, "The answer", "stop")
    # After the reasoning, a call is held to the grammar: forced to a tool that does not exist,
    # it still names a listed one with valid arguments.
    called = await run(head + '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', room=40)
    assert [c.name for c in called.tool_calls] and not called.invalid_tool_calls
    assert {c.name for c in called.tool_calls} <= {t["function"]["name"] for t in TOOLS}


def _demo_tool_requests(n: int, turn: int):
    """Held-out tool dialogues of the demo model's evaluation split, cut before assistant
    turn ``turn`` (0: the call; 1: the answer after the tool result)."""
    module = sys.modules.get("demo_data")
    if module is None:  # loaded the way tests/test_demo_data.py loads it
        script = Path(__file__).resolve().parents[1] / "scripts" / "demo_data.py"
        spec = importlib.util.spec_from_file_location("demo_data", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules["demo_data"] = module
        spec.loader.exec_module(module)
    out = []
    for r in module.held_out_examples(160, seed=3):
        msgs = r["messages"]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if r["kind"] == "tool" and len(turns) > turn and len(out) < n:
            out.append((msgs[:turns[turn]], r["tools"]))
    return out


async def _demo_run(requests, mode, params, *, depth=2, chat_options=None, **options):
    engine = Engine(None, show_progress=False, mtp=mode, mtp_depth=depth, **options)
    await engine.start()
    try:
        each = params if isinstance(params, list) else [params] * len(requests)
        outs = await asyncio.gather(*[engine.chat(m, p, tools=t, **(chat_options or {}))
                                      for (m, t), p in zip(requests, each)])
        stats = engine.stats()
        return outs, {**stats["mtp"], "generation_tokens": stats["generation_tokens"]}
    finally:
        await engine.close()


needs_demo = pytest.mark.skipif(not is_packaged(), reason="the demo model's weights are not in this tree")


@needs_demo
def test_mtp_stays_lossless_with_calls():
    """The demo model opens calls by itself (as its first token). With MTP on, rows draft
    outside calls and inside them (held to the call grammar): the greedy output is exactly
    the plain output, and sampled rows (which draft under mode "on") make valid calls."""
    requests = _demo_tool_requests(16, turn=0)
    greedy = SamplingParams(max_tokens=48)
    ref, _ = asyncio.run(_demo_run(requests, "off", greedy))
    got, mtp = asyncio.run(_demo_run(requests, "on", greedy))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(bool(o.tool_calls) for o in ref) >= len(requests) // 2  # the model does open calls
    assert mtp["spec_steps"] > 0 and mtp["accepted"] > 0

    sampled, _ = asyncio.run(_demo_run(requests, "on", SamplingParams(max_tokens=96, temperature=0.8, seed=11)))
    for out, (_, tools) in zip(sampled, requests):
        assert out.invalid_tool_calls == []
        assert all(c.name in {t["function"]["name"] for t in tools} for c in out.tool_calls)


@needs_demo
def test_an_answer_ended_at_its_call_is_the_same_with_mtp_on_and_off():
    """parallel_tool_calls=False with no call grammar: a speculative step brings the call's
    end and the EOS after it in one delta, a plain step one by one. Tokens, text and usage
    are the same (the EOS after the call is not counted either way), and the engine's
    generation_tokens counts what the usages count: it counted the tokens the row decoded
    past its call before the reader cut it."""
    requests = _demo_tool_requests(16, turn=0)
    greedy = SamplingParams(max_tokens=48)
    opts = dict(depth=3, chat_options={"parallel_tool_calls": False}, constrain_tool_calls=False,
                prefix_cache_bytes=0)
    ref, plain = asyncio.run(_demo_run(requests, "off", greedy, **opts))
    got, mtp = asyncio.run(_demo_run(requests, "on", greedy, **opts))
    assert sum(o.finish_reason == "tool_calls" for o in ref) >= len(requests) // 2
    assert mtp["accepted"] > 0
    for a, b in zip(ref, got):
        assert (b.token_ids, b.text, b.usage, b.finish_reason) == (a.token_ids, a.text, a.usage, a.finish_reason)
    for outs, stats in ((ref, plain), (got, mtp)):
        assert stats["generation_tokens"] == sum(o.usage.completion_tokens for o in outs)


@needs_demo
def test_drafts_past_a_call_that_ends_the_answer_are_not_counted_accepted():
    """mtp.accepted counts the drafts that reached the output: a row ended at its call
    (parallel_tool_calls=False) counts what the same row stopped by max_tokens at that
    length counts. The drafts it verified past its call (the EOS, more text) counted too."""
    requests = _demo_tool_requests(16, turn=0)
    opts = dict(depth=3, constrain_tool_calls=False, prefix_cache_bytes=0)
    cut, at_call = asyncio.run(_demo_run(requests, "on", SamplingParams(max_tokens=48),
                                         chat_options={"parallel_tool_calls": False}, **opts))
    assert sum(o.finish_reason == "tool_calls" for o in cut) >= len(requests) // 2
    budgets = [SamplingParams(max_tokens=o.usage.completion_tokens) for o in cut]
    same, at_budget = asyncio.run(_demo_run(requests, "on", budgets, **opts))
    assert [o.token_ids for o in same] == [o.token_ids for o in cut]
    assert at_call["accepted"] == at_budget["accepted"] > 0


@needs_demo
def test_a_call_opened_inside_a_speculative_block_is_masked_from_there(monkeypatch):
    """The path where a start token arrives as an accepted draft, in mid-answer.

    The demo model only opens calls as its first token, which is never drafted; so here the
    grammar is armed by a common token of its text answers instead (both runs alike). The
    speculative step must mask every draft and verified position after that token with the
    opened grammar: the greedy output equals plain decoding's.
    """
    requests = _demo_tool_requests(16, turn=1)
    greedy = SamplingParams(max_tokens=40)
    plain, _ = asyncio.run(_demo_run(requests, "off", greedy))
    counts = Counter(t for o in plain for t in o.token_ids[2:])

    armed = {}
    real_init = LazyToolCallGrammar.__init__

    def armed_by_trigger(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, "start_id": armed["trigger"]})

    monkeypatch.setattr(LazyToolCallGrammar, "__init__", armed_by_trigger)
    opened = []  # a drafted start token accepted, and a draft after it accepted too
    real_settle = spec_batch.GrammarWalk.settle

    def spy(self, blocks, acc, contexts):
        opened.extend(armed["trigger"] in blocks[i][1:acc[i]] for i in self.idx)
        return real_settle(self, blocks, acc, contexts)

    monkeypatch.setattr(spec_batch.GrammarWalk, "settle", spy)
    # Whether a given token is ever an accepted draft depends on the weights: try the most
    # common ones in turn until one is (every try must be lossless).
    for trigger, _ in counts.most_common(4):
        armed["trigger"] = trigger
        ref, _ = asyncio.run(_demo_run(requests, "off", greedy))
        got, mtp = asyncio.run(_demo_run(requests, "on", greedy))
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        assert [o.token_ids for o in ref] != [o.token_ids for o in plain]  # the grammar armed
        if any(opened):
            break
    assert any(opened), "no drafted trigger was accepted with a draft after it: the path under test did not run"


@needs_demo
def test_reasoning_that_ends_inside_a_speculative_block_is_followed(monkeypatch):
    """A row's reasoning ends inside a speculative step's accepted block and the next token
    opens a call: the grammar must follow the block, so that the call is masked. It lagged
    such blocks (2026-11-28), so the row drafted the call unmasked (and the mask then
    refused tokens already accepted): greedy output parted from plain decoding's on half
    the requests.

    The demo model does not reason, so common tokens of its answers stand in for the
    reasoning's end and the call's start (two tokens apart), with every answer starting in
    reasoning, in both runs alike.
    """
    requests = _demo_tool_requests(16, turn=1)
    greedy = SamplingParams(max_tokens=40)
    plain, _ = asyncio.run(_demo_run(requests, "off", greedy))
    pairs = Counter((t[i], t[i + 2]) for t in (o.token_ids for o in plain) for i in range(2, len(t) - 2)
                    if t[i] != t[i + 2])

    armed = {}
    real_init = LazyToolCallGrammar.__init__

    def reasoning_first(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, "start_id": armed["start"], "think_ids": (-1, armed["end"]),
                                  "starts_in_reasoning": True})

    monkeypatch.setattr(LazyToolCallGrammar, "__init__", reasoning_first)
    ended_in_block = []
    real_settle = spec_batch.GrammarWalk.settle

    def spy(self, blocks, acc, contexts):
        # states[i][0]: the row's grammar after x (LazyToolCallGrammar.state: reasoning third).
        ended_in_block.extend(bool(self.states[i]) and self.states[i][0][2] and armed["end"] in blocks[i][1:acc[i] + 1]
                              for i in self.idx)
        return real_settle(self, blocks, acc, contexts)

    monkeypatch.setattr(spec_batch.GrammarWalk, "settle", spy)
    for (end, start), _ in pairs.most_common(4):
        armed.update(end=end, start=start)
        ref, _ = asyncio.run(_demo_run(requests, "off", greedy))
        got, mtp = asyncio.run(_demo_run(requests, "on", greedy))
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        assert [o.token_ids for o in ref] != [o.token_ids for o in plain]  # calls opened after reasoning
        if any(ended_in_block):
            break
    assert any(ended_in_block), "no reasoning ended inside an accepted block: the path under test did not run"


def test_the_option_must_be_a_bool():
    from mlx_tandem.errors import InvalidRequestError
    from mlx_tandem.options import EngineOptions

    assert EngineOptions().constrain_tool_calls is True
    with pytest.raises(InvalidRequestError, match="constrain_tool_calls"):
        EngineOptions(constrain_tool_calls="yes")
