"""The Pallas (Triton backend) kernel behind `paged_attention.paged_attention`.

One program handles one tile of query rows against one KV head (and, optionally, one
slice of the key range). A tile's rows are `tokens x padded query group`: the G query
heads that share a KV head sit in the same tile, so each gathered K/V page is loaded
once for all of them. Decode uses one token per tile (rows = the query group padded to
16, the smallest `dot`); prefill uses several tokens per tile. Tiles never straddle two
sequences, so block tables and lengths are read as scalars per tile from a small
metadata array computed by `tile_metadata` (no scalar prefetch on Triton).

Two static options add code only when set: `causal=False` (every row sees all `kv_len`
keys; cascade attention's shared-prefix part) and `return_lse` (also the log-sum-exp of
each row's logits, natural log, -inf for rows that see no key).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite start for the running max so that fully masked rows never compute inf - inf.
_M_INIT = -1e30
META_FIELDS = 5  # seq, first token, valid tokens, position of first token, kv_len


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static shape and tiling facts of one kernel instantiation."""

    num_heads: int  # H
    num_kv_heads: int  # K
    num_blocks: int  # N
    block_size: int  # B
    head_dim: int  # D
    group: int  # G = H // K
    group_padded: int  # next power of 2 >= G
    tile_tokens: int  # query tokens per tile
    tile_rows: int  # rows per tile = max(16, tile_tokens * group_padded)
    pages_per_step: int  # pages gathered per inner step (block_kv = pages * B)
    kv_splits: int  # programs splitting one tile's key range
    scale: float
    soft_cap: float | None
    num_rows: int  # T * H: rows of the flattened query / output
    dump_rows: bool  # masked rows store to private rows past num_rows (interpret mode)
    prefetch_pages: bool  # load the next step's page ids one step ahead
    causal: bool = True  # False: every row sees keys [0, kv_len) (no position mask)
    return_lse: bool = False  # also output the natural-log log-sum-exp per row
    single_loop: bool = False  # one masked key loop instead of full steps + masked edge
    evict_first: bool = False  # K/V loads hint evict_first (streamed once)
    mask_q: bool = False  # q rows outside the tile's valid rows are not loaded (zeros)
    mask_kv: bool = True  # edge steps skip loading keys at or past kv_len (zeros)
    # decode tiling only: KV heads per tile. With hp > 1 a tile's rows are hp query groups
    # of one token, a step gathers block_kv keys of each of the hp heads, and a
    # block-diagonal mask keeps each row to its own head's keys (more work per program
    # for short contexts, where a program's fixed latency dominates)
    heads_per_tile: int = 1

    @property
    def block_kv(self) -> int:
        return self.pages_per_step * self.block_size

    @property
    def keys_per_step(self) -> int:
        """Rows gathered per step: block_kv keys of each of the tile's KV heads."""
        return self.heads_per_tile * self.block_kv


def num_tiles(num_tokens: int, num_seqs: int, tile_tokens: int) -> int:
    """Static upper bound on the tiles of a ragged batch (+1 segment for padding rows)."""
    return (num_tokens + (num_seqs + 1) * (tile_tokens - 1)) // tile_tokens


def tile_metadata(cu_q_lens, kv_lens, num_tokens: int, tile_tokens: int):
    """Per-tile `[seq, first_token, valid_tokens, first_pos, kv_len]`, int32 [NT, 5].

    Rows `cu_q_lens[S]:num_tokens` form an extra segment with kv_len 0 so that padding
    rows are written (as zeros) like any other. Tiles past the last one are empty.
    """
    num_seqs = kv_lens.shape[0]
    q_lens = jnp.concatenate([cu_q_lens[1:] - cu_q_lens[:-1], num_tokens - cu_q_lens[-1:]])
    q_lens = jnp.maximum(q_lens, 0)
    kv = jnp.concatenate([kv_lens, jnp.zeros((1,), jnp.int32)])
    tiles = (q_lens + tile_tokens - 1) // tile_tokens
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles(num_tokens, num_seqs, tile_tokens), dtype=jnp.int32)
    # compare_all: one fused compare-and-count; the default binary search lowers to a
    # while loop of tiny kernels, launched one by one on the GPU
    seg = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    live = seg <= num_seqs
    seg = jnp.minimum(seg, num_seqs)
    offset = (t - (tile_end[seg] - tiles[seg])) * tile_tokens
    valid = jnp.where(live, jnp.clip(q_lens[seg] - offset, 0, tile_tokens), 0)
    meta = [
        jnp.minimum(seg, num_seqs - 1),
        cu_q_lens[seg] + offset,
        valid,
        kv[seg] - q_lens[seg] + offset,
        jnp.where(live, kv[seg], 0),
    ]
    return jnp.stack(meta, axis=1).astype(jnp.int32)


