"""The README's framework examples run as written, offline, and exit cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block(section: str) -> str:
    text = README.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


@pytest.mark.parametrize("section", ["LangChain", "LlamaIndex"])
def test_readme_example_runs(section, tmp_path):
    env = {**os.environ, "MLX_TANDEM_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _first_python_block(section)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if section == "LlamaIndex":
        assert "value=" in proc.stdout  # the structured answer printed
