"""The prefix cache's host tier in the engine (`kv_offloading_size`): greedy tokens equal
with the tier on, off and with an unbounded HBM pool, in both prefix modes, with fp8 KV,
under heavy eviction and preemption; blocks saved and brought back bitwise equal; the
host pool within its bound; the saved cache's round trip and its refusals."""

import json
import threading

import numpy as np
import pytest

from jprefix import LLM, SamplingParams
from jprefix.core.host_pool import HostPool
from jprefix.core.prefix_trie import PrefixTrie, prefix_hash_of
from jprefix.core.routing import TrieView
from jprefix.engine import prefix_cache_file
from jprefix.engine.kv_tier import KVTier
from jprefix.worker.offload import KVOffloader, read_blocks
from pallas_kernels.fp8 import quantize_rows

BS = 8
SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def sharp(sharp_tiny):
    return sharp_tiny


def _histories(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, 4 * BS + 3).tolist() for _ in range(5)]


def _replay(llm: LLM, histories: list[list[int]]) -> list[list[int]]:
    """Three rounds over the histories (each 5 blocks; the pool holds ~3 of them), one at a
    time in automatic mode, then all at once with prefix_pos (preempting)."""
    out = []
    for _ in range(2):
        for h in histories:
            out.append(llm.generate([h], SP, use_tqdm=False)[0].token_ids)
    outs = llm.generate(histories, SP, prefix_pos=[4 * BS] * len(histories), use_tqdm=False)
    return out + [o.token_ids for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_equal_with_the_host_tier_on_off_and_unbounded(sharp, kv_cache_dtype):
    histories = _histories(sharp.config.vocab_size)
    runs, engines = {}, {}
    for name, kw in [("off", {}), ("on", {"kv_offloading_size": 0.01}),
                     ("unbounded", {"num_kv_blocks": 256})]:
        args = dict(block_size=BS, num_kv_blocks=17, max_num_seqs=4, attention_backend="xla",
                    kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64) | kw
        llm = LLM(sharp, **args)
        runs[name] = _replay(llm, histories)
        engines[name] = llm.engine
    assert runs["on"] == runs["off"] == runs["unbounded"]
    on, off = engines["on"], engines["off"]
    assert on.counters()["num_host_hit_tokens"] > 0
    assert on.counters()["num_hit_tokens"] > off.counters()["num_hit_tokens"]
    assert on.stats.num_preemptions > 0  # (the batch with prefix_pos preempts)
    on.prefix_pool.check_invariants()
    on.kv_tier.pool.check_invariants()


def _step_loads(llm: LLM) -> list[list[int]]:
    """Records, per step, the blocks each sequence starts loading from the host tier."""
    pool, record = llm.engine.prefix_pool, []
    take = pool.take_moves

    def take_moves():
        record.append([len(nodes) for _, nodes in pool.moves.loading])
        return take()

    pool.take_moves = take_moves
    return record


def test_a_step_brings_back_at_most_its_load_bound_and_tokens_stay_equal(sharp):
    histories, bound = _histories(sharp.config.vocab_size), 3 * BS
    args = dict(block_size=BS, num_kv_blocks=17, max_num_seqs=4, attention_backend="xla",
                max_num_batched_tokens=64, kv_offloading_size=0.01)
    runs, loads = {}, {}
    for step_tokens in (0, bound):
        llm = LLM(sharp, kv_offloading_step_tokens=step_tokens, **args)
        loads[step_tokens] = _step_loads(llm)
        runs[step_tokens] = _replay(llm, histories)
        llm.engine.prefix_pool.check_invariants()
        llm.engine.kv_tier.pool.check_invariants()
    assert runs[bound] == runs[0]
    over = [s for s in loads[0] if len(s) > 1 and sum(s) * BS > bound]
    assert over, "the unbounded run never loaded past the bound in one step"
    assert all(len(s) == 1 or sum(s) * BS <= bound for s in loads[bound])  # (a first load goes)
    steps_loading = {k: sum(1 for s in v if s) for k, v in loads.items()}
    assert steps_loading[bound] > steps_loading[0]  # the same loads, over more steps
    with pytest.raises(ValueError, match="kv_offloading_step_tokens must be >= 0, got -1"):
        LLM(sharp, kv_offloading_step_tokens=-1, **args)


class StubRunner:
    """The runner surface the offloader uses: a cache and ordered updates to it."""

    def __init__(self, cache):
        self.kv_cache = cache

    def update_kv_cache(self, fn):
        self.kv_cache = fn(self.kv_cache)


def _cache(fp8: bool):
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 2, 9, 4, 8)).astype(np.float32) for _ in range(2))
    if not fp8:
        return k, v
    (kq, ks), (vq, vs) = quantize_rows(k, np.dtype("float8_e4m3fn")), quantize_rows(
        v, np.dtype("float8_e4m3fn"))
    return kq, vq, ks, vs


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_blocks_saved_and_brought_back_are_bitwise_equal(fp8, pinned, monkeypatch):
    import jax.numpy as jnp

    from jprefix.worker import offload

    if not pinned:  # the pageable pool (no pinned memory kind, or tensor parallelism)
        monkeypatch.setattr(offload, "pinned_works", lambda *a: False)
    runner = StubRunner(tuple(jnp.asarray(c) for c in _cache(fp8)))
    before = [np.asarray(c).copy() for c in runner.kv_cache]
    off = KVOffloader(runner, 4)
    assert off.pinned == pinned  # (the CPU offers pinned_host memory too)
    off.after_step(off.move([(3, 0), (5, 2), (7, 1)], []))  # saves, then nothing to load
    off.flush()
    for h, c in zip(off.host, before, strict=True):
        for block, slot in [(3, 0), (5, 2), (7, 1)]:
            assert h.rows([slot])[0].tobytes() == c[:, :, block].tobytes()
    off.after_step(off.move([], [(0, 1), (2, 2), (1, 4)]))  # into other blocks
    for c, b in zip(runner.kv_cache, before, strict=True):
        c = np.asarray(c)
        for src, dst in [(3, 1), (5, 2), (7, 4)]:
            assert c[:, :, dst].tobytes() == b[:, :, src].tobytes()
        for block in (3, 5, 6, 7, 8):  # untouched
            assert c[:, :, block].tobytes() == b[:, :, block].tobytes()
    assert off.stats.bytes_to_host == off.stats.bytes_to_device == 3 * off.block_bytes


