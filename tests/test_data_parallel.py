"""Data parallelism on 4 virtual CPU devices: DP 2 and DP 2 x TP 2 greedy tokens equal
DP 1's; prefix-affinity routing keeps each prefix group on one replica and computes as
many prefill tokens as one engine (round robin computes more); a hot prefix does not
starve the other replica; aborts and disconnects free blocks on the replica that held
them. Each case runs in a subprocess, since jax's CPU device count is fixed at start;
each of its assertions is a test of its own here, by name (tests/subprocess_checks.py).
"""

import functools
import textwrap

import pytest
from subprocess_checks import CheckRun, assert_check, check_names, device_env, run_checks

COMMON = textwrap.dedent("""
    import asyncio, dataclasses, json, time
    import jax, numpy as np
    import jprefix
    from jprefix import LLM, SamplingParams
    from jprefix.core.outputs import RequestOutputKind
    assert len(jax.devices()) == 4, jax.devices()
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    KW = dict(block_size=8, num_kv_blocks=128, attention_backend="xla")

    def prefill_tokens(llm, outs):
        # tokens computed by every step minus the decode tokens (each output token but
        # the first is computed by a decode row)
        computed = sum(s[1] for s in llm.engine.step_stats)
        return computed - sum(len(o.token_ids) - 1 for o in outs)

    def used_blocks(llm):
        return [r.scheduler.block_manager.num_used_blocks for r in llm.engine.replicas]
""")

