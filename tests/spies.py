"""Spies that count what the engine runs, for tests that assert work was not repeated."""

from __future__ import annotations


def encoder_passes(monkeypatch) -> list[int]:
    """The prompt length of every vision-encoder pass of the factory Qwen3.5 VLM, in order."""
    from mlx_vlm.models.qwen3_5 import Model

    passes: list[int] = []
    original = Model.get_input_embeddings

    def counting(self, input_ids=None, pixel_values=None, **kwargs):
        passes.append(input_ids.shape[-1])
        return original(self, input_ids, pixel_values, **kwargs)

    monkeypatch.setattr(Model, "get_input_embeddings", counting)
    return passes
