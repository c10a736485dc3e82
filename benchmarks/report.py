"""What every benchmark writes: the machine it ran on, its JSON, and a PNG plot next to it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable


def arguments(doc: str, quick: str) -> argparse.ArgumentParser:
    """The options every model benchmark takes: the JSON path, ``--quick`` and ``--model-dir``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="path of the JSON file to write (a PNG plot is written next to it)")
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--model-dir", help="where to build/reuse the benchmark models")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``ap.parse_args(argv)``, with the output path checked before anything runs: a
    directory failed only after the whole benchmark, and ``X.png`` was overwritten by its
    own plot."""
    args = ap.parse_args(argv)
    out = Path(args.output)
    if out.suffix.lower() == ".png":
        ap.error(f"output {out} is the plot's name: give the JSON path (the PNG is written beside it)")
    if out.is_dir():
        ap.error(f"output {out} is a directory: give the JSON file's path")
    return args


def positive_int(text: str) -> int:
    """An argparse type for counts that must be at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def measure(doc: str, quick: str, bench: Callable, argv=None) -> tuple[argparse.Namespace, dict]:
    """Parse the common options, run ``bench(args)`` and add the machine to its results."""
    args = parse(arguments(doc, quick), argv)
    results = bench(args)
    results["machine"] = machine()
    return args, results


def machine() -> dict:
    import mlx.core as mx

    import mlx_tandem
    from mlx_tandem import _platform

    info = mx.device_info()
    return {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "device": f"{mx.default_device()} {info.get('device_name', '')}".strip(), "mlx": mx.__version__,
            "blas": _platform.active_blas(), "mlx_tandem": mlx_tandem.__version__}


def write(results: dict, output: str | Path, draw: Callable) -> None:
    """Write ``results`` as JSON at ``output`` and ``draw(results, plt)``'s figure as a PNG
    beside it (skipped, with a message, when matplotlib is not installed)."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nwrote {out} (matplotlib not installed: no plot)")
        return
    fig = draw(results, plt)
    png = out.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"\nwrote {out} and {png}")


def finish(results: dict, output: str | Path, draw: Callable, ok: bool, failure: str) -> int:
    """``write``, then the exit status: 1 with ``failure`` on stderr when the runs that must
    agree did not (``ok`` False)."""
    write(results, output, draw)
    if not ok:
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0