EQUAL = COMMON + textwrap.dedent("""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 24).tolist()
    prompts = [shared + rng.integers(3, 200, n).tolist() for n in (3, 7, 12, 5, 9, 1)]
    prompts += [rng.integers(3, 200, 30).tolist()]  # one without the shared prefix
    pos = [24] * 6 + [None]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    for dp, tp, policy in ((1, 1, "prefix"), (2, 1, "prefix"), (2, 1, "round_robin"),
                           (2, 2, "round_robin")):
        llm = LLM(tiny, data_parallel_size=dp, tensor_parallel_size=tp,
                  routing_policy=policy, **KW)
        outs = llm.generate(prompts, sp, prefix_pos=pos, use_tqdm=False)
        out[(dp, tp, policy)] = [o.token_ids for o in outs]
        if dp == 2:
            groups = [sorted(d.id for d in r.runner.kv_cache[0].devices())
                      for r in llm.engine.replicas]
            assert groups == ([[0], [1]] if tp == 1 else [[0, 1], [2, 3]]), groups
            weights = [{d.id for x in jax.tree.leaves(r.runner.params) for d in x.devices()}
                       for r in llm.engine.replicas]
            assert weights == [set(g) for g in groups], weights
            stats = llm.stats()
            assert [r["requests"] for r in stats["replicas"]] == (
                [6, 1] if policy == "prefix" else [4, 3]), stats  # the shared six on one
            assert stats["data_parallel_size"] == 2 and stats["routing_policy"] == policy
        # the same engine again: the prefix is cached now
        again = llm.generate(prompts, sp, prefix_pos=pos, use_tqdm=False)
        assert [o.token_ids for o in again] == out[(dp, tp, policy)]
    first = out[(1, 1, "prefix")]
    # n samples with logprobs and penalties: the fanned-out samples are routed one by one
    # and give DP 1's samples (seeded) with the same logprobs
    nsp = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=5, ignore_eos=True,
                         logprobs=2, presence_penalty=0.5)
    samples = {}
    for dp in (1, 2):
        llm = LLM(tiny, data_parallel_size=dp, **KW)
        got = llm.generate(prompts[:2], nsp, prefix_pos=24, use_tqdm=False)
        samples[dp] = [[(s.token_ids, [round(d[t].logprob, 4) for d, t in
                                       zip(s.logprobs, s.token_ids)]) for s in o.samples]
                       for o in got]
    assert samples[1] == samples[2], samples
    views = [r.structured for r in llm.engine.replicas]  # one grammar view per replica
    assert views[0] is not views[1] and views[0]._matchers is views[1]._matchers
    assert len({tuple(t) for t, _ in samples[1][0]}) > 1  # distinct samples
    print(json.dumps({str(k): v == first for k, v in out.items()}))
    assert all(v == first for v in out.values())
    assert jprefix.generate(tiny, prompts[:2], 24, sp, data_parallel_size=2,
                            **KW)[1].token_ids == first[1]
    # by name: each replica loads the model onto its own device
    named = LLM("tiny-llama3", dtype="float32", load_format="dummy", data_parallel_size=2,
                routing_policy="round_robin", **KW)
    assert [{d.id for x in jax.tree.leaves(r.model.params) for d in x.devices()}
            for r in named.engine.replicas] == [{0}, {1}]
    got = named.generate(prompts, sp, prefix_pos=pos, use_tqdm=False)
    assert [o.token_ids for o in got] == first  # dummy weights from the same seed
    for bad, message in ((dict(data_parallel_size=3, tensor_parallel_size=2), "needs 6"),
                         (dict(data_parallel_size=0), "data_parallel_size 0"),
                         (dict(data_parallel_size=2, routing_policy="random"), "'random'")):
        try:
            LLM(tiny, **bad, **KW)
        except ValueError as e:
            assert message in str(e), (bad, e)
        else:
            raise AssertionError(f"{bad} accepted")

    # the benchmarks take --data-parallel-size (and --routing-policy)
    from scripts import bench_engine, bench_latency, bench_throughput
    tiny_args = ["--model", "tiny-llama3", "--load-format", "dummy", "--dtype", "float32",
                 "--block-size", "8", "--num-kv-blocks", "128"]
    wl = ["--num-prompts", "12", "--input-len", "40", "--prefix-len", "32", "--output-len",
          "2", "--num-prefixes", "4", "--data-parallel-size", "2"]
    runs = {p: bench_throughput.main([*tiny_args, *wl, "--routing-policy", p])["runs"][0]
            for p in ("prefix", "round_robin")}
    print(json.dumps({p: (r["prefill_tokens_computed"], r["replica_requests"])
                      for p, r in runs.items()}))
    computed = {p: r["prefill_tokens_computed"] for p, r in runs.items()}
    assert computed["prefix"] < computed["round_robin"], computed
    assert runs["round_robin"]["replica_requests"] == [6, 6]
    assert sum(runs["prefix"]["replica_requests"]) == 12 and runs["prefix"]["errors"] == 0
    lat = bench_latency.main([*tiny_args, *wl, "--request-rate", "200"])
    assert lat["data_parallel_size"] == 2 and lat["trials"][0]["requests"] == 12
    r = bench_engine.main(["--model", "tiny-llama3", "--dtype", "float32", "--num-prompts", "6",
                           "--prefix-len", "32", "--unique-len", "8", "--output-len", "3",
                           "--ttft-reps", "1", "--num-kv-blocks", "128", "--skip-off", "-dp", "2"])
    assert r["data_parallel_size"] == 2 and r["throughput_on_out3"]["output_tok_s"] > 0
""")

