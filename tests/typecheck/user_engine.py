"""Documented uses of the engine API, for the type checker (never run: tests/test_typecheck.py).

Every line here is correct user code; a type error in it is a wrong annotation of ours."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal, TypedDict

from mlx_tandem import (ContextLengthError, Engine, EngineOptions, InvalidRequestError, RequestOutput,
                        SamplingParams, TandemError, normalize_messages)
from mlx_tandem.outputs import ToolCall


class Msg(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


history: list[Msg] = [{"role": "user", "content": "Hello!"}]
messages = [{"role": "user", "content": "Hello!"}]


async def main() -> None:
    async with Engine() as engine:
        out = await engine.chat(messages, SamplingParams(max_tokens=64, temperature=0.0))
        print(out.text, out.finish_reason, out.usage.prompt_tokens)
        async for delta in engine.stream_chat(history, SamplingParams(max_tokens=64, stop=["\n\n"])):
            print(delta.text, end="")
        outs = await asyncio.gather(*[engine.chat(messages, {"max_tokens": 32}) for _ in range(4)])
        first: RequestOutput = outs[0]
        print(first.usage.total_tokens, engine.stats()["max_batch_size"])
        stream = await engine.open_chat_stream(history, {"max_tokens": 8}, timeout=5.0)
        async with stream:
            async for d in stream:
                print(d.text)
        done = await engine.complete("abc", {"max_tokens": 4})
        print(done.prompt_token_ids)
        print(engine.apply_chat_template(history))


engine = Engine(Path("path/to/checkpoint"), max_batch_size=8)
out = engine.chat_sync(history, {"max_tokens": 8})
for delta in engine.stream_chat_sync(messages):
    print(delta.text, end="")
tools = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
calls: list[ToolCall] = engine.chat_sync(messages, {"max_tokens": 64}, tools=tools, tool_choice="add").tool_calls
print(calls[0].name, calls[0].arguments)

params = [
    SamplingParams(max_tokens=16, stop="\n"),
    SamplingParams(max_tokens=16, stop=["a", "b"]),
    SamplingParams(max_tokens=16, logit_bias={42: -100.0}),
    SamplingParams(max_tokens=16, mtp=True),
    SamplingParams(max_tokens=16, logits_processors=[lambda tokens, logits: logits]),
    SamplingParams(max_tokens=16, seed=1, top_k=5, top_p=0.9, presence_penalty=None),
]
print(engine.model_info().context_length, engine.encode("hi"), normalize_messages(messages))
try:
    engine.complete_sync([1, 2, 3], SamplingParams(max_tokens=8))
except ContextLengthError as exc:
    print(exc)
except (InvalidRequestError, TandemError):
    pass
print(EngineOptions(max_batch_size=4))
engine.close_sync()
