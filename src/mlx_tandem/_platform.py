"""Platform set-up that must run before `mlx` is first imported.

Owns: loading a fast BLAS on Linux CPU, the compute dtype policy, and giving a closed
engine's heap back on glibc. Every other module of the package imports mlx only after this
one has run (``mlx_tandem/__init__`` imports it first).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# The mlx-cpu wheel ships a reference BLAS (measured ~4 GFLOP/s here); Debian's
# OpenBLAS gives 50-180 GFLOP/s when loaded with RTLD_GLOBAL before mlx, because the
# dynamic linker then resolves mlx's sgemm symbols to it.
DISABLE_ENV = "MLX_TANDEM_NO_OPENBLAS"
_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "libopenblas.so.0",
)

_blas: str | None = None
_done = False


def _load_openblas() -> str | None:
    for candidate in _OPENBLAS_CANDIDATES:
        if candidate.startswith("/") and not os.path.exists(candidate):
            continue
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            return candidate
        except OSError:
            continue
    found = ctypes.util.find_library("openblas")
    if found:
        try:
            ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
            return found
        except OSError:
            pass
    return None


def setup() -> None:
    """Idempotent. Loads OpenBLAS on Linux unless disabled or mlx is already imported."""
    global _blas, _done
    if _done:
        return
    _done = True
    if not sys.platform.startswith("linux"):
        logger.debug("BLAS: platform default (%s)", sys.platform)
        return
    if os.environ.get(DISABLE_ENV, "").lower() in ("1", "true", "yes"):
        logger.debug("BLAS: mlx's bundled BLAS (%s is set)", DISABLE_ENV)
        return
    if "mlx.core" in sys.modules:
        # Loud: matmuls then run on the wheel's reference BLAS, about 20x slower on CPU.
        logger.warning("BLAS: mlx was imported before mlx_tandem, so OpenBLAS could not be loaded "
                       "under it; import mlx_tandem first for fast CPU matmuls")
        return
    _blas = _load_openblas()
    if _blas:
        logger.debug("BLAS: OpenBLAS loaded from %s", _blas)
    else:
        logger.debug("BLAS: OpenBLAS not found; mlx's bundled BLAS is used "
                     "(apt-get install libopenblas0-pthread for ~20x faster matmuls)")


def active_blas() -> str:
    """A short description of the BLAS in use, for stats and logs."""
    return f"openblas ({_blas})" if _blas else "mlx default"


def trim_native_heap() -> None:
    """Give the C heap's free pages back to the system (glibc only; elsewhere a no-op).

    Each engine loads and runs on an owner thread of its own, and glibc gives each new
    thread its own malloc arena; the pages its weights and caches freed stay in that arena,
    so on Linux a process that made and closed engines grew by about a model's size per
    engine until it reached the arena limit (8 per core: measured 435 MB to 1.5 GB over 20
    demo-model engines, MLX's own counters back at zero), though MLX had freed everything.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return
    trim(0)


def compute_dtype():
    """The dtype models run in on this device: float32 on CPU, None (keep) elsewhere.

    On the CPU backend bf16/fp16 matmuls get no BLAS and run ~30x slower, so weights
    are upcast at load. On Metal the checkpoint's dtype is kept.
    """
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return None


setup()
