"""MLX does not survive ``fork()``, and a forked child has none of the parent's threads.

A child forked after an engine started used to hang for good: a request on the inherited
engine waited on an inbox nobody reads, and a new engine hung loading its weights. The
engine core records the process it belongs to; this module records the process whose
engine threads started MLX, and refuses a new engine in a child forked after that.
"""

from __future__ import annotations

import os
from typing import Optional

from .errors import EngineClosedError, ModelLoadError

FORKED = ("this process was forked from one whose engine had started, and MLX does not survive a "
          "fork: use the 'spawn' or 'forkserver' start method, or fork before the first request")

_mlx_started_in_pid: Optional[int] = None


def claim_process() -> None:
    """An engine thread is about to start MLX here: ModelLoadError in a child forked from
    a process where one already did."""
    global _mlx_started_in_pid
    if _mlx_started_in_pid not in (None, os.getpid()):
        raise ModelLoadError(FORKED)
    _mlx_started_in_pid = os.getpid()


def inherited_engine_error() -> EngineClosedError:
    """The error for a request on an engine the parent process started."""
    return EngineClosedError(f"the engine belongs to the parent process: {FORKED}")