ROUTING = COMMON + textwrap.dedent("""
    rng = np.random.default_rng(1)
    PREFIX, PER_GROUP = 32, 4
    prefixes = [rng.integers(3, 200, PREFIX).tolist() for _ in range(4)]
    # 4 groups interleaved, the order rotated every round (so round robin splits groups)
    order = [(k + j) % 4 for k in range(PER_GROUP) for j in range(4)]
    prompts = [prefixes[g] + rng.integers(3, 200, 5 + i % 3).tolist()
               for i, g in enumerate(order)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(dp, policy, prompts=prompts, pos=PREFIX):
        llm = LLM(tiny, data_parallel_size=dp, routing_policy=policy, **KW)
        groups = [llm.engine.make_request(p, sp, pos) for p in prompts]
        where, queue = [], llm.engine._queue  # the replica of each (DP 1: None)
        llm.engine._queue = lambda s, text: where.append(queue(s, text) or 0)
        done = llm._driver.run(groups)
        return llm, where, [done[g.request_id] for g in groups]

    llm1, _, outs1 = run(1, "prefix")
    llm_a, where_a, outs_a = run(2, "prefix")
    llm_r, where_r, outs_r = run(2, "round_robin")
    figures = {name: prefill_tokens(llm, outs) for name, llm, outs in (
        ("dp1", llm1, outs1), ("affinity", llm_a, outs_a), ("round_robin", llm_r, outs_r))}
    print(json.dumps({"prefill_tokens": figures}))
    groups = {g: {where_a[i] for i, h in enumerate(order) if h == g} for g in range(4)}
    assert all(len(v) == 1 for v in groups.values()), groups
    stats = llm_a.stats()["replicas"]
    assert [s["requests"] for s in stats] == [8, 8], stats  # two groups each
    assert [s["affinity_requests"] for s in stats] == [6, 6], stats  # all but the firsts
    assert sum(s["num_hit_tokens"] for s in stats) == llm1.stats()["num_hit_tokens"]
    assert figures["affinity"] == figures["dp1"] < figures["round_robin"], figures
    assert len({tuple(where_r[i] for i, h in enumerate(order) if h == g)
                for g in range(4)}) > 1
    assert [o.token_ids for o in outs_a] == [o.token_ids for o in outs1]

    # one very hot prefix: the imbalance bound sends some of it to the other replica,
    # which copies the prefix and then serves its share from its own cache
    hot = [prefixes[0] + rng.integers(3, 200, 6).tolist() for _ in range(12)]
    llm_h, where_h, _ = run(2, "prefix:balance_abs=0", hot)
    stats = llm_h.stats()["replicas"]
    assert all(s["requests"] >= 4 for s in stats), stats
    assert all(s["num_hit_tokens"] > 0 for s in stats), stats
    _, where_u, _ = run(2, "prefix:balance_rel=1000", hot)
    assert set(where_u) == {0}, where_u  # without the bound: one replica takes it all

    # aborts and disconnects: each frees its blocks on the replica that held it
    llm = LLM(tiny, data_parallel_size=2, routing_policy="round_robin", **KW)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def wait_for(cond, what):
        for _ in range(4000):
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"timed out waiting for {what}: {used_blocks(llm)}")

    async def main():
        kinds = [RequestOutputKind.DELTA] * 2 + [RequestOutputKind.FINAL_ONLY]
        groups = [await llm.make_request_async(p, dataclasses.replace(long, output_kind=k),
                                               PREFIX) for p, k in zip(prompts[:3], kinds)]
        seqs = [g.seqs[0] for g in groups]  # (the scheduler's state, read to check it)
        a, b = llm.stream_group(groups[0]), llm.stream_group(groups[1])
        await a.__anext__()  # a runs on replica 0
        await b.__anext__()  # b on replica 1
        c = asyncio.ensure_future(llm.generate_group(groups[2]))  # c on replica 0
        await wait_for(lambda: seqs[2].num_output_tokens > 0, "c running")
        assert [llm.engine.replica_of(s.request_id) for s in seqs] == [0, 1, 0]
        await a.aclose()  # leaving a stream: a disconnect
        await wait_for(lambda: seqs[0].is_finished(), "a aborted")
        assert seqs[0].finish_reason == "abort" and seqs[0].block_table == []
        assert used_blocks(llm)[0] > 0 and not seqs[2].is_finished()  # c holds its own
        c.cancel()  # cancelling a plain request (what a server disconnect does)
        await wait_for(lambda: used_blocks(llm)[0] == 0, "replica 0 freed")
        assert seqs[2].finish_reason == "abort"
        assert used_blocks(llm)[1] > 0 and not seqs[1].is_finished()  # b still runs there
        await b.aclose()
        await wait_for(lambda: used_blocks(llm) == [0, 0], "replica 1 freed")
        assert seqs[1].finish_reason == "abort"
        await wait_for(lambda: not llm.engine.has_unfinished_requests(), "idle")
        assert all(llm.engine.replica_of(s.request_id) is None for s in seqs)

    asyncio.run(main())
    for r in llm.engine.replicas:
        r.scheduler.block_manager.check_invariants()
        r.scheduler.prefix_pool.check_invariants()
    stats = llm.stats()
    assert [s["requests"] for s in stats["replicas"]] == [2, 1], stats
    assert [s["kv_used_blocks"] for s in stats["replicas"]] == [0, 0]
    assert llm.reset_prefix_cache() and llm.stats()["num_cached_blocks"] == 0

    # warmup and the prefix pool's surface over both replicas; the server's /stats
    assert llm_a.reset_prefix_cache()
    (warm,) = llm_a.warmup([prefixes[3]], pin=True)
    home = [s["num_cached_blocks"] for s in llm_a.stats()["replicas"]].index(PREFIX // 8)
    hits = [s["num_hit_tokens"] for s in llm_a.stats()["replicas"]]
    out = llm_a.generate([prompts[3]], sp, prefix_pos=PREFIX, use_tqdm=False)[0]
    assert out.num_cached_tokens == PREFIX
    hits = [s["num_hit_tokens"] - h for s, h in zip(llm_a.stats()["replicas"], hits)]
    assert hits[home] == PREFIX and sum(hits) == PREFIX  # served where it was warmed
    assert not llm_a.reset_prefix_cache()  # pinned
    assert llm_a.prefix_pool.delete_prefix(warm.hash) == PREFIX // 8
    try:
        llm_a.prefix_pool.delete_prefix(warm.hash)
    except ValueError as e:
        assert "any replica" in str(e)
    else:
        raise AssertionError("deleted twice")
    from fastapi.testclient import TestClient
    from jprefix.entrypoints.openai_server import build_app
    with TestClient(build_app(llm_a)) as client:
        body = {"prompt": prompts[5], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "prefix_pos": PREFIX}
        first = client.post("/v1/completions", json=body).json()
        second = client.post("/v1/completions", json=body | {"stream": True})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second.status_code == 200 and "[DONE]" in second.text
        stats = client.get("/stats").json()
    assert stats["data_parallel_size"] == 2 and len(stats["replicas"]) == 2
    assert stats["num_hit_tokens"] == sum(r["num_hit_tokens"] for r in stats["replicas"])
    assert {"requests", "queued_tokens", "hit_rate", "kv_usage", "running", "waiting",
            "devices"} <= set(stats["replicas"][0])
    one = llm1.stats()
    assert one["data_parallel_size"] == 1 and one["replicas"][0]["requests"] == len(prompts)
""")


