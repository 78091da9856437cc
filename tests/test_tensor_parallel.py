"""Tensor parallelism: greedy tokens on 2 (virtual CPU) devices equal those on one (also
with n-gram speculation, and over two data-parallel replicas).

Runs in a subprocess because the CPU device count is fixed when jax starts: each script
runs once per backend, and each of its assertions is a test of its own here, by name
(tests/subprocess_checks.py).
"""

import functools
import textwrap

import pytest
from subprocess_checks import CheckRun, assert_check, check_names, device_env, run_checks

# what every script below starts with: imports, two devices, the backend from argv, and
# prompts of 24 shared + 3 / 7 / 12 own random tokens
PRELUDE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import jprefix
    from jprefix import LLM, SamplingParams
    assert len(jax.devices()) == 2, jax.devices()
    backend = sys.argv[1]

    def shared_prompts(seed, high=200):
        rng = np.random.default_rng(seed)
        shared = rng.integers(3, high, 24).tolist()
        return [shared + rng.integers(3, high, n).tolist() for n in (3, 7, 12)]
""")

SCRIPT = PRELUDE + textwrap.dedent("""
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    prompts = shared_prompts(0)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    for tp, fixed in ((1, False), (2, False), (2, True)):
        llm = LLM(tiny, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                  attention_backend=backend, cascade_min_group=2, cascade_min_blocks=1,
                  unroll_layers=backend == "xla",  # both layer layouts: GPU unrolls
                  fixed_inputs=fixed)
        tokens = [o.token_ids for o in llm.generate(prompts, sp, prefix_pos=24,
                                                    use_tqdm=False)]
        if fixed:  # the refilled input buffers sit on both devices, whole on each
            bufs = list(llm.engine.runner.fixed_inputs._buffers.values())
            assert bufs and all(len(b.sharding.device_set) == 2
                                and b.sharding.is_fully_replicated for b in bufs), bufs
            assert tokens == out[2], (tokens, out[2])
            continue
        out[tp] = tokens
        if tp == 2:
            k = llm.engine.runner.kv_cache[0]
            assert len(k.sharding.device_set) == 2, k.sharding
            assert k.addressable_shards[0].data.shape[1] == 1  # one of two kv heads each
            layers = llm.engine.runner.params.layers
            wq = layers[0].wq if isinstance(layers, tuple) else layers.wq
            assert wq.addressable_shards[0].data.shape[-1] == wq.shape[-1] // 2, wq.sharding
    print(json.dumps(out))
    assert out[1] == out[2], out
    by_name = LLM("tiny-llama3", tensor_parallel_size=2, dtype="float32", load_format="dummy",
                  block_size=8, num_kv_blocks=64, attention_backend=backend)
    wq = by_name.engine.model.params.layers.wq
    assert wq.addressable_shards[0].data.shape[-1] == wq.shape[-1] // 2  # loaded sharded
    assert len(by_name.generate(prompts, sp, use_tqdm=False)[0].token_ids) == 6
    try:
        LLM(tiny, tensor_parallel_size=3)
    except ValueError as e:
        assert "tensor_parallel_size 3" in str(e), e
    else:
        raise AssertionError("tp=3 on 2 devices was accepted")
""")


# ALiBi (6 heads, 3 per device): each device biases its query heads with their own slopes;
# prefix caching and cascade decode steps on both, greedy tokens equal to one device's and
# to the dense reference's
ALIBI_SCRIPT = PRELUDE + textwrap.dedent("""
    from models.reference import dense_generate
    model = jprefix.load("tiny-baichuan2-alibi", dtype="float32", load_format="dummy")
    assert model.config.alibi and model.config.num_heads == 6
    prompts = shared_prompts(0, 1000)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = {}
    for tp in (1, 2):
        llm = LLM(model, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                  attention_backend=backend, cascade_min_group=2, cascade_min_blocks=1,
                  unroll_layers=backend == "xla")
        llm.generate(prompts[:1], sp, prefix_pos=24, use_tqdm=False)
        out[tp] = [o.token_ids for o in llm.generate(prompts, sp, prefix_pos=24,
                                                     use_tqdm=False)]
        assert any(s[4] for s in llm.engine.runner.shapes_seen)  # cascade steps ran
    k = llm.engine.runner.kv_cache[0]
    assert k.addressable_shards[0].data.shape[1] == 3  # three of six heads each
    want = [dense_generate(model.params, model.config, p, 5, eos_token_ids=()) for p in prompts]
    assert out[1] == out[2] == want, (out, want)
