"""End to end: query engines, agents, and LangChain + LlamaIndex sharing one engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ReActAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.tools import FunctionTool

from langchain_mlx_tandem import ChatMLX
from llama_index.llms.mlx_tandem import MLXTandemLLM

from ..numerics import AnswerLog
from .conftest import PATHS

DOCS = [Document(text=f"Fact {i}: the harbour of town {i} holds {i * 3} boats. " * 4) for i in range(8)]


def private_llm(tag: int, **kw) -> MLXTandemLLM:
    """An LLM on its own engine (distinct options), so batch statistics are this test's alone."""
    kw.setdefault("max_tokens", 12)
    return MLXTandemLLM(model=PATHS["qwen3_5"], engine_options={"show_progress": False, "max_waiting": 5000 + tag},
                        **kw)


@pytest.fixture
def index():
    # MockEmbedding: offline, deterministic vectors; retrieval order is not under test.
    return VectorStoreIndex.from_documents(DOCS, embed_model=MockEmbedding(embed_dim=8),
                                           transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0)])


# ---------------------------------------------------------------------- query engines
async def test_query_engine_sync_async_and_streaming_agree(index):
    llm = private_llm(1)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    sync = qe.query("How many boats are in town 3?")
    assert sync.source_nodes and isinstance(sync.response, str) and sync.response
    assert (await qe.aquery("How many boats are in town 3?")).response == sync.response
    streaming = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True)
    assert "".join(streaming.query("How many boats are in town 3?").response_gen) == sync.response
    astreamed = await streaming.aquery("How many boats are in town 3?")
    assert "".join([t async for t in astreamed.async_response_gen()]) == sync.response


@pytest.fixture
def model_tokenizer():
    """``Settings.tokenizer = llm.tokenize`` for one test (the tokenizer is global)."""
    import llama_index.core

    saved = llama_index.core.global_tokenizer
    yield lambda llm: setattr(Settings, "tokenizer", llm.tokenize)
    llama_index.core.global_tokenizer = saved


@pytest.mark.parametrize("mode", ["compact", "tree_summarize", "refine"])
def test_retrieved_text_fits_the_window_when_counted_by_the_models_tokenizer(model_tokenizer, mode):
    """The factory tokenizer spells English in about twice as many tokens as tiktoken's
    cl100k, LlamaIndex's default: counted that way, tree_summarize packed 6,435 of its
    tokens into a 4,096 window (ContextLengthError). Counted with ``llm.tokenize``, every
    call fits."""
    from llama_index.core import get_response_synthesizer
    from llama_index.core.schema import NodeWithScore, TextNode

    llm = private_llm(12, max_tokens=8)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    nodes = [NodeWithScore(node=TextNode(text=readme[i:i + 3500]), score=1.0) for i in range(0, 14000, 3500)]
    model_tokenizer(llm)
    before = llm.engine.stats()["requests"]
    response = get_response_synthesizer(llm=llm, response_mode=mode).synthesize("What does it do?", nodes=nodes)
    assert isinstance(response.response, str)
    assert llm.engine.stats()["requests"] > before  # the model answered (no call was refused)


@pytest.mark.parametrize("mode", ["accumulate", "tree_summarize"])
def test_use_async_fan_out_runs_as_one_batch(index, mode):
    # A small context window makes tree_summarize split the 8 chunks into several summaries.
    llm = private_llm(10 if mode == "accumulate" else 11, context_window=300, max_tokens=8)
    fan_out = index.as_query_engine(llm=llm, similarity_top_k=8, response_mode=mode, use_async=True)
    calls_before = llm.engine.stats()["requests"]
    answer = fan_out.query("Which towns have boats?")
    stats = llm.engine.stats()
    first_round = 8 if mode == "accumulate" else stats["max_batch_size"]
    assert stats["max_batch_size"] >= 4
    assert stats["max_batch_size"] == first_round
    assert stats["requests"] - calls_before >= stats["max_batch_size"]
    one_by_one = index.as_query_engine(llm=llm, similarity_top_k=8, response_mode=mode, use_async=False)
    assert one_by_one.query("Which towns have boats?").response == answer.response  # batched == alone


