"""Paged attention over a ragged batch: decode, prefill, prefix-cached and chunked prefill.

Sequence s owns query rows `cu_q_lens[s]:cu_q_lens[s+1]` (q_len = their difference);
query row i of s sits at position `kv_lens[s] - q_len + i` and attends to the cache
positions `<=` it, found through `block_tables[s]`. Padding sequences have q_len 0 and
kv_len 0; rows at or beyond `cu_q_lens[S]` are padding and come out as zeros.

With `causal=False` every query row of s attends to all `kv_lens[s]` keys (no position
mask; cascade attention's shared-prefix part). With `return_lse=True` both functions also
return each row's log-sum-exp of its logits over the keys it attends (natural log,
float32 [T, H]; -inf for rows that attend to no key), so that partial attentions over
disjoint key sets can be merged (`cascade_attention.merge_attention`).

Cache layout: `k_cache, v_cache: [L, K, N, B, D]`; the layer is an input so the engine
passes the whole multi-layer buffer (slicing a layer out would copy it every step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import check_caches
from pallas_kernels.paged_attention_kernel import KernelConfig, run_kernel, tile_metadata

_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_INT32 = jnp.dtype(jnp.int32)
_TARGET_PROGRAMS = 1024  # decode: split the key range until about this many programs
# prefill tiling: a batch of few tiles (one short prompt: time to first token) splits its
# key range until about this many programs, at most _MAX_PREFILL_SPLITS ways
_PREFILL_TARGET_PROGRAMS = 256
_MAX_PREFILL_SPLITS = 4


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def prefill_kv_splits(num_tokens: int, num_heads: int, num_kv_heads: int, block_q: int,
                      target_programs: int, max_splits: int) -> int:
    """Key-range splits for the prefill tiling: the most (a power of 2, at most
    `max_splits`) that keep ~ceil(T / tile tokens) tiles x KV heads x splits within
    `target_programs` (ragged tile edges aside). Few tiles and many keys (one short prompt,
    a cascade's shared prefix) want splits; more splits cost more partials to combine."""
    tile_tokens = max(1, block_q // _next_pow2(num_heads // num_kv_heads))
    programs = -(-num_tokens // tile_tokens) * num_kv_heads
    splits = 1
    while splits < max_splits and programs * splits * 2 <= target_programs:
        splits *= 2
    return splits


def _check_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens):
    """Raises ValueError naming the argument whose shape or dtype breaks the contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    check_caches(k_cache, v_cache, layer)
    t, h, d = q.shape
    _, k, _, b, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of k_cache ({dk})")
    if h % k:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k})")
    if not (_is_pow2(d) and _is_pow2(b)):
        raise ValueError(f"head_dim ({d}) and block_size ({b}) must be powers of 2")
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype), jnp.dtype(v_cache.dtype)}
    if len(dtypes) != 1 or jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        raise ValueError(
            f"q, k_cache, v_cache must share one of bf16/f16/f32, got {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}")
    if block_tables.ndim != 2 or jnp.dtype(block_tables.dtype) != _INT32:
        raise ValueError(f"block_tables must be int32 [S, M], got {block_tables.dtype}"
                         f"{list(block_tables.shape)}")
    s = block_tables.shape[0]
    if kv_lens.shape != (s,) or jnp.dtype(kv_lens.dtype) != _INT32:
        raise ValueError(f"kv_lens must be int32 [{s}], got {kv_lens.dtype}{list(kv_lens.shape)}")
    if cu_q_lens.shape != (s + 1,) or jnp.dtype(cu_q_lens.dtype) != _INT32:
        raise ValueError(f"cu_q_lens must be int32 [{s + 1}], got "
                         f"{cu_q_lens.dtype}{list(cu_q_lens.shape)}")
    if t == 0 or s == 0:
        raise ValueError(f"need at least one token and one sequence, got T={t}, S={s}")


def _config(q, k_cache, *, scale, soft_cap, max_q_len, block_q, block_kv,
            kv_splits, interpret, prefetch_pages, causal, return_lse, single_loop,
            evict_first, mask_q, mask_kv, heads_per_tile) -> KernelConfig:
    t, h, d = q.shape
    _, k, n, b, _ = k_cache.shape
    g = h // k
    gp = _next_pow2(g)
    decode = max_q_len == 1
    tile_tokens = 1 if decode else max(1, block_q // gp)
    block_kv = max(block_kv, b)
    if not (_is_pow2(block_q) and _is_pow2(block_kv)):
        raise ValueError(f"block_q ({block_q}) and block_kv ({block_kv}) must be powers of 2")
    if prefetch_pages is None:
        prefetch_pages = decode
    if mask_q is None:
        mask_q = decode
    hp = heads_per_tile
    if hp != 1 and not (decode and _is_pow2(hp) and k % hp == 0):
        raise ValueError(f"heads_per_tile ({hp}) must be a power of 2 dividing the kv heads "
                         f"({k}), with the decode tiling (max_q_len=1)")
    if kv_splits is None and decode:  # one tile per token
        kv_splits = min(8, _next_pow2(max(1, _TARGET_PROGRAMS // (t * k))))
    elif kv_splits is None:
        kv_splits = prefill_kv_splits(t, h, k, block_q, _PREFILL_TARGET_PROGRAMS,
                                      _MAX_PREFILL_SPLITS)
    return KernelConfig(
        num_heads=h, num_kv_heads=k, num_blocks=n, block_size=b, head_dim=d, group=g,
        group_padded=gp, tile_tokens=tile_tokens, tile_rows=max(16, tile_tokens * gp * hp),
        pages_per_step=block_kv // b, kv_splits=kv_splits, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap), num_rows=t * h,
        dump_rows=interpret, prefetch_pages=prefetch_pages, causal=causal,
        return_lse=return_lse, single_loop=single_loop,
        evict_first=evict_first, mask_q=mask_q, mask_kv=mask_kv, heads_per_tile=hp,
    )


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "interpret", "max_q_len", "block_q", "block_kv", "kv_splits",
    "num_warps", "num_stages", "prefetch_pages", "causal", "return_lse", "single_loop",
    "evict_first", "mask_q", "mask_kv", "heads_per_tile"))
def paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    interpret: bool = False,
    max_q_len: int | None = None,
    block_q: int = 128,
    block_kv: int = 64,
    kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch_pages: bool | None = None,
    causal: bool = True,
    return_lse: bool = False,
    single_loop: bool = False,
    evict_first: bool = False,
    mask_q: bool | None = None,
    mask_kv: bool = True,
    heads_per_tile: int = 1,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a ragged batch against the paged KV cache. Returns [T, H, D].

    `causal=False` drops the position mask (rows see all `kv_lens[s]` keys);
    `return_lse=True` returns `(out [T, H, D], lse [T, H] float32)` (module docstring).

    `max_q_len` is a static hint: 1 picks the decode tiling (one token per tile, the
    key range split over `kv_splits` programs, None = enough splits for ~1024 programs);
    any other value (or None) the prefill tiling (`block_q` rows = tokens x padded query
    group per tile; `kv_splits` None = 1, or up to 4 when T is so small that the batch has
    fewer than ~128 programs, as for one short prompt). Both compute the same function
    for any input. `block_kv` (keys per inner step), `num_warps` (None: 8 for a causal
    prefill tiling split over the key range, whose few programs are latency-bound; 4
    otherwise), `num_stages` (None: 3 decode, 4 prefill, 2 float32), `prefetch_pages`
    (load the next step's page ids a step early; None = on for the decode tiling, off for
    prefill), `single_loop` (one masked key loop instead of unmasked steps then the
    masked edge), `evict_first` (cache hint on the K/V loads), `mask_q` (skip loading a
    tile's padding query rows; None = on for the decode tiling), `mask_kv` (edge steps
    skip loading keys past kv_len) and `heads_per_tile` (decode tiling: KV heads per tile,
    each row masked to its own head's keys; 1 = off, not yet measured on a GPU) tune the
    Triton lowering; the defaults are the best measured on an H200 (docs/PERF.md).
    """
    _check_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens)
    cfg = _config(q, k_cache, scale=scale, soft_cap=soft_cap,
                  max_q_len=max_q_len, block_q=block_q, block_kv=block_kv,
                  kv_splits=kv_splits, interpret=interpret, prefetch_pages=prefetch_pages,
                  causal=causal, return_lse=return_lse, single_loop=single_loop,
                  evict_first=evict_first, mask_q=mask_q, mask_kv=mask_kv,
                  heads_per_tile=heads_per_tile)
    if num_stages is None:
        num_stages = 2 if q.dtype == jnp.float32 else 3 if max_q_len == 1 else 4
    if num_warps is None:  # one short prompt's prefill (time to first token): its 128-row
        # tile x 4 splits ran 14.0 us with 4 warps, 9.6 with 8 (H200, docs/PERF.md)
        num_warps = 8 if max_q_len != 1 and causal and cfg.kv_splits > 1 else 4
    num_layers, k, n, b, d = k_cache.shape
    t, h, _ = q.shape
    pad = -block_tables.shape[1] % cfg.pages_per_step
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))  # pad -> null block 0
    meta = tile_metadata(cu_q_lens, kv_lens, t, cfg.tile_tokens)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    rows = (num_layers * k * n * b, d)  # one row per cached token and head
    out = run_kernel(q.reshape(t * h, d), k_cache.reshape(rows), v_cache.reshape(rows),
                     layer, block_tables, meta, cfg,
                     num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if return_lse:
        return out[0].reshape(t, h, d), out[1].reshape(t, h)
    return out.reshape(t, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "interpret"))
