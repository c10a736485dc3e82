"""Per-request routing on a vision checkpoint: one copy of the weights serves a text lane
(mlx-lm text model on the VLM's own arrays, with MTP) and a vision lane (mlx-vlm)."""

from __future__ import annotations

import asyncio
import base64
import io
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_tandem import Engine
from mlx_tandem.errors import InvalidRequestError, UnsupportedContentError
from mlx_tandem.model_loader import text_model_from_vlm

from .numerics import same_greedy, tolerance

MAX = 10


def _image(seed: int, size: int):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8"))


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


def _user(*parts):
    return {"role": "user", "content": list(parts)}


def _img_part(src):
    return {"type": "image", "image": src}


def _text(t):
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def vl_engine(qwen3_5_vl_path):
    engine = Engine(qwen3_5_vl_path, show_progress=False, max_batch_size=8)
    engine.start_sync()
    yield engine
    engine.close_sync()


@pytest.fixture(scope="module")
def qwen3_5_vl_4bit_path(qwen3_5_vl_path, tmp_path_factory):
    """The factory VLM quantized by mlx-vlm's converter: the form most published VLMs take."""
    from mlx_vlm import convert

    path = tmp_path_factory.mktemp("vl4") / "qwen3_5_vl_4bit"
    convert(str(qwen3_5_vl_path), mlx_path=str(path), quantize=True, q_bits=4, q_group_size=32)
    return path


@pytest.mark.parametrize("checkpoint", ["qwen3_5_vl_path", "qwen3_5_vl_4bit_path", "qwen3_5_moe_vl_path"])
def test_text_model_shares_every_array_with_the_vlm(checkpoint, request):
    import json

    from mlx_vlm import load

    path = request.getfixturevalue(checkpoint)
    vlm, _ = load(str(path))
    mx.eval(vlm.parameters())
    config = json.loads((path / "config.json").read_text())
    before = mx.get_active_memory()
    text = text_model_from_vlm(vlm, config)
    mx.eval(text.parameters())
    grown = mx.get_active_memory() - before
    ours = dict(tree_flatten(text.parameters()))
    theirs = {"language_model." + k: v for k, v in tree_flatten(vlm.language_model.parameters())}
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert all(ours[k] is theirs[k] for k in ours)  # the same objects, not equal copies
    total = sum(v.nbytes for _, v in tree_flatten(vlm.parameters()))
    assert grown < 0.01 * total, (grown, total)
    # And the same function: the text model's logits are the VLM language model's.
    tokens = mx.array([[3, 14, 15, 92, 65, 35]])
    np.testing.assert_allclose(np.array(text(tokens)), np.array(vlm.language_model(tokens).logits),
                               **tolerance(rtol=1e-4, atol=1e-4))
    if "4bit" in checkpoint:
        assert sum(isinstance(m, nn.QuantizedLinear) for _, m in text.named_modules()) > 4


def test_engine_text_lane_runs_on_the_vlm_arrays(vl_engine):
    def check():
        loaded = vl_engine.loaded
        ours = dict(tree_flatten(loaded.model.parameters()))
        theirs = {"language_model." + k: v for k, v in tree_flatten(loaded.vlm.language_model.parameters())}
        return all(ours[k] is theirs[k] for k in ours) and ours.keys() == theirs.keys()

    assert vl_engine.run_on_owner_thread(check)
    assert vl_engine.model_info().supports_images


def _lane_counts(engine, messages_list):
    before = engine.stats()["lane_requests"]
    for m in messages_list:
        engine.chat_sync(m, {"max_tokens": 2})
    after = engine.stats()["lane_requests"]
    return {k: after[k] - before.get(k, 0) for k in after}


def test_routing_by_content(vl_engine, tmp_path):
    img = _image(0, 32)
    path = tmp_path / "img.png"
    path.write_bytes(_png(img))
    text_only = [
        [{"role": "user", "content": "plain string"}],
        [_user(_text("a list of text parts"), _text("only"))],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "42"}],
    ]
    with_media = [
        [_user(_text("what is this?"), _img_part(_data_uri(img)))],
        [_user({"type": "image_url", "image_url": {"url": _data_uri(img)}}, _text("and this?"))],
        [_user(_img_part(str(path)), _text("from a path")), {"role": "assistant", "content": "ok"},
         {"role": "user", "content": "the image was in an earlier turn"}],
        [_user(_img_part(_png(img)), _text("raw bytes"))],
        [_user({"type": "input_image", "image_url": base64.b64encode(_png(img)).decode()}, _text("bare base64"))],
    ]
    assert _lane_counts(vl_engine, text_only) == {"text": 3, "vision": 0}
    assert _lane_counts(vl_engine, with_media) == {"text": 0, "vision": 5}