def _logits(q, k, cfg: KernelConfig):
    """Scaled (and soft-capped) logits in log2 units, float32 [R, block_kv]."""
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = plgpu.dot(q, k, trans_b=True, precision=precision)
    if cfg.soft_cap is None:
        return s * (cfg.scale * LOG2E)
    return jnp.tanh(s * (cfg.scale / cfg.soft_cap)) * (cfg.soft_cap * LOG2E)


def _step(j, carry, *, q, pos, row_head, kv_len, seq, page_base, bt_ref, k_ref, v_ref, cfg,
          masked):
    """One online-softmax step over `block_kv` keys gathered from `pages_per_step` pages.

    With `prefetch_pages` the carry holds this step's page ids, loaded one step ahead so
    that the K/V gather does not wait on the block-table load.
    """
    o, m, denom, pages = carry
    if cfg.prefetch_pages:
        nxt = _load_pages(bt_ref, seq, jnp.minimum(j + 1, bt_ref.shape[1] // cfg.pages_per_step
                                                   - 1), cfg)
    else:
        pages = nxt = _load_pages(bt_ref, seq, j, cfg)
    kk = jnp.arange(cfg.keys_per_step, dtype=jnp.int32)
    key_pos = j * cfg.block_kv + kk % cfg.block_kv
    # An edge step's keys past kv_len are padding: with mask_kv they are not fetched
    # (a short decode suffix of ~130 keys would otherwise read 192 rows).
    kv_ok = key_pos < kv_len if masked and cfg.mask_kv else None
    k, v = _gather_kv(k_ref, v_ref, page_base, pages, cfg, kv_ok)
    x = _logits(q, k, cfg)
    if cfg.heads_per_tile > 1:  # each row sees only its own head's keys
        x = jnp.where((kk // cfg.block_kv)[None, :] == row_head[:, None], x, -jnp.inf)
    if masked:
        if cfg.causal:
            visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < kv_len)
        else:
            visible = key_pos[None, :] < kv_len
        x = jnp.where(visible, x, -jnp.inf)
    m_new = jnp.maximum(m, x.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(x - m_new[:, None])
    precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return o * alpha[:, None] + pv, m_new, denom * alpha + p.sum(axis=1), nxt


def _load_pages(bt_ref, seq, j, cfg):
    """Page id of each key of step j, [keys_per_step] (each page's id repeated B times,
    and the step's ids repeated for each of the tile's heads)."""
    kk = jnp.arange(cfg.keys_per_step, dtype=jnp.int32) % cfg.block_kv
    return bt_ref[seq, j * cfg.pages_per_step + kk // cfg.block_size]


def _gather_kv(k_ref, v_ref, page_base, pages, cfg, kv_ok=None):
    """The step's keys and values, [block_kv, D] each, one cache row per key; rows where
    `kv_ok` [block_kv] is False are not loaded (zeros).

    Row-per-key pointers (rather than a [P, B, D] page load reshaped to [block_kv, D])
    measured 1.5-1.7x faster decode on the H200 (docs/PERF.md, 2026-11-30).
    """
    kk = jnp.arange(cfg.keys_per_step, dtype=jnp.int32)
    if cfg.heads_per_tile > 1:  # page_base is the tile's first head's; key kk is of head
        page_base = page_base + (kk // cfg.block_kv) * cfg.num_blocks  # kk // block_kv
    rows = (page_base + pages) * cfg.block_size + kk % cfg.block_size
    cols = jnp.arange(cfg.head_dim, dtype=jnp.int32)
    idx = (rows[:, None], cols[None, :])
    if kv_ok is None and not cfg.evict_first:
        return k_ref[idx], v_ref[idx]
    kw = {} if kv_ok is None else {"mask": kv_ok[:, None], "other": 0.0}
    if cfg.evict_first:
        kw["eviction_policy"] = "evict_first"
    return plgpu.load(k_ref.at[idx], **kw), plgpu.load(v_ref.at[idx], **kw)


def ragged_paged_attention_kernel(
    meta_ref,  # [NT, 5] int32 (tile_metadata)
    bt_ref,  # [S, Mp] int32 block tables, Mp a multiple of pages_per_step
    layer_ref,  # [1] int32
    q_ref,  # [T*H, D]
    k_ref,  # [L*K*N*B, D]
    v_ref,  # [L*K*N*B, D]
    o_ref,  # [T*H(+R), D] out dtype, or [splits*(T*H(+R)), D] float32 partials
    *stat_refs,  # kv_splits > 1: m, l partials [splits*(T*H(+R))] float32;
    # kv_splits == 1 and return_lse: lse [T*H(+R)] float32
    cfg: KernelConfig,
):
    tile, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # The grid has room for the most tiles a ragged batch of S sequences can need; the
    # tiles past the batch's last (valid 0) return at once: they store nothing, and
    # loading their queries is not free (one prompt of ~100 new tokens in a step of 8
    # sequence slots launches 9 prefill tiles per head and split, 1 of them live; the
    # time-to-first-token step's attention fell from 29.9 to 18.5 us per layer on the
    # H200, docs/PERF.md).
    # (The program ids are read out here: interpret mode cannot lower them inside a cond.)
    pl.when(meta_ref[tile, 2] > 0)(functools.partial(
        _tile, tile, kvh, split, meta_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, o_ref,
        *stat_refs, cfg=cfg))


def _tile(tile, kvh, split, meta_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, o_ref,
          *stat_refs, cfg: KernelConfig):
    """The kernel's work for one live tile (`ragged_paged_attention_kernel`)."""
    seq, tok0, valid = meta_ref[tile, 0], meta_ref[tile, 1], meta_ref[tile, 2]
    first_pos, kv_len = meta_ref[tile, 3], meta_ref[tile, 4]

    kvh = kvh * cfg.heads_per_tile  # the tile's first KV head
    # rows: tokens x the tile's heads x padded group (one head but for heads_per_tile)
    r = jnp.arange(cfg.tile_rows, dtype=jnp.int32)
    tok = r // (cfg.heads_per_tile * cfg.group_padded)
    row_head = (r // cfg.group_padded) % cfg.heads_per_tile
    g = r % cfg.group_padded
    row_ok = (tok < valid) & (g < cfg.group)
    row = (tok0 + tok) * cfg.num_heads + (kvh + row_head) * cfg.group + g
    row = jnp.clip(row, 0, cfg.num_rows - 1)
    cols = jnp.arange(cfg.head_dim, dtype=jnp.int32)
    if cfg.mask_q:  # rows not ok read nothing (zeros): a decode tile has 1-8 real rows of 16
        q = plgpu.load(q_ref.at[row[:, None], cols[None, :]], mask=row_ok[:, None], other=0.0)
    else:  # rows not ok hold some other row
        q = q_ref[row[:, None], cols[None, :]]  # [R, D]
    pos = first_pos + tok  # [R]

    # Keys this tile needs: [0, kv_hi). Keys < kv_full are visible to every row.
    if cfg.causal:
        kv_hi = jnp.clip(first_pos + valid, 0, kv_len)
        kv_full = jnp.clip(first_pos + 1, 0, kv_len)
    else:
        kv_hi = kv_full = kv_len
    max_steps = bt_ref.shape[1] // cfg.pages_per_step
    n_steps = jnp.minimum(pl.cdiv(kv_hi, cfg.block_kv), max_steps)
    n_full = jnp.minimum(kv_full // cfg.block_kv, n_steps)
    per_split = pl.cdiv(n_steps, cfg.kv_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_steps)

    page_base = (layer_ref[0] * cfg.num_kv_heads + kvh) * cfg.num_blocks
    step = functools.partial(
        _step, q=q, pos=pos, row_head=row_head, kv_len=kv_len, seq=seq, page_base=page_base,
        bt_ref=bt_ref, k_ref=k_ref, v_ref=v_ref, cfg=cfg,
    )
    carry = (
        jnp.zeros((cfg.tile_rows, cfg.head_dim), jnp.float32),
        jnp.full((cfg.tile_rows,), _M_INIT, jnp.float32),
        jnp.zeros((cfg.tile_rows,), jnp.float32),
        _load_pages(bt_ref, seq, jnp.minimum(lo, max_steps - 1), cfg),
    )
    if cfg.single_loop:
        o, m, denom, _ = lax.fori_loop(lo, hi, functools.partial(step, masked=True), carry)
    else:
        mid = jnp.clip(n_full, lo, hi)
        carry = lax.fori_loop(lo, mid, functools.partial(step, masked=False), carry)
        o, m, denom, _ = lax.fori_loop(mid, hi, functools.partial(step, masked=True), carry)

    if cfg.dump_rows:  # unique rows for masked lanes: interpret stores are scatters
        row = jnp.where(row_ok, row, cfg.num_rows + r)
    rows_per_split = cfg.num_rows + (cfg.tile_rows if cfg.dump_rows else 0)
    if cfg.kv_splits == 1:
        out = o / jnp.where(denom == 0.0, 1.0, denom)[:, None]
        plgpu.store(o_ref.at[row[:, None], cols[None, :]], out.astype(o_ref.dtype),
                    mask=row_ok[:, None])
        if cfg.return_lse:
            lse = jnp.where(denom > 0.0, m * LN2 + jnp.log(denom), -jnp.inf)
            plgpu.store(stat_refs[0].at[row], lse, mask=row_ok)
        return
    prow = split * rows_per_split + row
    plgpu.store(o_ref.at[prow[:, None], cols[None, :]], o, mask=row_ok[:, None])
    m_ref, denom_ref = stat_refs
    plgpu.store(m_ref.at[prow], m, mask=row_ok)
    plgpu.store(denom_ref.at[prow], denom, mask=row_ok)


def combine_splits(o, m, denom, num_rows: int, dtype, return_lse: bool = False):
    """Merges per-split partials [splits, rows, D] / [splits, rows] into [num_rows, D].

    With `return_lse` also returns the rows' natural-log log-sum-exp [num_rows] (-inf
    where no split saw a key).
    """
    o, m, denom = o[:, :num_rows], m[:, :num_rows], denom[:, :num_rows]
    m_max = m.max(axis=0)
    w = jnp.exp2(m - m_max[None])
    total = (denom * w).sum(axis=0)
    out = (o * w[..., None]).sum(axis=0) / jnp.where(total == 0.0, 1.0, total)[:, None]
    if not return_lse:
        return out.astype(dtype)
    lse = jnp.where(total > 0.0, m_max * LN2 + jnp.log(total), -jnp.inf)
    return out.astype(dtype), lse


def run_kernel(q2, k2, v2, layer, block_tables, meta, cfg: KernelConfig, *,
               num_warps: int, num_stages: int, interpret: bool):
    """Launches the kernel; q2 is [T*H, D], k2/v2 are the caches as [L*K*N*B, D].

    Returns [T*H, D], or with `cfg.return_lse` ([T*H, D], lse [T*H] float32).
    """
    rows = cfg.num_rows + (cfg.tile_rows if cfg.dump_rows else 0)
    d = cfg.head_dim
    if cfg.kv_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, d), q2.dtype)]
        if cfg.return_lse:
            out_shape.append(jax.ShapeDtypeStruct((rows,), jnp.float32))
    else:
        n = cfg.kv_splits * rows
        out_shape = [jax.ShapeDtypeStruct((n, d), jnp.float32),
                     jax.ShapeDtypeStruct((n,), jnp.float32),
                     jax.ShapeDtypeStruct((n,), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(ragged_paged_attention_kernel, cfg=cfg),
        grid=(meta.shape[0], cfg.num_kv_heads // cfg.heads_per_tile, cfg.kv_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=_kernel_name(cfg),
    )(meta, block_tables, layer, q2, k2, v2)
    if cfg.kv_splits == 1:
        if cfg.return_lse:
            return outs[0][: cfg.num_rows], outs[1][: cfg.num_rows]
        return outs[0][: cfg.num_rows]
    o, m, denom = outs
    s = cfg.kv_splits
    return combine_splits(o.reshape(s, rows, d), m.reshape(s, rows), denom.reshape(s, rows),
                          cfg.num_rows, q2.dtype, return_lse=cfg.return_lse)


def _kernel_name(cfg: KernelConfig) -> str:
    name = f"ragged_paged_attention_r{cfg.tile_rows}_kv{cfg.block_kv}_s{cfg.kv_splits}"
    name += "" if cfg.causal else "_full"
    name += "_lse" if cfg.return_lse else ""
    name += f"_hp{cfg.heads_per_tile}" if cfg.heads_per_tile > 1 else ""
    return name + "_1loop" * cfg.single_loop
