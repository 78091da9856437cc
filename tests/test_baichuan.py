"""Baichuan2 end to end on the CPU: tiny random checkpoints in Baichuan's HF layout (W_pack,
NormHead, its config keys) load, their logits equal an independent torch Baichuan2 written
here, and the engine's greedy tokens equal the dense reference with the prefix cache on
and off (explicit, automatic and multi-level prefixes, cascade), for ALiBi (13B-style) and
RoPE (7B-style)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import jprefix
from jprefix import LLM, SamplingParams
from models.alibi import alibi_slopes
from models.config import PRESETS, ModelConfig, from_hf_config
from models.llama import forward
from models.reference import causal_attention, dense_forward, dense_generate
from models.weights import init_params

BS = 8
TINY = {"alibi": "tiny-baichuan2-alibi", "rope": "tiny-baichuan2-rope"}


def _hf_config(cfg: ModelConfig) -> dict:
    """config.json as Baichuan2 publishes it: the 13B (ALiBi) has only model_max_length,
    the 7B (RoPE) also max_position_embeddings."""
    hf = dict(
        architectures=["BaichuanForCausalLM"], model_type="baichuan",
        auto_map={"AutoConfig": "configuration_baichuan.BaichuanConfig",
                  "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
        hidden_act="silu", hidden_size=cfg.hidden_size, initializer_range=0.02,
        intermediate_size=cfg.intermediate_size, model_max_length=cfg.max_position_embeddings,
        num_attention_heads=cfg.num_heads, num_hidden_layers=cfg.num_layers, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
        vocab_size=cfg.vocab_size, z_loss_weight=0)
    if not cfg.alibi:
        hf["max_position_embeddings"] = cfg.max_position_embeddings
    return hf


def _write_checkpoint(cfg: ModelConfig, directory, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under Baichuan2's tensor names, saved as model.safetensors with its
    config.json and a tokenizer_config.json naming the remote-code tokenizer class."""
    gen = torch.Generator().manual_seed(seed)
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def w(*shape):
        return 0.15 * torch.randn(*shape, generator=gen)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=gen)

    sd = {"model.embed_tokens.weight": w(v, e), "model.norm.weight": norm(e),
          "lm_head.weight": 3.0 * w(v, e)}  # NormHead: rows far from unit norm
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": norm(e), p + "self_attn.W_pack.weight": w(3 * e, e),
               p + "self_attn.o_proj.weight": w(e, e), p + "post_attention_layernorm.weight":
               norm(e), p + "mlp.gate_proj.weight": w(f, e), p + "mlp.up_proj.weight": w(f, e),
               p + "mlp.down_proj.weight": w(e, f)}
    safetensors.torch.save_file(sd, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(_hf_config(cfg)))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BaichuanTokenizer", "add_bos_token": False,
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}}))
    return sd


def _interleave(n: int) -> list[float]:
    """ALiBi slopes as Baichuan2-13B's modeling file defines them (a recursion on log2)."""
    def pow2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + _interleave(2 * c)[0::2][: n - c]


