"""The engine's jitted step (device side): the model over one packed batch.

`step(params, kv_cache, flat, prev_tokens, ...)` runs the model over the step's flat
tokens: per layer it writes the new K/V into the paged cache at `slot_mapping`, then runs
paged attention for every sequence (write-then-attend, so blocks written this step by one
sequence can be read by another in the same step). The cache is donated and updated in
place. The layers' matmuls are XLA's, or `skinny_matmul` on few-row steps (`step_linear`),
a mixture of experts' the Pallas grouped GEMM with the Pallas backends (`step_experts`);
the CPU's per-layer buffers run under one scan (`worker.layer_switch`).
With the Pallas backends and fused projections, one `rope_write_kv` kernel per layer
rotates Q and K and writes the new K/V (`_qkv_attention`); ALiBi models (no RoPE) take
`write_kv` and attention with the slopes of `models.alibi.model_slopes(cfg)`, a constant
of the static config (sharded by query heads under tensor parallelism). Under tensor
parallelism these kernels, attention and the column-parallel matmuls run per device
under shard_map (`jprefix.worker.parallel`); the row-parallel matmuls and their
all-reduces stay XLA's. The cache is a tuple (`worker.kv_cache`): (k, v), or for an fp8
cache (k, v, k_scale, v_scale), whose scales every write and attention op takes
(`scale_kwargs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jprefix.core.sampling_params import MAX_LOGPROBS
from jprefix.worker import kv_bits, xla_flags
from jprefix.worker.flat_batch import Layout, unflatten_batch
from jprefix.worker.hybrid_kv import group_view, step_groups
from jprefix.worker.kv_cache import KVCache, scale_kwargs
from jprefix.worker.layer_switch import layer_loop
from jprefix.worker.logits_processing import process_logits, token_logprobs
from jprefix.worker.parallel import (
    REPLICATED,
    per_shard,
    per_shard_qkv,
)
from jprefix.worker.sampler import sample
from jprefix.worker.spec_verify import verify
from jprefix.worker.step_linear import col_linear, step_experts, step_linear
from jprefix.worker.structured import apply_token_bitmask
from models.alibi import model_slopes
from models.config import ModelConfig
from models.llama import (
    QKVAttnFn,
    compute_logits,
    forward,
)
from models.window import layer_window
from pallas_kernels import backend as kernel_backend
from pallas_kernels.cascade_attention import cascade_attention
from pallas_kernels.kv_cache import write_kv
from pallas_kernels.one_sequence_attention import one_sequence_attention
from pallas_kernels.paged_attention import (
    mixed_paged_attention,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.rope_kv_write import rope_write_kv
from pallas_kernels.tiled_attention import tiled_attention

BACKENDS = ("pallas", "xla", "pallas-interpret")


def default_backend() -> str:
    """Pallas on GPU; the XLA path (tested equal) elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def _attention(backend: str, decode: bool, cascade: bool, q, cache, layer, batch,
               scale, alibi_slopes=None, window=None):
    """Paged attention of the step's rows against `cache` (`KVCache`) in the layer's window."""
    k_cache, v_cache = cache[:2]
    kw = dict(alibi_slopes=alibi_slopes, sliding_window=window, **scale_kwargs(cache))
    if cascade:
        return cascade_attention(
            q, k_cache, v_cache, layer, batch["prefix_block_tables"], batch["prefix_kv_lens"],
            batch["prefix_cu_q_lens"], batch["suffix_block_tables"], batch["suffix_kv_lens"],
            batch["cu_q_lens"], scale=scale, interpret=backend == "pallas-interpret",
            use_reference=backend == "xla", max_q_len=1, **kw,
        )
    args = (q, k_cache, v_cache, layer, batch["block_tables"], batch["kv_lens"], batch["cu_q_lens"])
    if backend == "xla":  # one stream's rows, or a tile's, gather their pages once
        one = batch["block_tables"].shape[0] == 1
        return (one_sequence_attention if one else paged_attention_reference if decode
                else tiled_attention)(*args, scale=scale, **kw)
    interpret = backend == "pallas-interpret"
    num_decode = batch["num_decode"][0] if "num_decode" in batch else None
    if backend == "pallas" and not decode and (out := kernel_backend.prefill_attention_mosaic(
            *args, scale=scale, num_decode=num_decode, **kw)) is not None:
        return out  # the Mosaic GPU kernel, where the backend table chooses it
    if "num_decode" in batch:  # a mixed step, its one-token rows first (`StepPacker`)
        return mixed_paged_attention(*args, batch["num_decode"][0], scale=scale,
                                     interpret=interpret, **kw)
    return paged_attention(*args, scale=scale, interpret=interpret,
                           max_q_len=1 if decode else None, **kw)


