"""One LLM used by several callers at once: a sync generate while asyncio requests run, async
requests that arrive while a sync generate steps (and outlive it), sync generates from
several threads, an interrupted generate. Every caller gets its own outputs, equal to dense
greedy generation, and the engine ends idle with no thread and every block free."""

import asyncio
import threading
import time

import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.entrypoints.driver import _Stream
from models.reference import dense_generate


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


@pytest.fixture
def llm(tiny):
    return LLM(tiny, block_size=8, num_kv_blocks=96)


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _prompt(seed, n=20):
    return np.random.default_rng(seed).integers(3, 256, n).tolist()


def _dense(tiny, prompt, n):
    return dense_generate(tiny.params, tiny.config, prompt, n, eos_token_ids=())


def _in_thread(fn):
    """Starts fn on a thread; the returned callable joins it and gives its result."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: B036 (handed to the joining test)
            box["err"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join(timeout=120):
        thread.join(timeout)
        assert not thread.is_alive(), "the call never returned (its outputs went elsewhere?)"
        if "err" in box:
            raise box["err"]
        return box["out"]

    join.thread = thread
    return join


def _wait_until(cond, what, seconds=60):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _assert_idle(llm):
    _wait_until(lambda: not llm.engine.has_unfinished_requests() and llm._driver.thread is None,
                "the engine kept running")
    assert not any(t.name == "jprefix-engine" for t in threading.enumerate())
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1


@pytest.fixture
def loop():
    """An event loop on its own thread (the server's situation)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_sync_generate_while_async_requests_run(tiny, llm, loop):
    background = [_prompt(i) for i in range(3)]
    futures = [asyncio.run_coroutine_threadsafe(llm.generate_async(p, _greedy(40)), loop)
               for p in background]
    _wait_until(lambda: llm._driver.thread is not None, "the driver thread never started")
    # different lengths finish in different steps, each of which either thread could run
    prompts, lengths = [_prompt(10 + i) for i in range(4)], [3, 5, 7, 9]
    outs = _in_thread(lambda: llm.generate(prompts, [_greedy(n) for n in lengths],
                                           use_tqdm=False))()
    expected = [_dense(tiny, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert [o.token_ids for o in outs] == expected
    assert [f.result(120).token_ids for f in futures] == [_dense(tiny, p, 40) for p in background]
    _assert_idle(llm)


def test_async_requests_during_a_sync_generate_are_served_and_may_outlive_it(tiny, llm, loop):
    prompts = [_prompt(20 + i) for i in range(3)]
    stepped = threading.Event()
    step = llm.engine.step
    llm.engine.step = lambda: (stepped.set(), step())[1]
    join = _in_thread(lambda: llm.generate(prompts, _greedy(12), use_tqdm=False))
    assert stepped.wait(60)
    assert llm._driver.thread is None  # the sync caller steps in its own thread
    short, long = _prompt(30), _prompt(31)
    fs = asyncio.run_coroutine_threadsafe(llm.generate_async(short, _greedy(2)), loop)
    fl = asyncio.run_coroutine_threadsafe(llm.generate_async(long, _greedy(60)), loop)
    assert [o.token_ids for o in join()] == [_dense(tiny, p, 12) for p in prompts]
    assert fs.result(120).token_ids == _dense(tiny, short, 2)
    assert fl.result(120).token_ids == _dense(tiny, long, 60)  # stepped by a handed-on thread
    _assert_idle(llm)


def test_sync_generates_from_several_threads(tiny, llm):
    prompts = {k: [_prompt(40 + 3 * k + i) for i in range(3)] for k in range(3)}
    joins = {k: _in_thread(lambda k=k: llm.generate(prompts[k], _greedy(4 + 3 * k),
                                                    use_tqdm=False)) for k in range(3)}
    for k, join in joins.items():
        assert [o.token_ids for o in join()] == [_dense(tiny, p, 4 + 3 * k) for p in prompts[k]]
    _assert_idle(llm)


def test_an_interrupted_generate_aborts_its_requests_and_hands_on_the_rest(tiny, llm, loop):
    calls, step, other = [], llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:  # an async request arrives while the sync caller steps
            other.append(asyncio.run_coroutine_threadsafe(
                llm.generate_async(_prompt(50), _greedy(8)), loop))
            _wait_until(lambda: len(llm._driver._sinks) == 3, "the async request never came")
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([_prompt(51), _prompt(52)], _greedy(50), use_tqdm=False)
    # the interrupted caller's requests are aborted; the async one finishes on a thread
    assert other[0].result(120).token_ids == _dense(tiny, _prompt(50), 8)
    _assert_idle(llm)
    out = llm.generate([_prompt(53)], _greedy(3), use_tqdm=False)[0]
    assert out.token_ids == _dense(tiny, _prompt(53), 3)


def test_shutdown_aborts_in_flight_requests_and_waits_out_the_step(tiny, llm, loop):
    """The server's exit: its event loop has closed while a stream's step runs; shutdown
    aborts every request and returns only once the stepping thread has left its step."""
    step, in_step, release = llm.engine.step, threading.Event(), threading.Event()

    def held():
        in_step.set()
        release.wait(60)
        return step()

    llm.engine.step = held
    futures = [asyncio.run_coroutine_threadsafe(llm.generate_async(_prompt(60 + i), _greedy(50)),
                                                loop) for i in range(2)]
    assert in_step.wait(60)
    thread = llm._driver.thread
    held_loop = asyncio.new_event_loop()  # a closed loop's stream: put must not raise
    llm._driver._sinks["gone"] = _Stream(held_loop, asyncio.Queue())
    held_loop.close()
    assert not llm.shutdown(0.2)  # the step is still running
    assert thread.is_alive()
    release.set()
    assert llm.shutdown(60)
    assert not thread.is_alive()
    for f in futures:
        with pytest.raises(RuntimeError, match="shut down"):
            f.result(60)
    llm.engine.step = step
    _assert_idle(llm)
    out = llm.generate([_prompt(62)], _greedy(3), use_tqdm=False)[0]  # still usable
    assert out.token_ids == _dense(tiny, _prompt(62), 3)


_EXIT_SCRIPT = """
import asyncio, sys, time
import jprefix
from jprefix import LLM, SamplingParams

llm = LLM(jprefix.load("tiny-llama", dtype="float32", load_format="dummy"), block_size=8,
          num_kv_blocks=96)
step = llm.engine.step

def slow():
    time.sleep(0.3)
    out = step()
    print("step-ended", flush=True)
    return out

async def first():
    sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    async for _ in llm.stream_async([5, 6, 7], sp):
        return

asyncio.run(first())
llm.engine.step = slow
print("main-done", flush=True)
"""


def test_interpreter_exit_waits_out_the_step_in_flight_and_aborts_the_rest():
    """A script that leaves with a request running: the exit hook aborts it and waits for
    the stepping thread's step (a daemon thread torn down inside XLA aborts the process),
    so a step ends after the main thread's last line and the process exits 0."""
    import subprocess
    import sys

    from subprocess_checks import device_env

    run = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True,
                         env=device_env(1), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    assert "main-done" in lines and "step-ended" in lines[lines.index("main-done"):]