def mixed_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_decode: jax.Array,  # int32 scalar
    *,
    scale: float,
    soft_cap: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`paged_attention` of a batch whose first `num_decode` sequences have one query
    row each (rows `0:num_decode`), as a step mixing decodes with prefill chunks does:
    those rows run with the decode tiling, the other sequences with the prefill tiling.
    With one tiling for all, each decode row would take a prefill tile of its own per
    KV head (block_q rows for one real row) that still steps through all its keys.
    Returns [T, H, D]; the same function as `paged_attention` on the same inputs."""
    t = q.shape[0]
    num_seqs = kv_lens.shape[0]
    decoding = jnp.arange(num_seqs) < num_decode
    rows = min(t, num_seqs)  # the decode rows come first: 0:num_decode within 0:S
    out_decode = paged_attention(  # later sequences: no rows, no keys
        q[:rows], k_cache, v_cache, layer, block_tables, jnp.where(decoding, kv_lens, 0),
        jnp.minimum(cu_q_lens, num_decode), scale=scale, soft_cap=soft_cap,
        interpret=interpret, max_q_len=1)
    out = paged_attention(  # the decode sequences: no rows (0:num_decode is left alone)
        q, k_cache, v_cache, layer, block_tables, jnp.where(decoding, 0, kv_lens),
        jnp.maximum(cu_q_lens, num_decode), scale=scale, soft_cap=soft_cap,
        interpret=interpret)
    decode_rows = (jnp.arange(rows) < num_decode)[:, None, None]
    return out.at[:rows].set(jnp.where(decode_rows, out_decode, out[:rows]))


def token_positions(cu_q_lens, kv_lens, num_tokens: int):
    """Per flat token: its sequence, its position, and whether it is a real query row."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = kv_lens.shape[0]
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


