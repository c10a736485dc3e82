"""One owner thread: load, every forward, cache and sampler work run on the engine thread."""

from __future__ import annotations

import asyncio
import threading

import mlx_lm.models.cache as cache_mod
import mlx.nn as nn
import mlx_lm.utils

from mlx_tandem import Engine, SamplingParams

from .prompts import chat_prompts


async def test_every_model_call_runs_on_the_owner_thread(qwen3_5_path, monkeypatch):
    seen: dict[str, set[str]] = {"load": set(), "forward": set(), "cache": set(), "sample": set()}

    real_load = mlx_lm.utils.load_model

    def load_model(*a, **k):
        seen["load"].add(threading.current_thread().name)
        model, config = real_load(*a, **k)
        real_call = type(model).__call__

        def call(self, *args, **kwargs):
            seen["forward"].add(threading.current_thread().name)
            return real_call(self, *args, **kwargs)

        monkeypatch.setattr(type(model), "__call__", call)
        return model, config

    monkeypatch.setattr(mlx_lm.utils, "load_model", load_model)
    # Speculative steps (MTP, on by "auto" for this hybrid model) run the backbone's layers
    # and the MTP head directly; every forward path starts with a token embedding.
    real_embed = nn.Embedding.__call__

    def embed(self, *args, **kwargs):
        seen["forward"].add(threading.current_thread().name)
        return real_embed(self, *args, **kwargs)

    monkeypatch.setattr(nn.Embedding, "__call__", embed)
    for cls in (cache_mod.KVCache, cache_mod.ArraysCache):
        real_init = cls.__init__

        def init(self, *a, _real=real_init, **k):
            seen["cache"].add(threading.current_thread().name)
            _real(self, *a, **k)

        monkeypatch.setattr(cls, "__init__", init)

    def processor(tokens, logits):
        seen["sample"].add(threading.current_thread().name)
        return logits

    engine = Engine(qwen3_5_path, show_progress=False)
    try:
        await engine.start()
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, logits_processors=[processor])
        await asyncio.gather(*[engine.chat(p, params) for p in chat_prompts(6)])
        # Sync callers from other threads too.
        threads = [threading.Thread(target=engine.chat_sync, args=(p, params)) for p in chat_prompts(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        owner = engine.owner_thread.name
    finally:
        await engine.close()
    assert owner != threading.current_thread().name
    for what, names in seen.items():
        assert names == {owner}, f"{what} ran on {names}, expected only {owner!r}"
