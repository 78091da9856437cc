"""The host tier under tensor and data parallelism (2 virtual CPU devices, in a
subprocess: the device count is fixed when jax starts): TP=2 with the tier on gives the
tokens of TP=1 with it off, each shard moving its own kv heads; DP=2 has one tier per
replica, the same tokens, and the router counts a prefix held only in a replica's host
tier as that replica's."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from subprocess_checks import device_env

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    import jprefix
    from jprefix import LLM, SamplingParams
    assert len(jax.devices()) == 2, jax.devices()
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    rng = np.random.default_rng(0)
    hist = [rng.integers(3, 200, 35).tolist() for _ in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(llm):
        return [llm.generate([h], sp, use_tqdm=False)[0].token_ids
                for _ in range(2) for h in hist]

    out, base = {}, dict(block_size=8, attention_backend="xla", num_kv_blocks=14)
    out["tp1_off"] = run(LLM(tiny, **base))
    tp = LLM(tiny, tensor_parallel_size=2, kv_offloading_size=0.001, **base)
    out["tp2_on"] = run(tp)
    out["tp2_host_hits"] = tp.stats()["num_host_hit_tokens"]
    dp = LLM(tiny, data_parallel_size=2, kv_offloading_size=0.001, **base)
    out["dp2_on"] = run(dp)
    reps = dp.engine.replicas
    out["tiers"] = len({id(r.kv_tier.pool) for r in reps})
    out["dp_host_hits"] = dp.stats()["num_host_hit_tokens"]
    held = [(i, node.prefix_hash) for i, r in enumerate(reps)
            for salt, blocks, node in r.kv_tier.pool.entries()
            if len(blocks) == 1 and r.prefix_pool.trie.find(node.prefix_hash) is None]
    out["affinity"] = [(i, dp.engine.router.matched_blocks([h])) for i, h in held]
    print("RESULT " + json.dumps(out))
""")


def test_host_tier_under_tensor_and_data_parallelism():
    env = device_env(2, cpu=False)  # (on a GPU machine the tier runs on the GPU)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["tp2_on"] == out["tp1_off"] == out["dp2_on"]
    assert out["tp2_host_hits"] > 0 and out["dp_host_hits"] > 0
    assert out["tiers"] == 2
    assert out["affinity"], "no prefix was held only on a host tier"
    for replica, matched in out["affinity"]:
        assert matched[replica] == 1
