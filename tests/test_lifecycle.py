"""Engine lifecycle at its edges: close with work queued, hooks on the owner thread, engines
nobody holds, streams read from the wrong event loop. Nothing hangs, every request is
counted once, and the stats go back to zero."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import weakref

import mlx.core as mx
import pytest

from mlx_tandem import Engine, EngineClosedError, InvalidRequestError, SamplingParams
from mlx_tandem.default_model import is_packaged

from .reference import reference_greedy


def _prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


def _slow(seconds: float):
    """A processor that keeps the owner thread in its step (the logits pass through)."""
    def proc(tokens, logits):
        time.sleep(seconds)
        return logits
    return proc


def _counted(stats: dict) -> bool:
    return stats["requests"] == stats["finished"] + stats["failed"] + stats["aborted"]


def _collect(stream, timeout: float = 20.0):
    """The stream's output or the exception type's name, read on a thread with a timeout."""
    got = []

    def read():
        try:
            got.append(stream.collect().finish_reason)
        except BaseException as exc:  # noqa: BLE001
            got.append(type(exc).__name__)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return got[0] if got else "hung"


def test_close_with_requests_queued_for_memory_leaves_nothing_counted_as_waiting(llama_path):
    probe = Engine(str(llama_path), show_progress=False).start_sync()
    ledger = probe._core._memory
    budget = ledger.alone_bytes("text", ledger.row_tokens("text", 10, 200))
    probe.close_sync()
    engine = Engine(str(llama_path), show_progress=False, request_memory_bytes=budget).start_sync()
    streams = [engine.open_complete_stream_sync(_prompt(10, 100 + i),
                                                SamplingParams(max_tokens=200, logits_processors=[_slow(0.01)]))
               for i in range(4)]
    deadline = time.monotonic() + 10
    while engine.stats()["memory"]["waiting_for_memory"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["memory"]["waiting_for_memory"] == 3
    engine.close_sync()
    assert [_collect(s) for s in streams] == ["EngineClosedError"] * 4
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["memory"]["waiting_for_memory"]) == (0, 0, 0)
    assert stats["memory"]["reserved_bytes"] == 0 and _counted(stats), stats


def test_a_call_cancelled_before_it_ran_does_not_break_close(llama_path):
    """A hook's future cancelled by its caller while queued: close still ends every
    request with EngineClosedError and releases the lanes."""
    engine = Engine(str(llama_path), show_progress=False).start_sync()
    core = engine._core
    holding, release = threading.Event(), threading.Event()

    def hold(tokens, logits):  # keeps the owner thread in its step until released
        holding.set()
        release.wait(20)
        return logits

    busy = engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=100, logits_processors=[hold]))
    assert holding.wait(20)
    closer = threading.Thread(target=engine.close_sync, daemon=True)
    closer.start()
    deadline = time.monotonic() + 10
    while core._inbox.qsize() == 0 and time.monotonic() < deadline:  # the stop command is queued
        time.sleep(0.01)
    fut = core.call(lambda: None)
    assert fut.cancel()  # the owner thread is still held in its step
    release.set()
    closer.join(20)
    assert not closer.is_alive()
    assert _collect(busy) == "EngineClosedError"
    core._thread.join(20)
    assert not core._thread.is_alive() and not core._lanes  # shutdown ran to its end


def test_close_frees_the_lanes_before_it_empties_mlx_buffer_cache(qwen3_5_mtp_path, monkeypatch):
    """Weights, MTP head and prefix-cache entries must be garbage when close clears MLX's
    buffer cache; freed after it, their buffers stay cached until the thread ends."""
    engine = Engine(str(qwen3_5_mtp_path), show_progress=False, mtp="on",
                    prefix_cache_bytes=1 << 24, prefix_cache_min_tokens=4).start_sync()
    assert engine.complete_sync(_prompt(12), SamplingParams(max_tokens=4)).usage.completion_tokens == 4
    lane = engine._core._lanes["text"]
    assert lane.spec is not None and len(lane.prefix_cache) > 0
    alive = [weakref.ref(lane), weakref.ref(lane.spec.head), weakref.ref(lane.prefix_cache)]
    del lane
    seen = []
    clear_cache = mx.clear_cache

    def probe():
        gc.collect()
        seen.append([ref() is not None for ref in alive])
        clear_cache()

    monkeypatch.setattr(mx, "clear_cache", probe)
    engine.close_sync()
    assert seen == [[False, False, False]]


def test_a_load_that_fails_part_way_frees_what_it_loaded_on_its_thread(qwen3_5_mtp_path, tiny_models):
    """A SpecPrefill draft with another tokenizer fails the load after the target and its
    MTP head are loaded: they are freed on the owner thread (arrays freed at exit by another
    thread abort the process), not kept by the error's frames."""
    from mlx_tandem import ModelLoadError

    other_vocab = tiny_models.get("draft", vocab_size=1024)
    engine = Engine(str(qwen3_5_mtp_path), show_progress=False, specprefill_draft=str(other_vocab))
    with pytest.raises(ModelLoadError, match="tokenizer") as err:
        engine.start_sync()
    core = engine._core
    core._thread.join(20)
    assert not core._thread.is_alive()
    assert core.loaded is not None and dict(core.loaded.model.parameters()) == {}  # released
    for error in (err.value, core.ready.exception()):  # the caller's copy, and the one the core keeps
        heads = [f.f_locals.get("mtp_head") for f in _frames(error.__traceback__)]
        assert not any(h is not None for h in heads)  # no frame of the error keeps the head
    engine.close_sync()