""")


@functools.cache
def two_device_run(script: str, backend: str) -> CheckRun:
    """The script's one run on 2 devices with this attention backend (cached)."""
    return run_checks(script, [backend], device_env(2), timeout=600)


@pytest.mark.parametrize("check", check_names(SCRIPT))
@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_two_device_tensor_parallel_matches_one_device(backend, check):
    assert_check(two_device_run(SCRIPT, backend), check)


@pytest.mark.parametrize("check", check_names(ALIBI_SCRIPT))
@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_two_device_tensor_parallel_alibi_matches_one_device_and_dense(backend, check):
    assert_check(two_device_run(ALIBI_SCRIPT, backend), check)


# fp8 KV cache over 2 devices: the scales are split by kv head with the caches, greedy
# tokens equal one device's; fp8 weights are single-device and say so
FP8_SCRIPT = PRELUDE + textwrap.dedent("""
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    prompts = shared_prompts(1)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = {}
    for tp in (1, 2):
        llm = LLM(tiny, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                  attention_backend=backend, kv_cache_dtype="fp8", cascade_min_group=2,
                  cascade_min_blocks=1)
        out[tp] = [o.token_ids for o in llm.generate(prompts, sp, prefix_pos=24,
                                                     use_tqdm=False)]
    cache = llm.engine.runner.kv_cache
    assert len(cache) == 4 and all(len(x.sharding.device_set) == 2 for x in cache)
    assert cache[2].addressable_shards[0].data.shape[1] == 1  # one of two kv heads each
    assert out[1] == out[2], out
    try:
        LLM(tiny, tensor_parallel_size=2, quantization="fp8", num_kv_blocks=16)
    except ValueError as e:
        assert "one device" in str(e), e
    else:
        raise AssertionError("fp8 weights with tensor parallelism were accepted")
""")


@pytest.mark.parametrize("check", check_names(FP8_SCRIPT))
def test_two_device_tensor_parallel_fp8_kv_matches_one_device(check):
    assert_check(two_device_run(FP8_SCRIPT, "xla"), check)


# n-gram speculation over 2 devices, as tensor parallelism (each verify step sharded) and
# as two data-parallel replicas: greedy tokens equal one device's without speculation
SPEC_SCRIPT = PRELUDE + textwrap.dedent("""
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    rng = np.random.default_rng(5)
    motif = rng.integers(3, 200, 5).tolist()
    prompts = [motif * 5 + rng.integers(3, 200, n).tolist() for n in (2, 6, 9)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    out, drafts = {}, {}
    for name, kw in (("off", {}), ("tp2", dict(tensor_parallel_size=2,
                                                speculative_config=spec)),
                     ("dp2", dict(data_parallel_size=2, speculative_config=spec))):
        llm = LLM(tiny, block_size=8, num_kv_blocks=64, attention_backend=backend, **kw)
        out[name] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        drafts[name] = llm.engine.stats.spec.num_drafts
    assert out["tp2"] == out["off"], out
    assert out["dp2"] == out["off"], out
    assert drafts["tp2"] > 0 and drafts["dp2"] > 0, drafts
""")


@pytest.mark.parametrize("check", check_names(SPEC_SCRIPT))
def test_two_device_speculation_tp_and_dp_match_one_device_off(check):
    assert_check(two_device_run(SPEC_SCRIPT, "xla"), check)


def test_a_failing_subprocess_check_is_reported_by_name():
    # (the mechanism every subprocess test here relies on, on a script without jax)
    import os
    import re

    script = textwrap.dedent("""
        import sys
        for i in range(3):
            assert i < 2, ("loop", i)
        assert sys.argv[1] == "x"
        try:
            int("1")
        except ValueError:
            pass
        else:
            raise AssertionError("int accepted '1'")
        assert 1 + 1 == 2
    """)
    names = check_names(script)
    assert names[:4] == ["i < 2", 'sys.argv[1] == "x"', "int accepted '1'", "1 + 1 == 2"]
    run = run_checks(script, ["x"], dict(os.environ), timeout=60)
    assert_check(run, 'sys.argv[1] == "x"')
    assert_check(run, "1 + 1 == 2")
    assert_check(run, names[-1])  # ran to its end: a failed check does not stop the script
    for name, detail in (("i < 2", "('loop', 2)"), ("int accepted '1'", "int accepted")):
        with pytest.raises(AssertionError, match=re.escape(name) + ": .*" + re.escape(detail)):
            assert_check(run, name)
