"""Ending the owner thread without leaving MLX state to other threads.

Arrays or streams this thread made and another thread frees (the interpreter's final
teardown, a caller holding an error) can abort the process at exit ("terminate called
without an active exception", mlx 0.32.4 on CPU). So the owner thread, before it ends,
waits for its work in flight, drops the weights and caches it made, and clears the frames
of a load error it hands to callers; and exit stops every owner thread still running
before any library's exit hook touches MLX.
"""

from __future__ import annotations

import atexit
import gc
import logging
import inspect
import threading
import weakref
from typing import Any

from . import _platform

logger = logging.getLogger(__name__)

# Cores outlive their Engine by a moment when it is dropped (its finalizer only asks the
# owner thread to stop); at exit every one still alive is stopped and joined.
_live_cores: "weakref.WeakSet" = weakref.WeakSet()
# How long exit waits for a step in progress. Past it the interpreter finalizes under a
# thread still running MLX, which aborts the process ("terminate called without an active
# exception"); 5 s did for a step that long (a big prefill chunk on a CPU).
_EXIT_WAIT_S = 120.0


def close_at_exit(core) -> None:
    """Stop and join ``core``'s owner thread at exit if it is still alive then."""
    _live_cores.add(core)


def _close_live_cores() -> None:
    for core in list(_live_cores):
        try:
            core.shutdown(timeout=2.0)
            if core.owner_thread.is_alive():
                logger.warning("exit waits for the engine's step in progress to end (up to %.0f s)", _EXIT_WAIT_S)
                core.shutdown(timeout=_EXIT_WAIT_S)
        except Exception:  # noqa: BLE001
            pass


def keep_exit_hook_first() -> None:
    """Register the exit hook again, so it runs before any a library registered since (exit
    runs them newest first). mlx-vlm 0.7.10 registers one when it is first imported (by a
    model load, or by the user at any time) that calls ``mx.clear_streams()`` on the main
    thread: it ran while the owner thread was still alive, before the hook that stops it
    (an audit). Pure Python: any thread may call it."""
    atexit.unregister(_close_live_cores)
    atexit.register(_close_live_cores)


atexit.register(_close_live_cores)
# Last chance to reorder: threading's own exit hooks run when the main thread ends, before
# any atexit hook, and before the non-daemon threads are joined (so they keep the engine).
# A private hook of CPython >= 3.9 (concurrent.futures uses it); without it, the reordering
# after each model load (core.py) still covers the libraries a load imports.
try:
    threading._register_atexit(keep_exit_hook_first)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python, or imported while shutting down
    pass


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of every frame in ``exc``'s traceback and in the errors it chains.

    A frame still running (the one handling the error, which cannot be cleared) is cut from
    the traceback instead: once it returns it would keep its locals (the engine core, a
    lane) for as long as the error lives."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None and _running(tb.tb_frame):
            tb = tb.tb_next
        if tb is not err.__traceback__:
            err.__traceback__ = tb
        while tb is not None:
            # A frame also keeps its callers (f_back), which returned since: mlx-lm's step
            # with its logits, the lane's step with the lane. Those still running are left.
            frame = tb.tb_frame
            while frame is not None:
                _running(frame)
                frame = frame.f_back
            tb = tb.tb_next
        _drop_arrays(err)
        stack += [err.__cause__, err.__context__, *_group_members(err)]


def _group_members(err: BaseException) -> tuple:
    """An ExceptionGroup's exceptions; none where reading them fails (a user's
    ``__getattr__`` may raise anything)."""
    try:
        return tuple(getattr(err, "exceptions", ()))
    except Exception:  # noqa: BLE001 - what cannot be read is not walked
        return ()


#: Built-in exception fields that are not in ``__dict__`` (``StopIteration(value)``, ...).
_BUILTIN_FIELDS = ("value", "filename", "filename2", "object", "obj")


def _drop_arrays(err: BaseException) -> None:
    """Replace the mx.arrays an error holds in its arguments or attributes (a user's
    processor may raise ``MyError("bad logits", logits)``) with NumPy copies: host memory
    that any thread may free, and the same values for the error's own ``__str__``."""
    import mlx.core as mx
    import numpy as np

    def strip(value, depth: int = 0):
        if isinstance(value, mx.array):
            try:
                return np.array(value if value.dtype != mx.bfloat16 else value.astype(mx.float32))
            except Exception:  # noqa: BLE001 - what NumPy cannot take is described instead
                return f"<mx.array shape={tuple(value.shape)} dtype={value.dtype}>"
        if depth < 4 and type(value) in (tuple, list):
            items = [strip(v, depth + 1) for v in value]
            return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
        if depth < 4 and type(value) is dict:
            items = {k: strip(v, depth + 1) for k, v in value.items()}
            return value if all(items[k] is v for k, v in value.items()) else items
        return value

    try:
        err.args = strip(err.args)
    except Exception:  # noqa: BLE001 - an exception type that refuses new arguments keeps them
        logger.debug("could not drop the arrays of %r", type(err).__name__, exc_info=True)
    try:
        fields = [*vars(err)]
    except TypeError:  # no __dict__
        fields = []
    for name in fields + list(_BUILTIN_FIELDS):
        try:
            value = getattr(err, name)
        except Exception:  # noqa: BLE001 - absent, or a property that raises: nothing held there
            continue
        try:
            stripped = strip(value)
            if stripped is not value:
                setattr(err, name, stripped)
        except Exception:  # noqa: BLE001 - a read-only field keeps its value
            logger.debug("could not drop the array in %r.%s", type(err).__name__, name, exc_info=True)


_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _running(frame) -> bool:
    """Clear ``frame``'s locals; True if it is running (it cannot be cleared).

    A generator's or coroutine's frame is left alone: clearing a suspended one closes it
    (Python 3.11), and the engine's generators must go on."""
    if frame.f_code.co_flags & _SUSPENDABLE:
        return False
    try:
        frame.clear()
    except RuntimeError:  # "cannot clear an executing frame"
        return True
    return False


def drain_device() -> None:
    """Wait for work still in flight on this thread's streams before the thread ends.

    mlx-lm's generator keeps the next step in flight (async_eval); a thread that exits
    with it pending can make MLX abort the process at exit.
    """
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    try:
        mx.synchronize(generation_stream)  # thread-local: this thread's stream
        mx.synchronize()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        logger.debug("synchronize at shutdown failed", exc_info=True)


def release_arrays(lanes: dict, loaded: Any) -> None:
    """Free every mx.array this thread made while the thread is still alive: the lanes
    (caches, MTP head, prefix-cache entries) and the model's parameters, e.g. for a script
    that keeps its engine in a global. Called with no lane held by the caller's frame, so
    they are garbage before MLX's buffer cache is emptied."""
    import mlx.core as mx

    lanes.clear()
    if loaded is not None:
        for module in (loaded.model, loaded.vlm):
            if hasattr(module, "clear"):
                module.clear()  # nn.Module is a dict of its children and parameters
    gc.collect()
    mx.clear_cache()
    _platform.trim_native_heap()  # the freed pages, back to the system (glibc keeps them per thread)
    # mlx >= 0.32 wants each thread that used MLX to destroy its streams before it ends
    # (ml-explore/mlx#3395, mlx-vlm#1945); otherwise exit may abort.
    if hasattr(mx, "clear_streams"):
        mx.clear_streams()