def test_an_engine_whose_load_failed_is_freed_once_dropped(tmp_path):
    """Each caller gets its own copy of the load's error. Raised as the one object the core
    keeps, it gathered the caller's frames (``start_sync``, holding the Engine), and the core,
    held by the Engine's finalizer, kept that Engine alive after ``del`` (a review)."""
    import gc
    import weakref

    from mlx_tandem import ModelLoadError

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    for wait in ("start_sync", "start", "loaded"):
        engine = Engine(str(broken), show_progress=False)
        with pytest.raises(ModelLoadError) as first:
            if wait == "start":
                asyncio.run(engine.start())
            else:
                getattr(engine, wait) if wait == "loaded" else engine.start_sync()
        with pytest.raises(ModelLoadError) as second:
            engine.start_sync()
        assert first.value is not second.value and type(first.value) is type(second.value)
        assert str(first.value) == str(second.value)
        engine._core._thread.join(20)
        gone = weakref.ref(engine)
        del engine, first, second
        gc.collect()
        assert gone() is None, wait


def test_a_failure_setting_up_after_the_load_reaches_start_not_a_hang(llama_path, monkeypatch):
    """The owner thread copies the tokenizer after the lanes are built; a failure there
    killed the thread with ``ready`` never set, and start() waited for ever."""
    import mlx_tandem.core as core_module

    class Boom(Exception):
        pass

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise Boom("no copy")

    build = core_module.EngineCore._build_lanes

    def build_then_break(self):
        build(self)
        self.loaded.tokenizer._tokenizer = Uncopyable()

    monkeypatch.setattr(core_module.EngineCore, "_build_lanes", build_then_break)
    engine = Engine(str(llama_path), show_progress=False)
    box = []
    starter = threading.Thread(target=lambda: box.append(_raised(engine.start_sync)), daemon=True)
    starter.start()
    starter.join(60)
    assert not starter.is_alive() and isinstance(box[0], Boom)
    engine.close_sync()


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_clearing_a_failed_load_reaches_the_errors_it_chains():
    """Loaders wrap failures (``raise ModelLoadError(...) from exc``): the cause's frames
    hold the half-loaded weights, so they are cleared too."""
    from mlx_tandem.teardown import clear_frames

    def inner():
        weights = [1, 2, 3]  # noqa: F841 - stands in for arrays
        raise ValueError("bad checkpoint")

    def outer():
        try:
            inner()
        except ValueError as exc:
            raise RuntimeError("load failed") from exc

    with pytest.raises(RuntimeError) as err:
        outer()
    cause_frames = list(_frames(err.value.__cause__.__traceback__))
    assert any("weights" in f.f_locals for f in cause_frames)
    clear_frames(err.value)
    assert not any("weights" in f.f_locals for f in cause_frames)