def test_mixed_traffic_and_image_output_equals_mlx_vlm_generate(vl_engine, qwen3_5_vl_path):
    from mlx_vlm import generate, load

    images = [_image(1, 64), _image(2, 96)]
    image_msgs = [[_user(_img_part(_data_uri(im)), _text(f"Describe picture {i}."))] for i, im in enumerate(images)]
    text_msgs = [[{"role": "user", "content": f"Tell me about topic {i}."}] for i in range(6)]

    async def run():
        return await asyncio.gather(*(vl_engine.chat(m, {"max_tokens": MAX}) for m in text_msgs + image_msgs))

    before = vl_engine.stats()["max_batch_size"]
    outs = asyncio.run(run())
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert vl_engine.stats()["max_batch_size"] >= max(before, 2)

    # Text requests: the same answers one at a time (the lanes do not disturb each other).
    for m, o in zip(text_msgs, outs[:6]):
        same_greedy(o.token_ids, vl_engine.chat_sync(m, {"max_tokens": MAX}).token_ids, judge=vl_engine,
                    prompt_ids=vl_engine.apply_chat_template(m), what="a text request beside images")

    # Image requests: exactly what mlx-vlm's own generate says for the same prompt and image.
    model, processor = load(str(qwen3_5_vl_path))
    tok = vl_engine.tokenizer
    for im, m, o in zip(images, image_msgs, outs[6:]):
        text = tok.decode(vl_engine.apply_chat_template(m), skip_special_tokens=False)
        ref = generate(model, processor, text, image=[im], max_tokens=MAX, temperature=0.0, verbose=False)
        assert o.text == ref.text, (o.text, ref.text)


def test_responses_api_text_parts_beside_an_image_reach_the_prompt(vl_engine):
    img = _img_part(_data_uri(_image(8, 32)))
    as_text = vl_engine.apply_chat_template([_user(img, _text("Describe this picture please"))])
    for kind in ("input_text", "output_text"):
        msgs = [_user(img, {"type": kind, "text": "Describe this picture please"})]
        assert vl_engine.apply_chat_template(msgs) == as_text, kind