@functools.cache
def four_device_run(script: str) -> CheckRun:
    return run_checks(script, [], device_env(4), timeout=600)


@pytest.mark.parametrize("check", check_names(EQUAL))
def test_dp2_and_dp2_tp2_greedy_tokens_equal_dp1(check):
    assert_check(four_device_run(EQUAL), check)


@pytest.mark.parametrize("check", check_names(ROUTING))
def test_affinity_routing_hot_prefix_and_aborts_on_the_replica_that_held_them(check):
    assert_check(four_device_run(ROUTING), check)


def test_serve_passes_data_parallel_flags_to_the_engine(monkeypatch):
    import jprefix
    from jprefix.entrypoints import cli, openai_server

    made = {}
    monkeypatch.setattr(jprefix, "LLM", lambda model, **kw: made.update(kw, model=model))
    monkeypatch.setattr(openai_server, "serve", lambda llm, host, port, **kw: None)
    assert cli.main(["serve", "--model", "tiny-llama", "--data-parallel-size", "2",
                     "--routing-policy", "round_robin", "--tensor-parallel-size", "2"]) == 0
    assert (made["data_parallel_size"], made["routing_policy"],
            made["tensor_parallel_size"]) == (2, "round_robin", 2)
    args = cli._build_parser().parse_args(["serve"])
    assert (args.data_parallel_size, args.routing_policy) == (1, "prefix")