def _reference_chunk(q, limit, valid, tables, k_cache, v_cache, layer, scale, soft_cap,
                     return_lse):
    """Attention for C tokens, each against keys [0, limit) of its sequence's pages."""
    c, h, d = q.shape
    _, k, _, b, _ = k_cache.shape
    m = tables.shape[1]
    idx = (layer, jnp.arange(k)[None, None, :], tables[:, :, None])
    keys = k_cache[idx].transpose(0, 2, 1, 3, 4).reshape(c, k, m * b, d)  # [C, K, M*B, D]
    vals = v_cache[idx].transpose(0, 2, 1, 3, 4).reshape(c, k, m * b, d)
    qg = q.reshape(c, k, h // k, d)
    s = jnp.einsum("ckgd,ckjd->ckgj", qg, keys, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    visible = (jnp.arange(m * b)[None, :] < limit[:, None]) & valid[:, None]  # [C, M*B]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("ckgj,ckjd->ckgd", p, vals.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    out = out.reshape(c, h, d).astype(q.dtype)
    if not return_lse:
        return out
    return out, (s_max + jnp.log(denom)).reshape(c, h)  # log(0) = -inf: no visible key


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "token_chunk", "causal", "return_lse"))
def paged_attention_reference(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    token_chunk: int | None = None,
    causal: bool = True,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain-jnp paged attention with `paged_attention`'s semantics (also the CPU path).

    Each token gathers its sequence's pages straight from the multi-layer cache (no
    layer copy) and runs a masked float32 softmax. Tokens go `token_chunk` at a time
    (default: about 16M gathered elements per chunk) so memory stays bounded.
    `causal` and `return_lse` as in `paged_attention`.
    """
    _check_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens)
    t, h, d = q.shape
    _, k, _, b, _ = k_cache.shape
    m = block_tables.shape[1]
    seq, pos, valid = token_positions(cu_q_lens, kv_lens, t)
    limit = pos + 1 if causal else kv_lens[seq]  # keys [0, limit) are visible
    if token_chunk is None:
        token_chunk = max(1, (1 << 24) // (m * b * k * d))
    c = min(t, token_chunk)
    chunk = functools.partial(_reference_chunk, k_cache=k_cache, v_cache=v_cache,
                              layer=layer, scale=scale, soft_cap=soft_cap,
                              return_lse=return_lse)
    tables = block_tables[seq]
    if c == t:
        return chunk(q, limit, valid, tables)
    pad = -t % c
    xs = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, limit, valid, tables)]
    xs = [x.reshape(-1, c, *x.shape[1:]) for x in xs]
    out = jax.lax.map(lambda a: chunk(*a), xs)
    if return_lse:
        return out[0].reshape(-1, h, d)[:t], out[1].reshape(-1, h)[:t]
    return out.reshape(-1, h, d)[:t]
