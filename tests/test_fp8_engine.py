"""The engine with an fp8 KV cache (`kv_cache_dtype`): greedy tokens identical with the
prefix cache on and off, in explicit and automatic prefix modes, with cascade decode,
and equal to a dense reference whose attention reads each K/V row through the same
per-row fp8 round trip; the flags' validation; block counts that know the format."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.engine.args import EngineArgs
from jprefix.worker.kv_cache import kv_block_bytes, kv_dtype
from models.config import PRESETS
from models.llama import compute_logits, forward
from models.reference import causal_attention
from pallas_kernels.fp8 import FP8_NAMES, dequantize_rows, quantize_rows

BS = 8


@pytest.fixture(scope="module")
def sharp(sharp_tiny):
    return sharp_tiny


def dense_fp8_generate(params, cfg, prompt, max_tokens, fp8):
    """Greedy decoding by whole-sequence recompute; attention sees every K/V row as its
    per-row fp8 round trip (what the paged fp8 cache stores and the kernels read). The
    sequence is padded to a multiple of 64 so that one compiled program serves every
    length: causal attention keeps the padding out of every real row."""
    ids = list(prompt)
    padded = np.zeros(-(-(len(ids) + max_tokens) // 64) * 64, np.int32)
    for _ in range(max_tokens):
        padded[:len(ids)] = ids
        ids.append(int(_fp8_next_token(params, cfg, jnp.asarray(padded), len(ids), fp8)))
    return ids[len(prompt):]


@functools.partial(jax.jit, static_argnames=("cfg", "fp8"))
def _fp8_next_token(params, cfg, ids, n, fp8):
    """ids [L] (the first `n` real) -> the greedy token after ids[n - 1]."""
    def attn(q, k, v, pos, layer):  # (the "cache" slot carries the positions)
        k = dequantize_rows(*quantize_rows(k, fp8), dtype=k.dtype)
        v = dequantize_rows(*quantize_rows(v, fp8), dtype=v.dtype)
        return causal_attention(q[None], k[None], v[None], pos, pos)[0], pos

    pos = jnp.arange(ids.shape[0], dtype=jnp.int32)
    hidden, _ = forward(params, cfg, ids, pos, pos, attn)
    return jnp.argmax(compute_logits(params, cfg, hidden[n - 1]))


def _prompts(vocab, rng):
    shared = rng.integers(3, vocab, 3 * BS).tolist()  # three shared blocks
    prompts = [shared + rng.integers(3, vocab, int(n)).tolist() for n in (2, 5, 9, 11)]
    return prompts + [rng.integers(3, vocab, 13).tolist()]


@pytest.mark.parametrize("backend,kv_cache_dtype", [
    ("xla", "fp8"), ("xla", "fp8_e5m2"), ("pallas-interpret", "fp8")])
def test_fp8_greedy_tokens_identical_with_prefix_cache_on_off_and_dense(sharp, backend,
                                                                        kv_cache_dtype):
    cfg = sharp.config
    prompts = _prompts(cfg.vocab_size, np.random.default_rng(1))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fp8 = FP8_NAMES[kv_cache_dtype]
    want = [dense_fp8_generate(sharp.params, cfg, p, sp.max_tokens, fp8) for p in prompts]
    runs = {}
    for caching, prefix_pos, cascade in [(False, None, False), (True, None, False),
                                         (True, 3 * BS, False), (True, None, True)]:
        llm = LLM(sharp, block_size=BS, num_kv_blocks=96, attention_backend=backend,
                  kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=caching,
                  enable_cascade=cascade, cascade_min_group=2, cascade_min_blocks=1,
                  unroll_layers=True)  # (as on a GPU: fused Q/K/V, rope_write_kv)
        assert llm.engine.runner.kv_cache_values()[0].dtype == fp8
        assert len(llm.engine.runner.kv_cache) == 4
        pos = None if prefix_pos is None else [prefix_pos] * 4 + [0]  # (the loner: 0)
        llm.generate(prompts[:1], sp, prefix_pos=prefix_pos, use_tqdm=False)  # warm cache
        outs = llm.generate(prompts, sp, prefix_pos=pos, use_tqdm=False)
        if caching:
            assert sum(o.num_cached_tokens for o in outs) >= 4 * 3 * BS
        if cascade:
            assert any(s[4] for s in llm.engine.runner.shapes_seen), "no cascade step"
        runs[(caching, prefix_pos, cascade)] = [o.token_ids for o in outs]
    for key, tokens in runs.items():
        assert tokens == want, key


def test_fp8_cache_differs_from_the_float_cache_only_by_quantisation(sharp):
    """A sanity check that the fp8 run really reads fp8: its dense reference with the
    round trip and without it give different logits, and the engine follows the former."""
    cfg = sharp.config
    prompt = _prompts(cfg.vocab_size, np.random.default_rng(2))[0]
    llm = LLM(sharp, block_size=BS, num_kv_blocks=64, attention_backend="xla",
              kv_cache_dtype="fp8")
    k = np.asarray(llm.engine.runner.kv_cache_values()[0], np.float32)
    assert not k.any()  # zeroed cache, scales 1
    assert np.all(np.asarray(llm.engine.runner.kv_cache[2]) == 1.0)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    k8 = llm.engine.runner.kv_cache_values()[0]
    assert np.asarray(k8, np.float32).any()
    # every written row reaches the format's largest magnitude (its own scale)
    written = np.abs(np.asarray(k8, np.float32)).max(axis=-1)
    assert np.isclose(written[written > 0], 448.0).all()


def test_bad_flag_values_raise_value_error_naming_them():
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp16' is not one of auto, fp8, "
                                         r"fp8_e4m3, fp8_e5m2"):
        EngineArgs(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match=r"quantization 'int4' is not one of None, fp8"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp9'"):
        kv_dtype("fp9", jnp.float32)


def test_fp8_blocks_count_their_scales_and_nearly_double():
    cfg = PRESETS["llama-2-7b"]
    bf16 = kv_block_bytes(cfg, 16, jnp.bfloat16)
    fp8 = kv_block_bytes(cfg, 16, kv_dtype("fp8", jnp.bfloat16))
    assert bf16 == 2 * 32 * 32 * 16 * 128 * 2
    assert fp8 == 2 * 32 * 32 * 16 * (128 + 4)  # one float32 scale per row
    assert 1.9 < bf16 / fp8 < 2.0


def test_generate_and_cli_take_the_flag(sharp):
    prompt = _prompts(sharp.config.vocab_size, np.random.default_rng(3))[1]
    sp = jprefix.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = jprefix.generate(sharp, [prompt], prefix_len=BS, sampling_params=sp,
                            kv_cache_dtype="fp8", num_kv_blocks=32, block_size=BS,
                            attention_backend="xla")
    want = dense_fp8_generate(sharp.params, sharp.config, prompt, 3, FP8_NAMES["fp8"])
    assert outs[0].token_ids == want


def test_cli_and_scripts_take_the_flags():
    from jprefix.entrypoints.cli import _build_parser, fp8_kwargs
    from scripts.bench_engine import workload_parser

    parser = _build_parser()
    for cmd in ("generate", "serve"):
        args = parser.parse_args([cmd, "--kv-cache-dtype", "fp8_e5m2", "--quantization", "fp8"])
        assert fp8_kwargs(args) == {"kv_cache_dtype": "fp8_e5m2", "quantization": "fp8"}
        assert fp8_kwargs(parser.parse_args([cmd])) == {"kv_cache_dtype": "auto",
                                                        "quantization": None}
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--kv-cache-dtype", "int8"])
    args = workload_parser("x").parse_args(["--kv-cache-dtype", "fp8", "--quantization", "fp8"])
    assert fp8_kwargs(args) == {"kv_cache_dtype": "fp8", "quantization": "fp8"}


def test_fp8_on_a_gpu_without_fp8_says_so(monkeypatch):
    from types import SimpleNamespace

    from jprefix.worker import kv_cache

    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="A100")
    monkeypatch.setattr(kv_cache.jax, "devices", lambda: [a100])
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU with fp8 "
                                         r"support .*A100 has 8.0"):
        kv_dtype("fp8", jnp.bfloat16)
    with pytest.raises(ValueError, match="quantization='fp8' needs a GPU"):
        kv_cache.check_fp8_device("quantization='fp8'")
    h200 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="H200")
    monkeypatch.setattr(kv_cache.jax, "devices", lambda: [h200])
    assert kv_dtype("fp8_e5m2", jnp.bfloat16) == FP8_NAMES["fp8_e5m2"]
