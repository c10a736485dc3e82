"""The README's demo command works on a fresh machine, offline, and exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys

from mlx_tandem.default_model import is_packaged


def test_demo_on_a_fresh_cache(tmp_path):
    env = {**os.environ, "MLX_TANDEM_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlx_tandem.demo", "--concurrency", "4", "--max-tokens", "8"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max_batch_size           4" in proc.stdout
    assert "tool calls:" in proc.stdout and "mtp_acceptance_rate" in proc.stdout
    if is_packaged():  # the trained model ships in the package: nothing is built
        assert "embedded demo model is tiny" in proc.stdout
        assert not (tmp_path / "models").exists()
    else:  # a source tree without the weights: a random stand-in, said plainly
        assert "random-weight model stands in" in proc.stdout
        assert (tmp_path / "models").is_dir()
    proc = subprocess.run([sys.executable, "-m", "mlx_tandem.demo", "--concurrency", "2", "--max-tokens", "4"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_model_that_does_not_load_is_one_line_not_a_traceback(tmp_path):
    env = {**os.environ, "MLX_TANDEM_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlx_tandem.demo", "--model", str(tmp_path / "nowhere")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "error: " in proc.stderr and str(tmp_path / "nowhere") in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