def _fp8_runner(seed: int):
    """A stub runner over a random fp8 cache of 40 blocks (K, V and their scales), and a
    copy of its arrays."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    fp8 = np.dtype("float8_e4m3fn")
    k, v = (quantize_rows(rng.standard_normal((2, 2, 40, 4, 8)).astype(np.float32), fp8)
            for _ in range(2))
    runner = StubRunner(tuple(jnp.asarray(c) for c in (k[0], v[0], k[1], v[1])))
    return runner, [np.asarray(c).copy() for c in runner.kv_cache]


@pytest.mark.parametrize("pinned", [True, False])
def test_a_load_in_pieces_brings_blocks_back_bitwise_equal(pinned, monkeypatch):
    """Loads of 16 blocks and of 11 (padded to 16) in LOAD_PIECES = 4 pieces of 4, the
    second reusing each piece's staging, into an fp8 cache (scales of another row shape):
    every loaded block equals its saved block bitwise, and no other block but the null
    block (the padding's target) changes; compile_moves' piece scatter moves nothing."""

    from jprefix.worker import host_loads, offload

    if not pinned:
        monkeypatch.setattr(offload, "pinned_works", lambda *a: False)
    monkeypatch.setattr(host_loads, "LOAD_PIECES", 4)
    monkeypatch.setattr(host_loads, "IN_STREAM_LOADS", False)
    runner, before = _fp8_runner(1)
    off = KVOffloader(runner, 16)
    assert off.pinned == pinned
    off.compile_moves(16)
    assert all(np.asarray(c).tobytes() == b.tobytes()
               for c, b in zip(runner.kv_cache, before, strict=True))
    off.after_step(off.move([(1 + i, i) for i in range(16)], []))  # block 1 + i -> slot i
    off.flush()
    expect = [b.copy() for b in before]
    for loads in ([(i, 20 + i) for i in range(16)], [(3 * i % 16, 21 + i) for i in range(11)]):
        staged = off.move([], loads)
        pieces = staged[1].result()
        assert len(pieces) == 4 and all(len(p) == 4 and p[0].shape[0] == 4 for p in pieces)
        off.after_step(staged)
        for c, e, b in zip(runner.kv_cache, expect, before, strict=True):
            for slot, block in loads:
                e[:, :, block] = b[:, :, 1 + slot]
            assert np.asarray(c)[:, :, 1:].tobytes() == e[:, :, 1:].tobytes()
    if pinned:
        assert set(off._staged._staging) == {(4, p) for p in range(4)}
    assert off.stats.bytes_to_device == 27 * off.block_bytes


@pytest.mark.parametrize("max_rows", [4, 256])
def test_in_stream_loads_copy_rows_from_the_pinned_chunks_bitwise(max_rows, monkeypatch):
    """In-stream loads over a pool of 3-row chunks (a load reads several chunks; with
    IN_STREAM_ROWS = 4 a chunk's rows split over programs too) into an fp8 cache: every
    loaded block equals its saved block bitwise and no other block changes, the null
    block included (padding writes past the cache's end); compile_moves moves nothing;
    a load of a slot whose save is still queued (no flush) reads the saved bytes."""

    from jprefix.worker import host_loads, offload

    monkeypatch.setattr(host_loads, "IN_STREAM_ROWS", max_rows)
    row_bytes = 2 * 2 * 4 * 8  # one fp8 K row; the scales' rows are smaller
    monkeypatch.setattr(offload, "CHUNK_BYTES", 3 * row_bytes)
    runner, before = _fp8_runner(3)
    off = KVOffloader(runner, 16)
    assert off.in_stream and off.host[0].per_chunk == 3
    off.compile_moves(16)
    copied, fn = [], off._in_stream._fn
    off._in_stream._fn = lambda cache, chunks, idx, blocks: (
        copied.append(len(idx)), fn(cache, chunks, idx, blocks))[1]
    assert all(np.asarray(c).tobytes() == b.tobytes()
               for c, b in zip(runner.kv_cache, before, strict=True))
    assert off.after_step(off.move([(1 + i, i) for i in range(12)], [])) is None
    expect = [b.copy() for b in before]
    for saves, loads in (([(13, 12), (14, 13)], [(12, 20), (13, 21)]),  # saved, not flushed
                         ([], [(i, 22 + i) for i in range(14)]),
                         ([], [(3 * i % 14, 5 + i) for i in range(11)])):
        assert off.move(saves, loads) is None  # (queued on the launch thread: no staging)
        for c, e, b in zip(runner.kv_cache, expect, before, strict=True):
            for slot, block in loads:
                e[:, :, block] = b[:, :, 1 + slot]
            assert np.asarray(c).tobytes() == e.tobytes()
    assert off.stats.bytes_to_device == 27 * off.block_bytes
    assert sum(copied) == 27  # (at most 3 rows a chunk: no padding row is copied)


def test_in_stream_programs_copy_at_most_an_eighth_more_rows_than_asked():
    from jprefix.worker.host_loads import program_sizes

    for max_rows in (4, 256):
        for n in range(1, 3 * max_rows + 2):
            sizes = program_sizes(n, max_rows)
            assert all(s & (s - 1) == 0 and s <= max_rows for s in sizes), (n, sizes)
            assert sizes == sorted(sizes, reverse=True)
            assert n <= sum(sizes) <= n + n // 8 and sum(sizes) - sizes[-1] < n, (n, sizes)
    assert program_sizes(37, 256) == [32, 4, 1] and program_sizes(255, 256) == [256]


def test_loads_are_staged_where_the_in_stream_check_fails(monkeypatch):
    """The construction check passes here (pinned host memory on the CPU); where it fails
    (a backend that cannot run the program) the offloader stages its loads instead, and
    a load still lands its block bitwise."""
    import jax.numpy as jnp

    from jprefix.worker import host_loads, offload

    cache = _cache(False)
    runner = StubRunner(tuple(jnp.asarray(c) for c in cache))
    assert KVOffloader(runner, 4).in_stream
    monkeypatch.setattr(host_loads, "_load_rows", lambda *a, **k: 1 / 0)
    off = offload.KVOffloader(runner, 4)
    assert off.pinned and not off.in_stream
    off.move([(3, 0)], [])
    off.flush()
    off.after_step(off.move([], [(0, 5)]))
    for c, b in zip(runner.kv_cache, cache, strict=True):
        assert np.asarray(c)[:, :, 5].tobytes() == b[:, :, 3].tobytes()


@pytest.mark.parametrize("threads", [1, 16])
def test_host_rows_copies_split_over_threads_are_exact(threads, monkeypatch):
    """HostRows' writes and reads of 1, 3 and 9 rows spread over `threads` (fewer rows
    than threads: each row split along its first axis) over chunks of 2 rows."""
    from jprefix.worker import host_rows

    monkeypatch.setattr(host_rows, "_COPY_THREADS", threads)
    rows = host_rows.HostRows(10, (5, 3, 4), np.float32, chunk_bytes=2 * 5 * 3 * 4 * 4)
    rng = np.random.default_rng(2)
    want = np.zeros((10, 5, 3, 4), np.float32)
    for slots in ([7], [0, 9, 4], [1, 2, 3, 5, 6, 8, 0, 9, 4]):
        data = rng.standard_normal((len(slots), 5, 3, 4)).astype(np.float32)
        rows.write_from(np.asarray(slots, np.int64), data)
        want[slots] = data
        assert rows.rows(slots).tobytes() == data.tobytes()
    out = np.empty_like(want)
    rows.read_into(np.arange(10), out)
    assert out.tobytes() == want.tobytes()


def test_host_pool_never_exceeds_the_configured_size(sharp):
    llm = LLM(sharp, block_size=BS, num_kv_blocks=17, attention_backend="xla",
              kv_offloading_size=0.001)
    tier = llm.engine.kv_tier
    assert sum(h.nbytes for h in tier.offloader.host) <= 0.001 * 2**30
    assert tier.pool.num_slots == len(tier.offloader.host[0])
    _replay(llm, _histories(sharp.config.vocab_size))
    assert tier.pool.num_used_slots <= tier.pool.num_slots
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(sharp, block_size=BS, num_kv_blocks=17, kv_offloading_size=-1)
    with pytest.raises(ValueError, match="holds no KV block"):
        KVTier.for_args(llm.engine.runner, 1e-9, BS)


def test_router_affinity_counts_host_resident_prefixes():
    host = HostPool(4, 2)
    view = TrieView(PrefixTrie(2), host)
    assert prefix_hash_of([1, 2, 3, 4], 2) not in view
    host.store(None, [(1, 2), (3, 4)])
    assert prefix_hash_of([1, 2, 3, 4], 2) in view
    assert prefix_hash_of([1, 2, 3, 4], 2, "salt") not in view


def test_saved_prefix_cache_round_trip_and_refusals(sharp, tmp_path):
    histories = _histories(sharp.config.vocab_size)
    args = dict(block_size=BS, num_kv_blocks=17, attention_backend="xla")
    first = LLM(sharp, kv_offloading_size=0.01, **args)
    want = [first.generate([h], SP, use_tqdm=False)[0].token_ids for h in histories]
    path = tmp_path / "cache.bin"
    assert first.save_prefix_cache(str(path)) >= 4 * len(histories)
    second = LLM(sharp, prefix_cache_path=str(path), **args)
    assert second.engine.kv_tier.pool.num_used_slots >= 4 * len(histories)
    got = [second.generate([h], SP, use_tqdm=False)[0] for h in histories]
    assert [o.token_ids for o in got] == want
    assert all(o.num_cached_tokens == 4 * BS for o in got)
    assert second.stats()["num_host_hit_tokens"] == 4 * BS * len(histories)

    raw = path.read_bytes()
    bad = tmp_path / "bad.bin"
    for data, match in [(raw[:-5], "truncated"), (raw[:-40] + bytes(40), "checksum"),
                        (b"nope", "not a jprefix")]:
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=match):
            LLM(sharp, prefix_cache_path=str(bad), **args)
    with pytest.raises(ValueError, match="block_size 8 does not match the engine's 16"):
        LLM(sharp, prefix_cache_path=str(path), **(args | {"block_size": 16}))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(sharp, prefix_cache_path=str(path), kv_cache_dtype="fp8", **args)
    tier = LLM(sharp, kv_offloading_size=0.01, **args).engine
    bad.write_bytes(raw[:-40] + bytes(40))
    with pytest.raises(ValueError, match="checksum"):
        tier.kv_tier.load_file(str(bad), prefix_cache_file.identity(tier))
    assert tier.kv_tier.pool.num_used_slots == 0  # a refused file loads nothing
    assert read_blocks(tier.runner, [])[0].shape[0] == 0


def test_benchmark_scripts_run_on_the_tiny_model(tmp_path):
    from scripts import bench_multiturn, bench_offload

    tiny = ["--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float32",
            "--block-size", "8"]
    bench_multiturn.main(tiny + ["--num-conversations", "8", "--turns", "2", "--user-len",
                                 "24", "--output-len", "2", "--concurrency", "2",
                                 "--max-num-seqs", "2", "--modes", "off,on,on:8",
                                 "--kv-offloading-size", "0.01", "--oversubscription", "4",
                                 "--json", str(tmp_path / "mt.json")])
    rows = json.loads((tmp_path / "mt.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["off", "on", "on:8"]
    assert all(r["compiles"] >= 0 and r["compile_s"] >= 0 for r in rows)
    # the histories outgrow the pool: only the tier brings them back, with a step-load
    # bound of one block (on:8) too, and what it brings back is not computed
    assert rows[0]["host_hit_tokens"] == 0 < rows[1]["host_hit_tokens"]
    assert rows[2]["host_hit_tokens"] == rows[1]["host_hit_tokens"]
    assert (rows[1]["prefill_tokens_computed"] == rows[2]["prefill_tokens_computed"]
            == rows[0]["prefill_tokens_computed"] - rows[1]["host_hit_tokens"])
    # the continuous schedule (each next turn sent once its reply is back, through the
    # async driver) replays the same turns: the same prompts, the tier bringing back
    # what the pool lost, and its stepping thread gone after each mode
    bench_multiturn.main(tiny + ["--num-conversations", "8", "--turns", "2", "--user-len",
                                 "24", "--output-len", "2", "--concurrency", "2",
                                 "--max-num-seqs", "2", "--modes", "off,on",
                                 "--kv-offloading-size", "0.01", "--oversubscription", "4",
                                 "--schedule", "continuous", "--trace", "on",
                                 "--json", str(tmp_path / "c.json")])
    cont = json.loads((tmp_path / "c.json").read_text())["rows"]
    # ... and replays "on" once more under the profiler: its steps and where they went
    trace = cont[1]["trace"]
    assert "trace" not in cont[0] and trace["steps"] > 0 and trace["per_step_ms"] > 0
    assert set(trace) >= {"copy_ms_per_step", "top_kernels", "engine_step_call_p50_max_ms"}
    with pytest.raises(ValueError, match="--trace 'unbounded' is not one of"):
        bench_multiturn.main(tiny + ["--modes", "off,on", "--trace", "unbounded"])
    assert [r["prompt_tokens"] for r in cont] == [rows[0]["prompt_tokens"]] * 2
    assert cont[0]["host_hit_tokens"] == 0 < cont[1]["host_hit_tokens"]
    assert cont[1]["prefill_tokens_computed"] < cont[0]["prefill_tokens_computed"]
    assert not [t for t in threading.enumerate() if t.name.startswith("jprefix-engine")]
    for bad in ("on:x", "off:8", "of"):
        with pytest.raises(ValueError, match=f"mode '{bad}'"):
            bench_multiturn.main(tiny + ["--modes", f"on,{bad}"])
    bench_offload.main(tiny + ["--prefix-len", "40", "--repeats", "1",
                               "--kv-offloading-size", "0.01", "--json",
                               str(tmp_path / "off.json")])
    row = json.loads((tmp_path / "off.json").read_text())["row"]
    assert row["restore_ttft_ms"] > 0 and row["restore_ms"] > 0 and row["blocks"] == 5
