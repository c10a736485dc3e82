"""Both adapters take images end to end on a vision checkpoint; the answer is the engine's."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import HumanMessage  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock  # noqa: E402

from langchain_mlx_tandem import ChatMLX  # noqa: E402
from langchain_mlx_tandem._convert import to_engine_messages as lc_messages  # noqa: E402
from llama_index.llms.mlx_tandem import MLXTandemLLM  # noqa: E402
from llama_index.llms.mlx_tandem._convert import to_engine_messages as li_messages  # noqa: E402

OPTS = {"show_progress": False}


def _png(seed: int = 0, size: int = 48) -> bytes:
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_chatmlx_image_blocks(qwen3_5_vl_path):
    llm = ChatMLX(model=str(qwen3_5_vl_path), engine_options=OPTS, max_tokens=8)
    b64 = base64.b64encode(_png()).decode()
    msg = HumanMessage(content=[{"type": "text", "text": "What is in the picture?"},
                                {"type": "image", "base64": b64, "mime_type": "image/png"}])
    out = llm.invoke([msg])
    ref = llm.engine.chat_sync(lc_messages([msg]), {"max_tokens": 8})
    assert out.content == ref.text
    assert out.usage_metadata["input_tokens"] == ref.usage.prompt_tokens  # image tokens counted
    # Counting before sending (trim_messages) sees the images' tokens too: each image size
    # its own count. apply_chat_template rendered the text only, so every size counted alike.
    for size in (32, 96):
        sized = HumanMessage(content=[{"type": "text", "text": "What is in the picture?"}, {
            "type": "image", "base64": base64.b64encode(_png(size=size)).decode(), "mime_type": "image/png"}])
        assert llm.get_num_tokens_from_messages([sized]) == llm.invoke([sized]).usage_metadata["input_tokens"]

    async def stream():
        return "".join([c.content async for c in llm.astream([msg])])

    assert asyncio.run(stream()) == ref.text
    before = llm.engine.stats()["lane_requests"]["vision"]
    llm.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                                      {"type": "text", "text": "again"}])])
    assert llm.engine.stats()["lane_requests"]["vision"] == before + 1
    # The profile says images may come in tool results too, and they do go the vision path.
    assert llm.profile["image_inputs"] is llm.profile["image_tool_message"] is True
    assert llm.profile["image_url_inputs"] is False  # remote images are off unless the engine allows them
    from langchain_core.messages import AIMessage, ToolMessage

    llm.invoke([HumanMessage("take a picture"),
                AIMessage("", tool_calls=[{"name": "camera", "args": {}, "id": "c1"}]),
                ToolMessage(content=[{"type": "image", "base64": b64, "mime_type": "image/png"}], tool_call_id="c1")])
    assert llm.engine.stats()["lane_requests"]["vision"] == before + 2


def test_llama_index_image_blocks(qwen3_5_vl_path, tmp_path):
    llm = MLXTandemLLM(model=str(qwen3_5_vl_path), engine_options=OPTS, max_tokens=8)
    path = tmp_path / "pic.png"
    path.write_bytes(_png(1))
    for block in (ImageBlock(image=_png(1)), ImageBlock(path=path)):
        msg = ChatMessage(role="user", blocks=[TextBlock(text="Describe it."), block])
        out = llm.chat([msg])
        ref = llm.engine.chat_sync(li_messages([msg]), {"max_tokens": 8})
        assert out.message.content == ref.text
    assert llm.metadata.is_function_calling_model