def _qkv_attention(backend: str, decode: bool, cascade: bool, mesh: Mesh | None,
                   cfg: ModelConfig, batch: dict[str, jax.Array], scale: float
                   ) -> QKVAttnFn | None:
    """Attention from the fused Q/K/V projection with a Pallas backend: one `rope_write_kv`
    kernel rotates Q and K and writes the new K/V, where XLA runs three fusions per layer
    (per device on its heads under a mesh). None for XLA, and for ALiBi models (nothing
    to rotate): the model's RoPE (if any), then `write_kv` and attention."""
    if backend == "xla" or cfg.alibi:
        return None
    tp = 1 if mesh is None else mesh.size

    def local(qkv, positions, inv_freq, cache, layer, batch):
        window = layer_window(cfg.layer_windows, layer)
        page, batch = group_view(step_groups(cfg.layer_windows, batch), layer, batch)
        q, *cache = rope_write_kv(
            qkv, positions, batch["slot_mapping"], *cache[:2], page, inv_freq,
            num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
            interpret=backend == "pallas-interpret", **scale_kwargs(cache))
        return _attention(backend, decode, cascade, q, tuple(cache), page, batch, scale,
                          window=window), tuple(cache)

    run = per_shard_qkv(local, mesh)

    def qkv_attn_fn(qkv, positions, inv_freq, cache, layer):
        return run(qkv, positions, inv_freq, tuple(cache), layer, batch)

    return qkv_attn_fn


_STATIC = ("layout", "cfg", "backend", "decode", "cascade", "mesh", "extra", "kv_format")
_STEP_STATIC = (*_STATIC, "greedy")


def _jit_step(fn: Callable, static: tuple[str, ...], fp8_weights: bool = False,
              extra_options: dict[str, Any] | None = None) -> Callable:
    """`fn` jitted as an engine step: `static` arguments, the KV cache donated, and the
    step's XLA options (`xla_flags.step_compiler_options`, updated with `extra_options`:
    the tests re-jit the steps at another XLA level this way)."""
    options = xla_flags.step_compiler_options(fp8_weights=fp8_weights) | (extra_options or {})
    return jax.jit(fn, static_argnames=static, donate_argnames=("kv_cache",),
                   compiler_options=options)


@functools.partial(_jit_step, static=_STEP_STATIC)
def step(params, kv_cache: KVCache, flat: jax.Array, prev_tokens: jax.Array,
         token_bitmask: jax.Array | None = None, *,
         layout: Layout, cfg: ModelConfig, backend: str, decode: bool = False,
         greedy: bool = False, cascade: bool = False, mesh: Mesh | None = None,
         extra: bool = False, kv_format: str | None = None):
    """One engine step: returns (sampled token ids [P], updated kv_cache), P =
    `prev_tokens.size` (rows beyond the batch are padding); with `extra`, a third item,
    the logprobs (`_extra_sampling`).

    The batch arrives as one flat int32 buffer (`flatten_batch`). Tokens still pending on
    the host read their id from `prev_tokens`, the previous step's output (async
    scheduling: this step was dispatched before that one's ids reached the host).
    `decode` (every sequence has exactly one new token) picks the decode-tiled kernel;
    `greedy` (every temperature is 0) skips the sampling machinery. `cascade` (the batch
    carries a cascade plan's arrays) attends each group's shared prefix once. With a
    tensor-parallel `mesh`, the KV write and attention run per device on its heads.
    `token_bitmask` ([S, ceil(V / 32)] int32, S the batch's rows; `worker.structured`)
    masks the logits of grammar-constrained rows before sampling; None (a step without
    structured rows) traces no mask. It applies first, so the logprobs and every
    processing stage see the grammar's -inf.
    `extra` (some row has penalties, min_p, a logit bias or wants logprobs: the batch
    carries `logits_processing`'s arrays) processes the logits before sampling.
    `kv_format`: the cache's format if stored as integer bits (`worker.kv_bits`).

    `step_logits` then `step_sample` compute the same in two programs, for a step whose
    bitmask is filled on the host while the first runs.
    """
    batch, token_ids, logits, prompt_logits, kv_cache, verify_logits = _model(
        params, kv_cache, flat, prev_tokens, layout, cfg, backend, decode, cascade, mesh, extra,
        kv_format)
    tokens, logprobs = _sample(logits, prompt_logits, batch, token_ids, prev_tokens,
                               token_bitmask, greedy, extra, mesh, verify_logits)
    return (tokens, kv_cache) if logprobs is None else (tokens, kv_cache, logprobs)