def _frames(tb):
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def test_run_on_owner_thread_from_the_owner_thread_runs_at_once(llama_engine, llama_path):
    """From a processor, or from inside another call, it runs inline: queued, it would
    wait for the very loop that is waiting for it."""
    engine = llama_engine
    seen = []

    def proc(tokens, logits):
        seen.append(engine.run_on_owner_thread(lambda: threading.current_thread().name))
        return logits

    out = engine.complete_sync(_prompt(10), SamplingParams(max_tokens=6, logits_processors=[proc]))
    assert out.token_ids == reference_greedy(llama_path, _prompt(10), 6)
    assert len(seen) >= 6 and set(seen) == {engine.owner_thread.name}  # mlx-lm runs one step ahead
    nested = engine.run_on_owner_thread(lambda: engine.run_on_owner_thread(lambda: mx.array([2]).item()))
    assert nested == 2


def test_an_engine_nobody_holds_is_closed_but_its_streams_keep_it(llama_path):
    def answer():
        engine = Engine(str(llama_path), show_progress=False)
        out = engine.complete_sync(_prompt(10), SamplingParams(max_tokens=4))
        return out, engine._core

    out, core = answer()
    gc.collect()
    core._thread.join(20)
    assert out.finish_reason in ("length", "stop") and not core._thread.is_alive()

    def open_stream():
        engine = Engine(str(llama_path), show_progress=False)
        return engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=12))

    stream = open_stream()  # the caller keeps the stream only
    gc.collect()
    assert stream.collect().token_ids == reference_greedy(llama_path, _prompt(10), 12)
    core = stream.engine._core
    del stream
    gc.collect()
    core._thread.join(20)
    assert not core._thread.is_alive()


def test_an_async_stream_read_on_another_event_loop_fails_typed(llama_engine):
    engine = llama_engine

    async def open_():
        return await engine.open_complete_stream(_prompt(10), SamplingParams(max_tokens=50))

    stream = asyncio.run(open_())

    async def read():
        return await asyncio.wait_for(stream.collect(), 20)

    with pytest.raises(InvalidRequestError, match="event loop that opened it"):
        asyncio.run(read())
    deadline = time.monotonic() + 10
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["running"] == 0


def test_a_request_ended_by_close_before_the_engine_took_it_is_counted(llama_path):
    engine = Engine(str(llama_path), show_progress=False).start_sync()
    busy = engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=50, logits_processors=[_slow(0.5)]))
    next(iter(busy))
    make = engine._make_request

    def slow_make(*a, **k):  # widen the gap between the closed check and the submit
        req = make(*a, **k)
        time.sleep(0.3)
        return req

    engine._make_request = slow_make
    late = []
    t = threading.Thread(target=lambda: late.append(_collect(engine.open_complete_stream_sync(
        _prompt(8, 400), SamplingParams(max_tokens=4)))))
    t.start()
    time.sleep(0.1)
    engine.close_sync()
    t.join(30)
    assert late == ["EngineClosedError"] and _collect(busy) == "EngineClosedError"
    stats = engine.stats()
    assert stats["requests"] == 2 and _counted(stats), stats


def test_a_caller_giving_up_during_the_load_leaves_it_to_the_others(llama_path):
    """A caller that stops waiting for the load (``wait_for(engine.start(), ...)`` timing
    out, a cancelled task) only stops waiting: the load goes on and the other callers, async
    and sync, get their answers. Its cancel reached the load's shared future, which every
    caller then read as cancelled, and the owner thread died setting its result."""
    ref = reference_greedy(llama_path, [5, 6, 7], 3)

    async def run():
        engine = Engine(str(llama_path), show_progress=False)
        other = asyncio.create_task(engine.complete([5, 6, 7], SamplingParams(max_tokens=3)))
        sync_box = []
        caller = threading.Thread(target=lambda: sync_box.append(
            engine.complete_sync([5, 6, 7], SamplingParams(max_tokens=3)).token_ids))
        caller.start()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.start(), 0.001)
        try:
            outs = [(await asyncio.wait_for(other, 60)).token_ids,
                    (await engine.complete([5, 6, 7], SamplingParams(max_tokens=3))).token_ids]
            await asyncio.to_thread(caller.join, 60)
            assert engine.stats()["failed"] == 0 and engine.owner_thread.is_alive()
        finally:
            await engine.close()
        return outs + sync_box

    assert asyncio.run(run()) == [ref] * 3