def test_a_media_placeholder_in_the_text_of_an_image_request_is_refused(vl_engine):
    """mlx-vlm's processor finds images by their placeholder string; a literal one in the
    text took the image's place (the template's own marker was dropped) and the request ran
    on misplaced features. It is refused, naming where it stands; text-only requests carry it
    as tokens, as a Hugging Face template does."""
    pad = vl_engine.loaded.processor.image_token
    img = _img_part(_data_uri(_image(0, 64)))
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    tool = {"type": "function", "function": {"name": "look", "description": f"reads {pad}",
                                             "parameters": {"type": "object", "properties": {}}}}
    refused = [
        ([_user(img, _text(f"what is {pad}?"))], None, "messages[0].content[1].text"),
        ([{"role": "system", "content": f"never say {pad}"}, _user(img)], None, "messages[0].content"),
        ([_user(img), {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c1", "content": pad}], None, "messages[2].content"),
        ([_user(img, _text("look"))], [tool], "tools[0].function.description"),
    ]
    for messages, tools, where in refused:
        with pytest.raises(InvalidRequestError, match=re.escape(f"{where} contains {pad!r}")):
            vl_engine.chat_sync(messages, {"max_tokens": 2}, tools=tools)
    clean = [_user(img, _text("what is this?"))]
    assert _lane_counts(vl_engine, [clean, [_user(_text(f"what is {pad}?"))]]) == {"text": 1, "vision": 1}


def test_an_image_request_joins_a_running_image_batch(qwen3_5_vl_path):
    """Continuous batching on the vision lane: a request that arrives while another image
    request decodes starts at once (mlx-vlm admits only when a whole prefill batch of rows is
    free, which with max_batch_size <= prefill_batch_size meant waiting for the batch to
    drain), and gives its one-at-a-time output."""
    engine = Engine(qwen3_5_vl_path, show_progress=False, max_batch_size=2)

    def never_stop(tokens, logits):  # keep the first request decoding to its budget
        banned = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
        banned[never_stop.eos] = True
        return mx.where(banned, mx.array(-1e9, logits.dtype), logits)

    long_msgs = [_user(_img_part(_data_uri(_image(6, 64))), _text("Describe it at length."))]
    short_msgs = [_user(_img_part(_data_uri(_image(7, 64))), _text("Describe it."))]

    async def run():
        await engine.start()
        never_stop.eos = mx.array(sorted(engine.loaded.eos_token_ids))
        alone = await engine.chat(short_msgs, {"max_tokens": MAX})
        long_stream = await engine.open_chat_stream(long_msgs, {"max_tokens": 3000,
                                                                "logits_processors": [never_stop]})
        await long_stream.__anext__()  # decoding
        joined = await engine.chat(short_msgs, {"max_tokens": MAX})
        long_running = engine.run_on_owner_thread(lambda: engine._core._lanes["vision"].num_active)
        await long_stream.aclose()
        await engine.close()
        return alone, joined, long_running

    alone, joined, long_running = asyncio.run(run())
    assert long_running == 1  # the long request was still decoding when the joiner finished
    assert joined.token_ids == alone.token_ids


def test_structured_output_on_an_image_closes_within_the_expanded_prompts_room(qwen3_5_vl_path):
    """The grammar's budget is the room left after the images are expanded (known only in
    the vision lane), not the room the one-placeholder prompt seemed to leave."""
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    msgs = [_user(_img_part(_data_uri(_image(1, 128))), _text("give json"))]
    probe = Engine(qwen3_5_vl_path, show_progress=False)
    try:
        text_only = len(probe.apply_chat_template([_user(_text("give json"))]))
        expanded = probe.chat_sync(msgs, {"max_tokens": 1}).usage.prompt_tokens
        assert len(probe.apply_chat_template(msgs)) == expanded  # counted as the lane expands it
    finally:
        probe.close_sync()
    assert expanded > text_only + 8
    engine = Engine(qwen3_5_vl_path, show_progress=False, max_model_len=expanded + 25)
    try:
        out = engine.chat_sync(msgs, {"max_tokens": 1000},
                               response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    finally:
        engine.close_sync()
    assert len(out.token_ids) <= 25 and out.finish_reason == "stop"
    assert set(json.loads(out.text)) == {"a", "b"}


def test_an_image_too_long_for_the_context_is_refused_before_the_encoder_runs(qwen3_5_vl_path, monkeypatch):
    """The expanded prompt's length is known from the processor: an image that cannot fit is
    refused without a vision-encoder pass that the lane's other rows would wait for."""
    from mlx_tandem.errors import ContextLengthError

    from .spies import encoder_passes

    encoded = encoder_passes(monkeypatch)
    small = [_user(_img_part(_data_uri(_image(6, 32))), _text("?"))]
    large = [_user(_img_part(_data_uri(_image(7, 256))), _text("?"))]
    engine = Engine(qwen3_5_vl_path, show_progress=False)
    try:
        fits = engine.chat_sync(small, {"max_tokens": 2}).usage.prompt_tokens
        large_tokens = engine.chat_sync(large, {"max_tokens": 1}).usage.prompt_tokens
    finally:
        engine.close_sync()
    assert encoded == [fits, large_tokens] and large_tokens > fits + 8

    encoded.clear()
    engine = Engine(qwen3_5_vl_path, show_progress=False, max_model_len=fits + 4)
    try:
        with pytest.raises(ContextLengthError) as err:
            engine.chat_sync(large, {"max_tokens": 2})
        assert encoded == []  # refused before the encoder
        out = engine.chat_sync(small, {"max_tokens": 2})
    finally:
        engine.close_sync()
    assert err.value.prompt_tokens == large_tokens
    assert encoded == [fits] and out.usage.prompt_tokens == fits
    assert "before its images" not in str(err.value)  # the lane's count is exact

    # Text alone past the window: refused before the lane expands the image, with the count
    # of the text and one placeholder, which the message calls a floor (review h155: it
    # read as the prompt's size, and a client trimming by it trimmed too little).
    long_text = [_user(_img_part(_data_uri(_image(7, 256))), _text("?" * (4 * fits)))]
    engine = Engine(qwen3_5_vl_path, show_progress=False, max_model_len=fits + 4)
    try:
        with pytest.raises(ContextLengthError) as err:
            engine.chat_sync(long_text, {"max_tokens": 2})
        expanded = len(engine.apply_chat_template(long_text))
    finally:
        engine.close_sync()
    assert "tokens before its images are expanded" in str(err.value) and encoded == [fits]
    assert fits + 4 <= err.value.prompt_tokens < expanded


def test_bad_images_fail_their_own_request_only(qwen3_5_vl_path, tmp_path):
    engine = Engine(qwen3_5_vl_path, show_progress=False, max_image_pixels=64 * 64)

    async def run():
        await engine.start()
        good = [asyncio.create_task(engine.chat([{"role": "user", "content": f"q{i}"}], {"max_tokens": 8}))
                for i in range(3)]
        good.append(asyncio.create_task(engine.chat([_user(_img_part(_data_uri(_image(3, 32))), _text("ok"))],
                                                    {"max_tokens": 8})))
        errors = []
        for bad in (_img_part("data:image/png;base64,bm90IGFuIGltYWdl"),  # decodes to "not an image"
                    _img_part("this is neither a path nor base64!"),
                    _img_part(_data_uri(_image(4, 128))),  # 16384 pixels > 4096
                    _img_part(str(tmp_path / "missing.png")),
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "video", "video": "clip.mp4"}):
            try:
                await engine.chat([_user(bad, _text("?"))], {"max_tokens": 4})
            except (InvalidRequestError, UnsupportedContentError) as exc:
                errors.append(type(exc))
        outs = await asyncio.gather(*good)
        await engine.close()
        return errors, outs

    errors, outs = asyncio.run(run())
    assert len(errors) == 6
    assert errors[4] is UnsupportedContentError and errors[5] is UnsupportedContentError  # remote off; video
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in outs)


def test_remote_images_only_when_enabled(qwen3_5_vl_path, monkeypatch):
    from mlx_tandem import media

    fetched = []

    def fake_fetch(url):
        fetched.append(url)
        return _png(_image(5, 32))

    monkeypatch.setattr(media, "_read_remote", fake_fetch)
    engine = Engine(qwen3_5_vl_path, show_progress=False, allow_remote_images=True)
    try:
        out = engine.chat_sync([_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                      _text("?"))], {"max_tokens": 4})
    finally:
        engine.close_sync()
    assert fetched == ["https://example.com/a.png"] and out.token_ids


def test_image_on_a_text_checkpoint_is_a_typed_error(qwen3_5_engine):
    async def run():
        with pytest.raises(UnsupportedContentError):
            await qwen3_5_engine.chat([_user(_img_part(_data_uri(_image(0, 16))), _text("?"))])
        return await qwen3_5_engine.chat([{"role": "user", "content": "still serving"}], {"max_tokens": 3})

    assert asyncio.run(run()).token_ids


def test_a_vision_checkpoint_without_tower_weights_serves_text_and_refuses_images(qwen3_5_vl_path, tmp_path, caplog):
    """mlx-vlm loads it with a warning and no tower: every image request then failed inside
    the tower as the caller's InvalidRequestError. It is served as a text model instead,
    saying why at load; its text answers are the intact checkpoint's."""
    import logging
    import shutil

    broken = tmp_path / "no-tower"
    shutil.copytree(qwen3_5_vl_path, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if "visual" not in k}
    assert len(kept) < len(weights)
    mx.save_safetensors(str(broken / "model.safetensors"), kept, metadata={"format": "mlx"})
    chat = [{"role": "user", "content": "plain text"}]
    with caplog.at_level(logging.WARNING, logger="mlx_tandem"):
        engine = Engine(str(broken), show_progress=False)
        engine.start_sync()
    try:
        assert not engine.loaded.supports_images and "no vision tower weights" in caplog.text
        assert not engine.model_info().supports_images  # the config's vision_config says otherwise
        with pytest.raises(UnsupportedContentError):
            engine.chat_sync([_user(_img_part(_data_uri(_image(0, 16))), _text("?"))], {"max_tokens": 3})
        out = engine.chat_sync(chat, {"max_tokens": 6})
    finally:
        engine.close_sync()
    with Engine(qwen3_5_vl_path, show_progress=False) as whole:
        assert out.token_ids == whole.chat_sync(chat, {"max_tokens": 6}).token_ids
