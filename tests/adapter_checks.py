"""Checks both adapters' tests run alike (each passes its own class and model paths)."""

from __future__ import annotations


def relative_model_path_is_fixed_at_construction(make, paths: dict, tmp_path, monkeypatch) -> None:
    """The engine is made on the first call: a relative path then followed the working
    directory to another model. Fixed at construction, as Engine fixes it; a model changed
    afterwards is the new one."""
    for where, kind in (("a", "llama"), ("b", "qwen3_5")):
        (tmp_path / where).mkdir()
        (tmp_path / where / "model").symlink_to(paths[kind], target_is_directory=True)
    monkeypatch.chdir(tmp_path / "a")
    llm = make(model="model")
    monkeypatch.chdir(tmp_path / "b")
    assert llm.model == "model" and llm.engine.model_info(load=False).model_type == "llama"
    llm.model = paths["qwen3_5"]
    assert llm.engine.model_info(load=False).model_type == "qwen3_5"