def test_requests_failed_together_each_get_their_own_error(llama_path):
    """Close (like a failed step, or a failed load) fails several requests with one error.
    Each caller gets its own copy: one object raised by several callers gathered all their
    frames in its traceback, each caller's locals reachable from every other's error."""
    from mlx_tandem.errors import ContextLengthError, own_copy

    engine = Engine(str(llama_path), show_progress=False)
    streams = [engine.open_complete_stream_sync([5, 6, 7], SamplingParams(max_tokens=4000)) for _ in range(2)]
    for s in streams:
        next(iter(s))
    engine.close_sync()

    def reader_a():
        secret_of_a = object()  # noqa: F841 - what must not be reachable from b's error
        for _ in streams[0]:
            pass

    def reader_b():
        for _ in streams[1]:
            pass

    errors = []
    for read in (reader_a, reader_b):
        with pytest.raises(EngineClosedError) as err:
            read()
        errors.append(err.value)
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])
    frames = []
    tb = errors[1].__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "reader_b" in frames and "reader_a" not in frames
    # Errors whose __init__ takes keywords only are copied too.
    original = ContextLengthError("too long", prompt_tokens=9, max_context=8)
    original.__cause__ = ValueError("why")
    copied = own_copy(original)
    assert type(copied) is ContextLengthError and copied is not original
    assert (str(copied), copied.prompt_tokens, copied.max_context, copied.__cause__) == (
        "too long", 9, 8, original.__cause__)