# ---------------------------------------------------------------------- agents
async def test_function_agent_with_forced_first_call():
    calls = []

    def add_tool(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    llm = private_llm(20, max_tokens=60)
    # The random-weight model cannot decide to call a tool: force the first call by name.
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=add_tool, name="add")], llm=llm,
                          initial_tool_choice="add", system_prompt="Use tools.")
    handler = agent.run(user_msg="What is 2 + 3?")
    results, deltas = [], []
    async for ev in handler.stream_events():
        if isinstance(ev, ToolCallResult):
            results.append(ev)
        elif isinstance(ev, AgentStream):
            deltas.append(ev.delta)
    response = await handler
    assert len(calls) == 1 and len(results) == 1
    assert results[0].tool_name == "add" and results[0].tool_kwargs == {"a": calls[0][0], "b": calls[0][1]}
    assert results[0].tool_output.raw_output == sum(calls[0])
    assert [c.tool_name for c in response.tool_calls] == ["add"]  # one call, then an answer
    assert "".join(deltas).endswith(response.response.content or "")


class _ReActForcing(MLXTandemLLM):
    """Stands in for a model that follows the ReAct format: a grammar picks the step.

    Before any observation the answer is forced to be an action on ``add``; after one, a
    final answer. The thought and the arguments are still the model's own tokens.
    """

    def _chat_request(self, messages, kwargs):
        seen = any(m.role != "system" and (m.content or "").startswith("Observation:") for m in messages)
        if seen:
            grammar = r'start: "Thought: I can answer without using any more tools.\nAnswer: " /[a-z ]{1,20}/'
        else:
            grammar = (r'start: "Thought: I need to use a tool to help me answer the question.\n'
                       r'Action: add\nAction Input: {\"a\": " /[1-9]/ ", \"b\": " /[1-9]/ "}"')
        kwargs = {**kwargs, "response_format": {"type": "lark", "grammar": grammar}}
        return super()._chat_request(messages, kwargs)


async def test_react_agent_runs_a_tool_and_answers():
    calls = []

    def add_tool(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    llm = _ReActForcing(model=PATHS["qwen3_5"], max_tokens=60, engine_options={"show_progress": False})
    agent = ReActAgent(tools=[FunctionTool.from_defaults(fn=add_tool, name="add")], llm=llm)
    handler = agent.run(user_msg="What is 2 + 3?")
    results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
    response = await handler
    assert len(calls) == 1 and results[0].tool_output.raw_output == sum(calls[0])
    assert str(response.response.content).strip()


# ---------------------------------------------------------------------- one engine, two frameworks
async def test_langchain_and_llama_index_share_one_engine_concurrently(monkeypatch):
    log = AnswerLog(monkeypatch)  # exact text on the CPU; near-ties on a GPU (tests/numerics.py)
    opts = {"show_progress": False, "max_waiting": 5030}
    li = MLXTandemLLM(model=PATHS["qwen3_5"], max_tokens=12, engine_options=opts)
    lc = ChatMLX(model=PATHS["qwen3_5"], max_tokens=12, engine_options=opts)
    assert li.engine is lc.engine  # one set of weights
    prompts = [f"question {i}" for i in range(4)]
    alone_li = [(await li.achat([ChatMessage(role="user", content=p)])).message.content for p in prompts]
    alone_lc = [(await lc.ainvoke([HumanMessage(p)])).content for p in prompts]
    assert alone_li == alone_lc  # same engine, same prompts, one at a time: the same greedy answers
    together = await asyncio.gather(*(li.achat([ChatMessage(role="user", content=p)]) for p in prompts),
                                    *(lc.ainvoke([HumanMessage(p)]) for p in prompts))
    log.same_answers([r.message.content for r in together[:4]], alone_li, judge=li.engine)
    log.same_answers([m.content for m in together[4:]], alone_lc, judge=li.engine)
    assert li.engine.stats()["max_batch_size"] == 8  # both frameworks in the same forward steps


def test_settings_llm_is_used_by_query_engines(index):
    llm = private_llm(40)
    Settings.llm = llm
    try:
        before = llm.engine.stats()["requests"]
        index.as_query_engine(similarity_top_k=1).query("town 1?")
        assert llm.engine.stats()["requests"] == before + 1
    finally:
        Settings.llm = None
