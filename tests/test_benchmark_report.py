"""benchmarks/report.py: what every benchmark checks before it runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_report", Path(__file__).parents[1] / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_the_output_path_is_checked_before_the_benchmark_runs(tmp_path, capsys):
    """``X.png`` was the JSON's path and then the plot's, overwriting it; a directory failed
    only after the whole benchmark had run."""
    ran = []

    def bench(args):
        ran.append(args)
        return {}

    for bad in (tmp_path / "result.png", tmp_path / "RESULT.PNG", tmp_path):
        with pytest.raises(SystemExit):
            report.measure("doc", "quick", bench, [str(bad)])
    assert ran == []
    assert "is the plot's name" in capsys.readouterr().err
    args, results = report.measure("doc", "quick", bench, [str(tmp_path / "result.json"), "--quick"])
    assert args.quick and ran and results["machine"]["mlx"]


def test_counts_must_be_positive():
    import argparse

    assert report.positive_int("3") == 3
    for bad in ("0", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            report.positive_int(bad)