@functools.partial(_jit_step, static=_STATIC)
def step_logits(params, kv_cache: KVCache, flat: jax.Array, prev_tokens: jax.Array, *,
                layout: Layout, cfg: ModelConfig, backend: str, decode: bool = False,
                cascade: bool = False, mesh: Mesh | None = None, extra: bool = False,
                kv_format: str | None = None):
    """`step` up to the logits: returns (logits [S, V] float32, the prompt-logprobs
    entries' logits (`extra`; else None), the step's token ids [T], kv_cache), which
    `step_sample` takes."""
    _, token_ids, logits, prompt_logits, kv_cache, _ = _model(
        params, kv_cache, flat, prev_tokens, layout, cfg, backend, decode, cascade, mesh, extra,
        kv_format)
    return logits, prompt_logits, token_ids, kv_cache


@functools.partial(jax.jit, static_argnames=("layout", "greedy", "extra", "mesh"))
def step_sample(logits: jax.Array, prompt_logits: jax.Array | None, token_ids: jax.Array,
                flat: jax.Array, prev_tokens: jax.Array, token_bitmask: jax.Array | None,
                *, layout: Layout, greedy: bool, extra: bool, mesh: Mesh | None = None):
    """The rest of `step` after `step_logits`: the bitmask, logits processing and
    sampling of the same batch (`flat`). Returns the tokens [P], and with `extra` a
    tuple (tokens, logprobs)."""
    tokens, logprobs = _sample(logits, prompt_logits, unflatten_batch(flat, layout),
                               token_ids, prev_tokens, token_bitmask, greedy, extra, mesh)
    return tokens if logprobs is None else (tokens, logprobs)


@functools.cache
def compiled_steps(fp8_weights: bool) -> tuple[Callable, Callable]:
    """(`step`, `step_logits`) as jitted for params with fp8 linear weights or without:
    the same functions under `xla_flags.step_compiler_options(fp8_weights=...)`."""
    if not fp8_weights:
        return step, step_logits
    return (_jit_step(step.__wrapped__, _STEP_STATIC, fp8_weights=True),
            _jit_step(step_logits.__wrapped__, _STATIC, fp8_weights=True))


