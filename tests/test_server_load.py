"""Bounded load test: 64 concurrent streaming clients (openai.AsyncOpenAI) on a real server
over a KV cache too small for all of them at once (preemption), a quarter leaving
mid-stream; afterwards no request runs or waits and every block is free or cached, by
/stats and by the engine's block manager. Every wait is bounded."""

import asyncio

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
from server_harness import Server  # noqa: E402

import jprefix  # noqa: E402
from jprefix import LLM  # noqa: E402

CLIENTS, MAX_TOKENS = 64, 24
SHARED = list(range(10, 26))  # two shared blocks of 8


@pytest.fixture(scope="module")
def server():
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    llm = LLM(tiny, block_size=8, num_kv_blocks=160)  # ~ half of what 64 full requests hold
    s = Server(llm)
    yield s
    s.stop()


async def _client(api: "openai.AsyncOpenAI", i: int) -> tuple[str, int]:
    """Streams one request; every fourth client leaves after its second chunk. Returns
    (finish reason or "left", tokens seen)."""
    stream = await api.completions.create(
        model="tiny-llama", prompt=SHARED + [30 + i, 31, 32 + i % 7], max_tokens=MAX_TOKENS,
        stream=True, temperature=1.0, seed=i, extra_body={"ignore_eos": True})
    chunks, reason = 0, None
    async for chunk in stream:
        chunks += 1
        if i % 4 == 3 and chunks == 2:
            reason = "left"
            break  # the stream is closed below, once its iterator is no longer running
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    if reason == "left":
        await stream.close()  # the client goes away mid-generation
    return reason, chunks


def test_64_streaming_clients_some_leaving_end_with_every_block_free_or_cached(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                                      max_retries=0, timeout=120) as api:
            return await asyncio.wait_for(
                asyncio.gather(*(_client(api, i) for i in range(CLIENTS))), timeout=300)

    results = asyncio.run(main())
    server.wait_idle(60)
    stayed = [r for i, r in enumerate(results) if i % 4 != 3]
    assert all(reason == "length" for reason, _ in stayed), stayed
    assert sum(r == "left" for r, _ in results) == CLIENTS // 4
    stats = httpx.get(f"{server.url}/stats", timeout=30).json()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_used_blocks"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 159
    assert stats["num_cached_blocks"] == stats["num_evictable_blocks"] > 0
    assert sum(stats["num_finished_requests"].values()) == CLIENTS
    assert stats["num_finished_requests"]["length"] >= CLIENTS - CLIENTS // 4
    assert stats["num_preemptions"] > 0  # the cache really ran out
    bm = server.llm.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert not server.llm.scheduler.running and not len(server.llm.scheduler.waiting)
