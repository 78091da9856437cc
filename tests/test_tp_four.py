"""Tensor parallelism on 4 virtual CPU devices: greedy tokens at TP 4 equal the dense
reference (as TP 1's and 2's do in the other engine tests), on both layer layouts (stacked under
lax.scan; unrolled with Q/K/V and gate/up fused), with cascade and mixed steps;
tiny-llama3's 2 kv heads are replicated at TP 4 (one per shard); TP sizes that cannot
split the heads raise.

Runs in a subprocess because the CPU device count is fixed when jax starts: once per
backend, each of its assertions a test of its own here, by name
(tests/subprocess_checks.py).
"""

import functools
import textwrap

import pytest
from subprocess_checks import CheckRun, assert_check, check_names, device_env, run_checks

SCRIPT = textwrap.dedent("""
    import dataclasses, sys
    import jax, numpy as np
    import jprefix
    from jprefix import LLM, SamplingParams
    from jprefix.worker import parallel
    from jprefix.worker import step as step_mod
    from jprefix.worker import step_linear as linear_mod
    from models.reference import dense_generate
    assert len(jax.devices()) == 4, jax.devices()
    backend = sys.argv[1]
    from models.config import PRESETS
    # tiny-llama3 with per-device widths the few-row matmul takes (multiples of 64) at TP 4
    cfg = dataclasses.replace(PRESETS["tiny-llama3"], head_dim=64, intermediate_size=256)
    model = jprefix.load(cfg, dtype="float32", load_format="dummy")
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    lp = model.params.layers  # attention weights x8: tokens depend on what rows attend
    sharp = dataclasses.replace(lp, wq=lp.wq * 8, wk=lp.wk * 8, wv=lp.wv * 8, wo=lp.wo * 8)
    model = dataclasses.replace(model, params=dataclasses.replace(model.params, layers=sharp))
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 24).tolist()
    prompts = [shared + rng.integers(3, 200, n).tolist() for n in (3, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [dense_generate(model.params, cfg, p, 5, eos_token_ids=()) for p in prompts]
    calls = []  # the Pallas fast paths' calls as traced: (kernel, per-device size)
    real_rope, real_skinny = step_mod.rope_write_kv, linear_mod.skinny_matmul
    step_mod.rope_write_kv = lambda *a, **k: calls.append(("rope", k["num_heads"])) or \
        real_rope(*a, **k)
    linear_mod.skinny_matmul = lambda x, w, **k: calls.append(
        ("skinny", w.shape[-1], k.get("act"))) or real_skinny(x, w, **k)
    f = cfg.intermediate_size
    # (TP 1 and 2 equal the dense reference in the other engine tests,
    # tests/test_tensor_parallel.py's on both layouts; TP 4 is where kv heads replicate)
    tp = 4
    for unroll in (False, True):
        calls.clear()
        llm = LLM(model, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                  attention_backend=backend, cascade_min_group=2, cascade_min_blocks=1,
                  max_num_batched_tokens=24, unroll_layers=unroll)
        llm.generate(prompts[:1], sp, prefix_pos=24, use_tqdm=False)  # caches the prefix
        got = [o.token_ids for o in llm.generate(prompts, sp, prefix_pos=24,
                                                 use_tqdm=False)]
        assert got == want, (unroll, tp, got, want)
        seen = llm.engine.runner.shapes_seen
        assert any(s[4] for s in seen), (tp, seen)  # cascade steps ran
        assert any(s[5] for s in seen), (tp, seen)  # mixed steps ran
        if backend == "pallas-interpret":  # the fast paths ran, per device under TP
            # gate/up on each device's F / tp columns: fused [gate | up] or apart
            gate_up = {(c[1], c[2]) for c in calls if c[0] == "skinny"}
            assert ((2 * f // tp, "silu_mul") if unroll else (f // tp, None)) in gate_up, \
                (tp, calls)
            rope = {c[1] for c in calls if c[0] == "rope"}
            assert rope == ({cfg.num_heads // tp} if unroll else set()), (tp, rope)
        else:
            assert calls == [], calls
        runner = llm.engine.runner  # each shard one kv head (kv head j // 2 of the model)
        assert runner.cfg.num_kv_heads == 4
        k = runner.kv_cache[0]
        assert k.shape[1] == 4 and k.addressable_shards[0].data.shape[1] == 1
    for name, tp, why in (("tiny-llama3", 3, "does not divide the model's 4 query heads"),
                          ("tiny-smollm2", 3, "neither divides nor is a multiple")):
        try:
            LLM(name, tensor_parallel_size=tp, dtype="float32", load_format="dummy")
        except ValueError as e:
            assert why in str(e), e
        else:
            raise AssertionError(f"{name} at tp={tp} was accepted")
    try:
        parallel.check_tp_size(cfg, 8)
    except ValueError as e:
        assert "exceeds the model's 4 query heads" in str(e), e
    else:
        raise AssertionError("tp=8 over 4 query heads was accepted")
""")


@functools.cache
def four_device_run(backend: str) -> CheckRun:
    return run_checks(SCRIPT, [backend], device_env(4), timeout=800)


@pytest.mark.parametrize("check", check_names(SCRIPT))
@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_four_device_tp_4_with_replicated_kv_heads_matches_dense(backend, check):
    assert_check(four_device_run(backend), check)


@pytest.mark.parametrize("unroll", [False, True])
def test_one_device_step_traces_no_tensor_parallel_machinery(unroll):
    """TP 1 keeps its own program: no shard_map and no per-shard layout in the step."""
    from jprefix import LLM
    from jprefix.worker import step as step_mod
    from scripts.memcheck import synthetic_rows

    llm = LLM("tiny-llama3", dtype="float32", load_format="dummy", block_size=8,
              num_kv_blocks=32, attention_backend="pallas-interpret", unroll_layers=unroll)
    runner = llm.engine.runner
    assert runner.params.shards == 1 and runner.mesh is None
    rows = synthetic_rows([list(range(3, 15))] * 2, [[1, 2], [3, 4]], [6, 1])
    _, (flat, layout, _), _, kind, _ = runner.packer.pack(rows, None)
    traced = step_mod.step.trace(
        runner.params, runner.kv_cache, flat, runner._last_tokens, layout=layout,
        cfg=runner.cfg, backend=runner.backend, decode=kind.decode, greedy=True,
        cascade=kind.cascade)
    text = str(traced.jaxpr)
    assert "rope_write_kv" in text or not unroll  # (the fast path is there)
    assert "shard_map" not in text and "sharding_constraint" not in text
