"""Run a blocking call off the event loop, also while the interpreter is shutting down.

asyncio's default executor refuses new work once the main thread has finished: CPython's
threading exit hook sets concurrent.futures' shutdown flag (3.9+) before it joins the
non-daemon threads, and every ThreadPoolExecutor checks that flag. A worker thread still
serving requests then failed every async call with "cannot schedule new futures after
interpreter shutdown", where its sync calls worked (an audit). Such a call gets a thread of
its own instead, or runs inline where no thread can start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def run_off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on another thread, awaited on the running loop, in a copy of the
    caller's context (as ``asyncio.to_thread`` runs it)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    try:
        fut = loop.run_in_executor(None, call)
    except RuntimeError:  # raised by the submit, never by fn (which has not run)
        try:
            done = _on_own_thread(call)
        except RuntimeError:
            # CPython 3.12.0-3.12.2 start no thread at all once the main thread has ended
            # (cpython#113964, fixed in 3.12.3): the call blocks this loop, briefly, instead.
            return call()
        fut = asyncio.wrap_future(done, loop=loop)
    return await fut


def _on_own_thread(call: Callable[[], T]) -> "concurrent.futures.Future[T]":
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # the caller gave up before it ran
            return
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            done.set_exception(exc)
        else:
            done.set_result(result)

    # A daemon: the call is short (templating, a grammar, a close), and must not hold exit.
    threading.Thread(target=run, name="mlx-tandem-off-loop", daemon=True).start()
    return done
