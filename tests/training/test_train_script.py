"""The demo-model training script: runs, checkpoints, resumes, exports a checkpoint the engine loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py"


def _run(out: Path, steps: int) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(steps), "--batch", "4",
                           "--n-dialogues", "24", "--save-every", "1", "--max-len", "832"],
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_train_resume_export(tmp_path):
    from mlx_tandem import Engine

    _run(tmp_path, 1)
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"step": 1}
    log = _run(tmp_path, 2)
    assert "resumed at step 1" in log
    final = tmp_path / "final"
    weights = mx.load(str(final / "model.safetensors"))
    assert any(k.startswith("mtp.") for k in weights)
    assert all(v.dtype == mx.float16 for v in weights.values())
    assert (final / "model.safetensors").stat().st_size < 25 * 2**20
    engine = Engine(final, show_progress=False)
    try:
        out = engine.chat_sync([{"role": "user", "content": "hi"}], {"max_tokens": 4})
        assert out.usage.completion_tokens == 4 or out.finish_reason == "stop"
    finally:
        engine.close_sync()
