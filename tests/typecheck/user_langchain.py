"""Documented uses of ChatMLX, for the type checker (never run: tests/test_typecheck.py)."""

from __future__ import annotations

from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage
from pydantic import BaseModel

from langchain_mlx_tandem import ChatMLX


class Answer(BaseModel):
    value: int


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


llm = ChatMLX(max_tokens=64)
print(llm.invoke([SystemMessage("be brief"), HumanMessage("hi")], max_tokens=8, stop=["x"]).usage_metadata)
print(llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?").tool_calls)
print(llm.with_structured_output(Answer).invoke("2 + 3?").value)
raw = llm.with_structured_output(Answer, method="function_calling", include_raw=True).invoke("x")
print(raw["parsed"])
ChatMLX(model=Path("path/to/checkpoint"), temperature=0.0, top_p=0.9, seed=1)
ChatMLX(stop=["\n"], logit_bias={42: -100}, mtp="off", logprobs=True, top_logprobs=3, n=2,
        engine_options={"max_batch_size": 16}, timeout=30)
ChatMLX(stop="\n", mtp=True)


async def amain() -> None:
    async for chunk in llm.astream("hi"):
        print(chunk.content)
    print((await llm.ainvoke("hi")).content)
