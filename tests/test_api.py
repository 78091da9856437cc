"""The public surface: bad input raises ValueError naming it and the engine carries on;
generate_async, warm-up, delete_prefix, reset, the functional form and the CLI."""

import asyncio
import threading

import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from models.reference import dense_generate

BS = 8


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


@pytest.fixture
def llm(tiny):
    return LLM(tiny, block_size=BS, num_kv_blocks=64)


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _prompt(seed, n=20, vocab=256):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="0.7"), "temperature"),
        (dict(top_p=float("inf")), "top_p"),
        (dict(top_k=2**31), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_invalid_sampling_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_request_keeps_its_own_sampling_params(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=["x"])
    group = llm.engine.make_request(GOOD, sp)
    sp.max_tokens, sp.temperature = 1, 5.0  # the caller's object changes afterwards
    sp.stop.append("y")
    assert (group.sampling_params.max_tokens, group.sampling_params.temperature) == (4, 0)
    assert group.sampling_params.stop == ["x"]
    sp.temperature = -1.0  # invalid by now: the next request made from it is refused
    with pytest.raises(ValueError, match="temperature"):
        llm.engine.make_request(GOOD, sp)


def test_a_seed_beyond_32_bits_is_folded_not_rejected(llm):
    sp = lambda seed: SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed)  # noqa: E731
    big, small = (llm.generate([GOOD], sp(s), use_tqdm=False)[0].token_ids
                  for s in (2**40 + 12345, 12345))
    assert big == small


GOOD = [7, 8, 9, 10, 11]


@pytest.mark.parametrize(
    "prompts, prefix_pos, sp, match",
    [
        ([GOOD, []], None, None, "empty"),
        ([GOOD, [1, 2, 3.5]], None, None, "integers"),
        ([GOOD, [1, True, 3]], None, None, "token 1 is True"),
        ([GOOD, [1, 2, 999999]], None, None, "999999"),
        ([GOOD, [1, 2, -1]], None, None, "-1"),
        ([GOOD, [1, 2, 3]], [None, -1], None, "prefix_len -1"),
        ([GOOD, [1, 2, 3]], 4, None, "prefix_len 4"),
        ([GOOD, [1, 2, 3]], [1, 2, 3], None, "prefix_pos has 3 entries"),
        ([GOOD, [1, 2, 3]], None, SamplingParams(max_tokens=10**6), "exceeds the model context"),
        ([GOOD, [1, 2], [3, 4]], None, [SamplingParams()], "sampling_params has 1"),
    ],
)
def test_bad_input_raises_before_scheduling_and_engine_carries_on(llm, prompts, prefix_pos,
                                                                   sp, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, sp, prefix_pos=prefix_pos, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # not even the good prompt was queued
    out = llm.generate([GOOD], _greedy(3), use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_string_prompt_without_tokenizer_is_rejected(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], use_tqdm=False)


def test_generate_async_concurrent_requests_match_sync(tiny, llm):
    prompts = [_prompt(i, 12 + i) for i in range(5)]
    expected = [dense_generate(tiny.params, tiny.config, p, 6, eos_token_ids=()) for p in prompts]

    async def main():
        return await asyncio.gather(
            *(llm.generate_async(p, _greedy(6), prefix_pos=8) for p in prompts)
        )

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected
    _wait_for_driver(llm)
    assert llm._driver.thread is None  # no thread left behind when idle
    assert not any(t.name == "jprefix-engine" for t in threading.enumerate())


def test_cancelled_async_request_is_aborted_and_frees_blocks(llm):
    async def main():
        task = asyncio.ensure_future(llm.generate_async(_prompt(1), _greedy(200)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        other = await llm.generate_async(_prompt(2), _greedy(2))
        return other

    assert len(asyncio.run(main()).token_ids) == 2
    _wait_for_driver(llm)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_async_bad_input_raises_value_error(llm):
    async def main():
        await llm.generate_async([], _greedy(2))

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())


def test_warmup_then_delete_prefix_frees_its_blocks(llm):
    system = _prompt(3, 33)
    prefix = llm.warmup([system])[0]
    assert prefix.length == 32
    out = llm.generate([system + [5, 6, 7]], _greedy(2), prefix_pos=32, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    llm.prefix_pool.delete_prefix(prefix.hash)
    out = llm.generate([system + [5, 6, 8]], _greedy(2), prefix_pos=32, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_reset_prefix_cache_drops_cached_blocks(llm):
    system = _prompt(4, 40)
    llm.generate([system + [1]], _greedy(1), prefix_pos=40, use_tqdm=False)
    assert llm.reset_prefix_cache()
    out = llm.generate([system + [2]], _greedy(1), prefix_pos=40, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_functional_generate_matches_dense(tiny):
    prompts = [_prompt(10, 18), _prompt(11, 9)]
    outs = jprefix.generate(tiny, prompts, 8, sampling_params=_greedy(4), block_size=BS,
                            num_kv_blocks=32)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == dense_generate(tiny.params, tiny.config, p, 4, eos_token_ids=())


def _wait_for_driver(llm, timeout=10.0):
    thread = llm._driver.thread
    if thread is not None:
        thread.join(timeout)


def test_engines_leave_no_threads_behind(tiny):
    """The launch worker and the async driver end with their LLM."""
    import gc
    import time

    def ours():
        return [t for t in threading.enumerate() if t.name.startswith("jprefix")]

    before = len(ours())
    for _ in range(3):
        llm = LLM(tiny, block_size=8, num_kv_blocks=32)
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while len(ours()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ours()) == before, ours()


def test_token_ids_come_back_as_plain_ints_whatever_their_integer_type():
    from jprefix.engine.input_processor import check_token_ids

    ids = check_token_ids(np.arange(5, 12, dtype=np.int64), 100)
    assert ids == list(range(5, 12)) and {type(t) for t in ids} == {int}
    assert check_token_ids((9, np.int32(3)), 10) == [9, 3]
    with pytest.raises(ValueError, match="token 2 is 10"):
        check_token_ids([0, 9, 10], 10)  # the vocabulary's first id past the end


def test_dtype_auto_is_float32_on_the_cpu_everywhere(tmp_path, monkeypatch):
    import ast
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    from jprefix.engine.args import EngineArgs, resolve_dtype
    from jprefix.entrypoints.cli import _build_parser

    assert EngineArgs().dtype == "auto" and resolve_dtype("auto") == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16"
    assert jprefix.load("tiny-llama", load_format="dummy").params.embed.dtype == jnp.float32
    for command in ("generate", "serve"):
        assert _build_parser().parse_args([command]).dtype == "auto"
    scripts = Path(__file__).parent.parent / "scripts"
    import argparse

    from jprefix.benchmarks.throughput import add_cli_args
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args([]).dtype == "auto"  # (`jprefix bench throughput`)
    for name in ("bench_engine.py", "profile_engine.py"):
        calls = [n for n in ast.walk(ast.parse((scripts / name).read_text()))
                 if isinstance(n, ast.Call) and n.args and getattr(n.args[0], "value", None)
                 == "--dtype"]
        assert [k.value.value for c in calls for k in c.keywords if k.arg == "default"] \
            == ["auto"], name
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # on an accelerator:
    assert resolve_dtype("auto", tmp_path) == "float16"  # the checkpoint's dtype
    assert resolve_dtype("auto", "tiny-llama") == "bfloat16"