def test_ctrl_c_right_after_a_sync_submit_aborts_the_request(llama_path, monkeypatch):
    """A KeyboardInterrupt that lands right after the request went in (Ctrl-C in a sync
    call) unwound the call before the stream that would cancel it existed: the request went
    on generating with no reader, holding its slot."""
    engine = Engine(llama_path, show_progress=False).start_sync()
    try:
        submit = engine._core.submit

        def submit_then_interrupt(req):
            submit(req)
            raise KeyboardInterrupt

        monkeypatch.setattr(engine._core, "submit", submit_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            engine.complete_sync("go on", {"max_tokens": 100_000})
        monkeypatch.undo()
        gc.collect()
        deadline = time.monotonic() + 20
        while engine.stats()["running"] + engine.stats()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = engine.stats()
        assert (stats["running"], stats["aborted"]) == (0, 1) and _counted(stats)
    finally:
        engine.close_sync()


def _child_report(pid: int, read: int, *, timeout: float) -> str:
    """What a forked child wrote to its pipe, once it exited; the test fails if it hangs."""
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                pytest.fail("the forked child hung")
            time.sleep(0.05)
        return os.read(read, 1000).decode()
    finally:
        os.close(read)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_child_forked_after_the_engine_started_gets_typed_errors_not_a_hang(llama_path):
    """MLX does not survive a fork, and the engine's thread is not in the child: a request
    on the inherited engine waited for good on an inbox nobody reads, and a new engine hung
    loading its weights. Both are typed errors now; the parent goes on."""
    from mlx_tandem import ModelLoadError

    engine = Engine(llama_path, show_progress=False).start_sync()
    try:
        ref = engine.complete_sync("go on", {"max_tokens": 4})
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report both outcomes through the pipe, then leave at once
            outcomes = []
            for attempt in (lambda: engine.complete_sync("go on", {"max_tokens": 4}),
                            lambda: Engine(llama_path, show_progress=False).start_sync()):
                try:
                    attempt()
                    outcomes.append("ran")
                except BaseException as exc:  # noqa: BLE001
                    outcomes.append(type(exc).__name__)
            os.write(write, ",".join(outcomes + [str(engine.closed)]).encode())
            os._exit(0)
        os.close(write)
        got = _child_report(pid, read, timeout=60)
        assert got == f"{EngineClosedError.__name__},{ModelLoadError.__name__},True"
        assert engine.complete_sync("go on", {"max_tokens": 4}).token_ids == ref.token_ids
    finally:
        engine.close_sync()


def test_exit_waits_for_a_long_step_instead_of_aborting(tmp_path, llama_path):
    """Exit gave the engine's thread 5 s; a step still running MLX then met the
    interpreter's finalization and the process aborted ("terminate called without an
    active exception", status 134)."""
    import subprocess
    import sys

    script = tmp_path / "exit_mid_step.py"
    script.write_text(f'''
import threading, time
from mlx_tandem import Engine  # before mlx: it loads OpenBLAS under it
import mlx.core as mx

started = threading.Event()

def heavy(tokens, logits):  # one step of about 7 s of MLX work
    started.set()
    a, t = mx.random.normal((256, 256)), time.time()
    while time.time() - t < 7:
        a = (a @ a) / 256.0
        mx.eval(a)
    return logits

engine = Engine({str(llama_path)!r}, show_progress=False).start_sync()
threading.Thread(target=lambda: engine.complete_sync("go on", {{"max_tokens": 4, "logits_processors": [heavy]}}),
                 daemon=True).start()
assert started.wait(120)  # exit while the step runs (a fixed sleep could end before it began, on a busy machine)
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exit waits for the engine's step in progress" in proc.stderr


def test_async_calls_work_in_a_thread_still_running_after_the_main_thread_ended(tmp_path, llama_path):
    """Once the main thread has finished, the loop's default executor refuses new work
    (CPython sets concurrent.futures' shutdown flag before joining the non-daemon threads),
    so every async request from a worker thread still running failed with an untyped
    RuntimeError, and ``await engine.close()`` left the engine open (an audit)."""
    import subprocess
    import sys

    script = tmp_path / "async_after_main.py"
    script.write_text(f'''
import asyncio, concurrent.futures.thread as cft, threading, time
from mlx_tandem import Engine

engine = Engine({str(llama_path)!r}, show_progress=False).start_sync()
ref = engine.complete_sync("go on", {{"max_tokens": 6}}).token_ids

def worker():
    t = time.time()
    while not cft._shutdown:  # wait for the main thread's end (the flag exit sets)
        assert time.time() - t < 60
        time.sleep(0.01)
    out = asyncio.run(engine.complete("go on", {{"max_tokens": 6}}))
    print("equal:", out.token_ids == ref, flush=True)
    asyncio.run(engine.close())
    print("closed:", engine.closed, flush=True)

threading.Thread(target=worker).start()
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["equal:", "True", "closed:", "True"], proc.stderr[-2000:]


@pytest.mark.parametrize("threads_start", [True, False])
async def test_run_off_loop_when_the_executor_refuses_work(monkeypatch, threads_start):
    """At interpreter shutdown the executor refuses work; CPython 3.12.0-3.12.2 also start
    no thread then (the test above failed there): the call still runs, once, its result and
    its error reaching the caller."""
    from mlx_tandem import off_loop

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(asyncio.get_running_loop(), "run_in_executor", refuse)
    if not threads_start:
        monkeypatch.setattr(off_loop.threading.Thread, "start", refuse)
    calls = []

    def work(x):
        calls.append(threading.current_thread() is threading.main_thread())
        if x < 0:
            raise ValueError("negative")
        return x * 2

    assert await off_loop.run_off_loop(work, 21) == 42
    with pytest.raises(ValueError, match="negative"):
        await off_loop.run_off_loop(work, -1)
    assert calls == [not threads_start] * 2  # each ran once: on its own thread, else inline


@pytest.mark.parametrize("case", ["imported_by_the_load", "imported_by_the_user_later"])
def test_exit_stops_the_engine_before_library_exit_hooks_touch_mlx(tmp_path, case, request):
    """mlx-vlm 0.7.10, first imported while the MTP head loads (or by the user at any time),
    registers an exit hook that calls ``mx.clear_streams()`` on the main thread; exit ran it
    (newest first) while the owner thread was still alive, before the engine's own hook
    stopped it (an audit and its review)."""
    import subprocess
    import sys

    if case == "imported_by_the_load":
        path, options, late_import = request.getfixturevalue("qwen3_5_mtp_path"), 'mtp="on"', ""
    else:
        path, options, late_import = request.getfixturevalue("llama_path"), 'mtp="off"', "import mlx_vlm"
    script = tmp_path / "exit_with_engine_open.py"
    script.write_text(f'''
import sys, threading
from mlx_tandem import Engine  # before mlx: it loads OpenBLAS under it
from mlx_tandem.core import OWNER_THREAD_NAME
import mlx.core as mx

real = mx.clear_streams
def recording():
    alive = any(t.name == OWNER_THREAD_NAME and t.is_alive() for t in threading.enumerate())
    print(f"clear_streams on {{threading.current_thread().name}}, owner alive: {{alive}}", file=sys.stderr)
    return real()
mx.clear_streams = recording

engine = Engine({str(path)!r}, show_progress=False, {options}).start_sync()
engine.complete_sync("go on", {{"max_tokens": 2}})
{late_import}
assert "mlx_vlm" in sys.modules  # its exit hook is registered
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "clear_streams on MainThread, owner alive: False" in proc.stderr, proc.stderr[-2000:]
    assert "on MainThread, owner alive: True" not in proc.stderr  # the owner's own call is its own


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_child_forked_while_the_engine_loads_gets_a_typed_error(llama_path, monkeypatch):
    """Forked while the parent's engine was still loading, the child waited for good on the
    load that only the parent's thread can finish."""
    import mlx_tandem.core as core_module

    load = core_module.load_text_model

    def slow_load(*args, **kwargs):
        time.sleep(2.0)
        return load(*args, **kwargs)

    monkeypatch.setattr(core_module, "load_text_model", slow_load)
    engine = Engine(llama_path, show_progress=False)
    loader = threading.Thread(target=engine.start_sync, daemon=True)
    loader.start()
    time.sleep(0.3)  # the load is under way on the engine's thread
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            engine.complete_sync("go on", {"max_tokens": 4})
            outcome = "ran"
        except BaseException as exc:  # noqa: BLE001
            outcome = type(exc).__name__
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    try:
        assert _child_report(pid, read, timeout=30) == EngineClosedError.__name__
        loader.join(30)
        assert engine.complete_sync("go on", {"max_tokens": 4}).finish_reason in ("length", "stop")
    finally:
        engine.close_sync()


@pytest.mark.parametrize("env, show, drawn", [({}, True, True), ({"TQDM_DISABLE": "1"}, True, False),
                                              ({}, False, False)])
def test_the_load_bar_follows_show_progress_and_tqdms_own_switch(llama_path, env, show, drawn):
    """TQDM_DISABLE=1 (CI, notebooks) hid no bar: the loader passed disable=False, which
    overrides tqdm's environment defaults (an audit). Read once tqdm is imported: a fresh process."""
    import subprocess

    code = ("from mlx_tandem.model_loader import load_text_model; import pathlib; "
            f"load_text_model(pathlib.Path({str(llama_path)!r}), show_progress={show})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    assert proc.returncode == 0, proc.stderr
    assert ("Loading llama" in proc.stderr) == drawn, proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's per-thread malloc arenas")
@pytest.mark.skipif(not is_packaged(), reason="the demo model's weights are not in this tree")
def test_engines_made_and_closed_in_turn_give_their_memory_back(tmp_path):
    """Each engine runs on an owner thread of its own, and glibc gives each thread its own
    malloc arena, whose freed pages it kept: a process that made and closed engines grew by
    about the model's size each time (an audit: 436 to 795 MB over 8 demo-model engines),
    though MLX's counters were back at zero. Closing trims the heap (malloc_trim)."""
    import subprocess

    script = tmp_path / "cycles.py"
    script.write_text(
        "import os\n"
        "from mlx_tandem import Engine\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20\n"
        "sizes = []\n"
        "for _ in range(7):\n"
        "    e = Engine(show_progress=False).start_sync()\n"
        "    e.chat_sync([{'role': 'user', 'content': 'hi'}], {'max_tokens': 4})\n"
        "    e.close_sync()\n"
        "    sizes.append(rss())\n"
        "print(sizes[1], sizes[-1])\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, last = map(float, proc.stdout.split())
    # The model is about 50 MB in float32: five more engines grew the process by about 250 MB.
    assert last - first < 40, (first, last)