def torch_baichuan2(sd: dict[str, torch.Tensor], hf: dict, ids: torch.Tensor) -> torch.Tensor:
    """Baichuan2's forward (float32) from its HF state dict: ids [S, T] -> logits [S, T, V].

    RoPE (rotate_half) when the config has max_position_embeddings, else ALiBi as the 13B
    applies it: `slope_h * k_pos` added to every row (softmax is shift-invariant, so this
    equals `slope_h * (k_pos - q_pos)`). NormHead: lm_head rows normalised on the call.
    """
    e, nh, eps = hf["hidden_size"], hf["num_attention_heads"], hf["rms_norm_eps"]
    d, (s, t) = e // nh, ids.shape
    pos = torch.arange(t, dtype=torch.float32)
    bias = torch.full((t, t), float("-inf")).triu(1)
    rope = "max_position_embeddings" in hf
    if rope:
        freqs = torch.outer(pos, 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    else:
        bias = torch.tensor(_interleave(nh))[:, None, None] * pos[None, None, :] + bias

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = sd["model.embed_tokens.weight"][ids]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q, k, v = (t_.view(s, t, nh, d).transpose(1, 2)
                   for t_ in (h @ sd[p + "self_attn.W_pack.weight"].T).split(e, dim=-1))
        if rope:
            q, k = rotate(q), rotate(k)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + bias, dim=-1)
        x = x + (att @ v).transpose(1, 2).reshape(s, t, e) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        mlp = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"])
    return x @ F.normalize(sd["lm_head.weight"]).T


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"alibi" | "rope": (checkpoint dir, state dict)}"""
    out = {}
    for seed, (kind, name) in enumerate(TINY.items()):
        directory = tmp_path_factory.mktemp(kind)
        out[kind] = directory, _write_checkpoint(PRESETS[name], directory, seed)
    return out


@pytest.fixture(scope="module")
def models(checkpoints):
    return {kind: jprefix.load(d, dtype="float32") for kind, (d, _) in checkpoints.items()}


@pytest.mark.parametrize("kind", ["alibi", "rope"])
def test_checkpoint_loads_and_logits_equal_torch_baichuan2(checkpoints, models, kind):
    directory, sd = checkpoints[kind]
    loaded = models[kind]
    assert loaded.config == PRESETS[TINY[kind]] and loaded.config.alibi == (kind == "alibi")
    assert loaded.tokenizer is None  # the remote-code BaichuanTokenizer is not loaded
    head = np.asarray(loaded.params.lm_head)  # [E, V], NormHead rows normalised once
    np.testing.assert_allclose(np.linalg.norm(head, axis=0), 1.0, rtol=1e-5)
    ids = np.random.default_rng(0).integers(0, loaded.config.vocab_size, (2, 23))
    with torch.no_grad():
        want = torch_baichuan2(sd, json.loads((directory / "config.json").read_text()),
                               torch.tensor(ids)).numpy()
    with jax.default_matmul_precision("highest"):  # (XLA on a GPU: TF32 otherwise)
        got = np.asarray(dense_forward(loaded.params, loaded.config, jnp.asarray(ids)))
    diff = float(np.abs(got - want).max())
    print(f"{kind}: max abs logit diff {diff:.2e} (max |logit| {np.abs(want).max():.1f})")
    assert diff < 1e-4


def test_published_configs_give_the_presets():
    for name in ("baichuan2-7b", "baichuan2-13b"):
        cfg = PRESETS[name]
        assert from_hf_config(_hf_config(cfg)) == cfg
    assert PRESETS["baichuan2-13b"].alibi and not PRESETS["baichuan2-7b"].alibi
    assert PRESETS["baichuan2-13b"].intermediate_size == 13696


def test_slopes_follow_baichuan2_for_every_head_count_and_match_the_kernels():
    for n in range(1, 65):
        np.testing.assert_allclose(alibi_slopes(n), _interleave(n), rtol=1e-6)
    s40 = alibi_slopes(40)  # the 13B: 32 slopes of 32 heads, then odd ones of 64 heads
    np.testing.assert_allclose(s40[:2], [2 ** -0.25, 2 ** -0.5], rtol=1e-6)
    np.testing.assert_allclose(s40[32:34], [2 ** -0.125, 2 ** -0.375], rtol=1e-6)


def test_bad_configs_raise_value_error():
    base = _hf_config(PRESETS["tiny-baichuan2-alibi"])
    with pytest.raises(ValueError, match="'baichuan3'"):
        from_hf_config({**base, "model_type": "baichuan3", "architectures": []})
    with pytest.raises(ValueError, match="'BaiChuanForCausalLM'"):
        from_hf_config({**base, "architectures": ["BaiChuanForCausalLM"]})
    with pytest.raises(ValueError, match="'sinusoidal'"):
        ModelConfig("baichuan", 256, 64, 128, 2, 4, 4, 16, position_embedding="sinusoidal")
    q = jnp.zeros((1, 3, 6, 8))
    pos = jnp.arange(3)
    with pytest.raises(ValueError, match=r"\(4,\).*\(6,\)"):
        causal_attention(q, q, q, pos, pos, alibi_slopes=np.ones(4, np.float32))


def test_alibi_forward_rotates_nothing_and_rejects_the_fused_rope_seam():
    cfg = PRESETS["tiny-baichuan2-alibi"]
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = jnp.arange(5)

    def attn(q, k, v, cache, layer):  # the output carries Q and K as they arrive
        return q + k, cache

    hidden, _ = forward(params, cfg, tokens, tokens, None, attn)
    shifted, _ = forward(params, cfg, tokens, tokens + 100, None, attn)
    np.testing.assert_array_equal(hidden, shifted)  # positions rotate neither Q nor K
    rope_cfg = PRESETS["tiny-baichuan2-rope"]
    rope_params = init_params(rope_cfg, jax.random.key(0), jnp.float32)
    moved = [forward(rope_params, rope_cfg, tokens, p, None, attn)[0] for p in (tokens, tokens + 1)]
    assert not np.allclose(*moved)
    with pytest.raises(ValueError, match="ALiBi"):
        forward(params, cfg, tokens, tokens, None, attn, qkv_attn_fn=lambda *a: a)


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _dense(model, prompt, n):
    return dense_generate(model.params, model.config, prompt, n, eos_token_ids=())


@pytest.mark.parametrize("kind", ["alibi", "rope"])
@pytest.mark.parametrize("mode", ["explicit", "auto", "off"])
def test_greedy_matches_dense_with_cache_on_and_off(models, kind, mode):
    model = models[kind]
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 1000, 37).tolist()
    prompts = [shared + rng.integers(3, 1000, n).tolist() for n in (1, 6, 13)]
    llm = LLM(model, block_size=BS, enable_prefix_caching=mode != "off", num_kv_blocks=96)
    want = [_dense(model, p, 6) for p in prompts]
    for _ in range(2):  # the second round's prefill starts from the cached prefix
        outs = llm.generate(prompts, _greedy(6), prefix_pos=37 if mode == "explicit" else None,
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= (0 if mode == "off" else 32) for o in outs)


@pytest.mark.parametrize("cascade", [False, True])
def test_alibi_multi_level_prefixes_and_cascade_match_dense(models, cascade):
    """Two levels (a 24-token system prompt, then two 16-token department prompts), a
    first wave filling the cache, and decode steps whose groups attend their shared
    prefix once (cascade): the bias is taken at the keys' absolute positions."""
    model = models["alibi"]
    rng = np.random.default_rng(2)
    policy = rng.integers(3, 1000, 24).tolist()
    depts = [policy + rng.integers(3, 1000, 16).tolist() for _ in range(2)]
    prompts = [d + rng.integers(3, 1000, n).tolist() for d in depts for n in (2, 7)]
    prompts.append(policy + rng.integers(3, 1000, 5).tolist())
    prefix_pos = [40, 40, 40, 40, 24]
    llm = LLM(model, block_size=BS, num_kv_blocks=96, enable_cascade=cascade,
              cascade_min_group=2, cascade_min_blocks=1, unroll_layers=True)
    llm.generate(prompts[:1], _greedy(2), prefix_pos=40, use_tqdm=False)
    outs = llm.generate(prompts, _greedy(5), prefix_pos=prefix_pos, use_tqdm=False)
    assert [o.token_ids for o in outs] == [_dense(model, p, 5) for p in prompts]
    assert outs[1].num_cached_tokens >= 40 and outs[4].num_cached_tokens >= 24
    assert any(s[4] for s in llm.engine.runner.shapes_seen) == cascade


