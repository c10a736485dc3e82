"""The packages ship py.typed, so users' type checkers read our annotations: documented,
correct user code (tests/typecheck/) must type-check. An annotation narrower than what the
code accepts (a list where a tuple was declared, a TypedDict history, a Path model) fails
users' CI on code that runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

USER_CODE = Path(__file__).parent / "typecheck"


def test_documented_usage_type_checks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "--no-color-output",
         str(USER_CODE)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