def _model(params, kv_cache, flat, prev_tokens, layout, cfg, backend, decode, cascade, mesh,
           extra, kv_format=None):
    """The model over the step's batch: (batch, token ids [T], logits [S, V], prompt
    logits [E, V] (`extra`; else None), kv_cache, a verify step's logits [S * (K+1), V]
    at `spec_idx` (else None: `worker.spec_verify`))."""
    batch = unflatten_batch(flat, layout)
    scale = cfg.attn_scale
    src = batch["token_src"]
    token_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], batch["token_ids"])

    slopes = model_slopes(cfg)
    slopes = None if slopes is None else jnp.asarray(slopes)

    def write_and_attend(q, k, v, cache, alibi_slopes, layer, batch):
        window = layer_window(cfg.layer_windows, layer)
        page, batch = group_view(step_groups(cfg.layer_windows, batch), layer, batch)
        if kv_format is not None:  # a cache stored as integer bits (`worker.kv_bits`)
            return kv_bits.write_and_attend(functools.partial(
                _attention, backend, decode, cascade, scale=scale, alibi_slopes=alibi_slopes,
                window=window), q, k, v, cache, page, batch, cascade, kv_format)
        cache = write_kv(*cache[:2], page, k, v, batch["slot_mapping"], **scale_kwargs(cache))
        return _attention(backend, decode, cascade, q, cache, page, batch, scale,
                          alibi_slopes, window), cache

    local = per_shard(write_and_attend, mesh)

    def attn_fn(q, k, v, cache, layer):
        return local(q, k, v, tuple(cache), slopes, layer, batch)

    layers, linear = layer_loop(params, step_linear(backend, mesh), backend, mesh)
    hidden, kv_cache = forward(layers, cfg, token_ids, batch["positions"], kv_cache, attn_fn,
                               linear,
                               _qkv_attention(backend, decode, cascade, mesh, cfg, batch, scale),
                               col_linear(backend, mesh), step_experts(backend, mesh))
    prompt_logits = compute_logits(params, cfg, hidden[batch["plp_idx"]]) if extra else None
    if "spec_idx" not in batch:
        logits = compute_logits(params, cfg, hidden[batch["logits_idx"]])
        return batch, token_ids, logits, prompt_logits, kv_cache, None
    # a verify step: each row's last position (`logits_idx`) is among its spec_idx, at
    # num_draft: one logits computation serves both
    verify_logits = compute_logits(params, cfg, hidden[batch["spec_idx"].reshape(-1)])
    S, K1 = batch["spec_idx"].shape
    logits = verify_logits.reshape(S, K1, -1)[jnp.arange(S), batch["num_draft"]]
    return batch, token_ids, logits, prompt_logits, kv_cache, verify_logits


def _sample(logits, prompt_logits, batch, token_ids, prev_tokens, token_bitmask, greedy: bool,
            extra: bool, mesh: Mesh | None, verify_logits=None):
    """The step's tokens [P] from its logits (bitmask first, then processing and
    sampling), and the logprobs (`extra`; else None). A verify step's tokens are
    followed by its verified tokens [S * (K+1)] and accepted counts [S] (`spec_verify`)."""
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    logprobs = None
    if extra:
        tokens, logprobs = _extra_sampling(logits, prompt_logits, batch, token_ids, greedy)
    elif greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        tokens = sample(logits, batch["temperature"], batch["top_k"], batch["top_p"],
                        batch["seeds"], batch["counters"])
    verified = None
    if verify_logits is not None:  # (with `extra`, its tokens' logprobs join the rows')
        verified, spec_logprobs = verify(verify_logits, batch, token_ids, greedy, extra)
        logprobs = logprobs if spec_logprobs is None else (*logprobs, spec_logprobs)
    return _all_rows(tokens, prev_tokens, mesh, verified), logprobs


def _all_rows(tokens, prev_tokens, mesh: Mesh | None, verified=None):
    """The step's tokens padded to `prev_tokens`' rows (then a verify step's `verified`);
    under a mesh whole on every device (any process reads them from its own)."""
    tokens = jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens)
    if verified is not None:
        tokens = jnp.concatenate([tokens, verified])
    if mesh is not None:
        tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, REPLICATED))
    return tokens


def _extra_sampling(logits, prompt_logits, batch, token_ids, greedy: bool):
    """Samples from the processed logits (`process_logits`, then min-p among the sampling
    steps); returns the tokens [S] and the logprobs of the raw distribution: per row
    (sampled token's logprob [S], rank [S], top-k ids [S, k], top-k logprobs [S, k]) and
    the same per prompt position of `plp_idx` (`prompt_logits`) for its `plp_target`
    token, k = min(MAX_LOGPROBS, V)."""
    processed = process_logits(logits, batch, token_ids)
    if greedy:
        tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    else:
        tokens = sample(processed, batch["temperature"], batch["top_k"], batch["top_p"],
                        batch["seeds"], batch["counters"], batch["min_p"])
    k = min(MAX_LOGPROBS, logits.shape[-1])
    return tokens, (token_logprobs(logits, tokens, k),
                    token_logprobs(prompt_logits, batch["plp_target"], k))