def test_alibi_chunked_prefill_matches_dense(models):
    model = models["alibi"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 30, 21)]
    llm = LLM(model, block_size=BS, num_kv_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, _greedy(4), use_tqdm=False)
    assert [o.token_ids for o in outs] == [_dense(model, p, 4) for p in prompts]


def test_bad_w_pack_and_missing_tensors_raise_naming_them(tmp_path):
    cfg = PRESETS["tiny-baichuan2-rope"]
    sd = _write_checkpoint(cfg, tmp_path, seed=5)
    name = "model.layers.1.self_attn.W_pack.weight"
    sd[name] = sd[name][:-1]
    safetensors.torch.save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"W_pack.*\(191, 64\).*\(192, 64\)"):
        jprefix.load(tmp_path, dtype="float32")
    del sd[name]
    safetensors.torch.save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor " + name):
        jprefix.load(tmp_path, dtype="float32")


def test_bfloat16_load_keeps_the_norm_head_rows_unit(checkpoints):
    loaded = jprefix.load(checkpoints["alibi"][0], dtype="bfloat16")
    head = np.asarray(loaded.params.lm_head, np.float32)
    assert loaded.params.lm_head.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.linalg.norm(head, axis=0), 1.0, atol=1e-2)


def test_alibi_pallas_kernels_match_xla_and_dense(models):
    """The Pallas kernels (interpreted on the CPU) with ALiBi slopes: prefill over a cached
    prefix, decode, mixed steps (a small token budget) and cascade decode steps, on fused
    Q/K/V without rope_write_kv; greedy tokens equal the XLA backend's and the dense
    model's."""
    model = models["alibi"]
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 1000, 16).tolist()
    prompts = [shared + rng.integers(3, 1000, n).tolist() for n in (3, 11, 22)]
    want = [_dense(model, p, 3) for p in prompts]
    for backend in ("xla", "pallas-interpret"):
        llm = LLM(model, block_size=BS, num_kv_blocks=64, attention_backend=backend,
                  max_num_batched_tokens=24, cascade_min_group=2, cascade_min_blocks=1,
                  unroll_layers=True)
        assert llm.engine.runner.params.layout == "fused"
        llm.generate(prompts[:1], _greedy(1), prefix_pos=16, use_tqdm=False)
        outs = llm.generate(prompts, _greedy(3), prefix_pos=16, use_tqdm=False)
        assert [o.token_ids for o in outs] == want, backend
        kinds = llm.engine.runner.shapes_seen
        assert any(s[4] for s in kinds) and sum(m for *_, m in kinds) >= 1  # cascade, mixed


def test_a_pytorch_bin_checkpoint_is_refused_naming_its_files(tmp_path):
    """The Baichuan2 repositories ship pytorch_model.bin, which is not read: the error
    names the files and says what to do."""
    cfg = PRESETS["tiny-baichuan2-alibi"]
    sd = _write_checkpoint(cfg, tmp_path, seed=6)
    (tmp_path / "model.safetensors").unlink()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*convert them to safetensors"):
        jprefix.load(tmp_path, dtype="float32")
