"""Documented uses of MLXTandemLLM, for the type checker (never run: tests/test_typecheck.py).

LlamaIndex's ``dispatcher.span`` erases the signatures of the methods it wraps (core's too),
so ``structured_predict`` reads as returning Any: those lines check the call, not the type."""

from __future__ import annotations

from pathlib import Path

from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel

from llama_index.llms.mlx_tandem import MLXTandemLLM


class Answer(BaseModel):
    value: int


llm = MLXTandemLLM(max_tokens=64)
print(llm.chat([ChatMessage(role="user", content="Hello!")], max_tokens=8).message.content)
print(llm.structured_predict(Answer, PromptTemplate("What is {q}?"), q="2 + 3").value)
for partial in llm.stream_structured_predict(Answer, PromptTemplate("What is {q}?"), q="2 + 3"):
    print(partial)
MLXTandemLLM(model=Path("path/to/checkpoint"), stop=["\n"], mtp=True, logit_bias={42: -100.0})


async def amain() -> None:
    print((await llm.astructured_predict(Answer, PromptTemplate("What is {q}?"), q="2 + 3")).value)
    async for chunk in await llm.astream_chat([ChatMessage(role="user", content="hi")]):
        print(chunk.delta)
