"""The README's demo command works on a fresh machine: builds the default model, exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_on_a_fresh_cache(tmp_path):
    env = {**os.environ, "MLX_TANDEM_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlx_tandem.demo", "--concurrency", "4", "--max-tokens", "8"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "random weights" in proc.stdout  # it says plainly that the words are noise
    assert "max_batch_size           4" in proc.stdout
    assert (tmp_path / "models").is_dir()
    # Second run reuses the built model.
    proc = subprocess.run([sys.executable, "-m", "mlx_tandem.demo", "--concurrency", "2", "--max-tokens", "4"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
