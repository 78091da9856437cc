"""The Pallas (Triton backend) kernel behind `paged_attention.paged_attention`.

One program handles one tile of query rows (`paged_attention_tiling`) against one KV
head and one slice of the key range, with an online softmax in log2 units over steps of
`block_kv` keys. The key loop has two parts: the steps every row of the tile fully sees
(no mask), then the causal / length edge. Each step gathers its keys from the cache
viewed as `[L*K*N*B, D]`, one row pointer per key (row = ((layer*K + head)*N + page)*B +
offset, the page id read per key from the block table). With `kv_splits > 1` each
program stores unnormalised float32 partials that `combine_splits` merges in XLA.

Static options add code only when set: `causal=False` (every row sees all
`kv_len` keys; cascade attention's shared-prefix part), `return_lse` (also the
log-sum-exp of each row's logits, natural log, -inf for rows that see no key),
`alibi` (an [H] slopes input; each step adds `slope_h * (key_pos - q_pos)` to the
logits, q_pos = the row's position, or kv_len with `causal=False`), `windowed` (the
window a traced int32 beside the layer; the key loop starts at the tile's first row's
window, so older pages are never read, and masks the window's edge) and `kv_fp8` (the
caches are fp8 with float32 scales per row, `fp8.py`: each step loads the fp8 tiles and
their scales, converts the tiles to the query's dtype for the dots, multiplies each
key's logits by its K scale and each key's softmax weight by its V scale; the bytes
read per key are D + 4 instead of 2D).

Interpret mode stores a masked lane as a read-modify-write scatter, so two lanes of one
store must not share a row: with `cfg.dump_rows` masked rows store to private rows past
the output's end (sliced off); on a GPU masked lanes simply do not store.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.alibi import alibi_tile_terms
from pallas_kernels.paged_attention_tiling import KernelConfig, window_steps
from pallas_kernels.paged_gather import gather_kv, load_pages

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite start for the running max so that fully masked rows never compute inf - inf.
_M_INIT = -1e30


def _dot_qk(q, k):
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    return plgpu.dot(q, k, trans_b=True, precision=precision)


def _logits(s, cfg: KernelConfig):
    """Scaled (and soft-capped) logits in log2 units from the raw dot products s, float32
    [R, block_kv]."""
    if cfg.soft_cap is None:
        return s * (cfg.scale * LOG2E)
    return jnp.tanh(s * (cfg.scale / cfg.soft_cap)) * (cfg.soft_cap * LOG2E)


def _step(j, carry, *, q, pos, row_head, kv_len, seq, page_base, bt_ref, k_ref, v_ref, cfg,
          masked, alibi=None, scale_refs=None, window=None):
    """One online-softmax step over `block_kv` keys (of each of the tile's heads) gathered
    from `pages_per_step` pages; `masked` adds the causal / length mask (edge steps).

    q [R, D] and pos, row_head [R] (R = tile_rows); bt_ref [S, Mp] int32; k_ref, v_ref
    [L*K*N*B, D]; carry = (o [R, D] float32, running max m [R] and denominator [R]
    float32 in log2 units, page ids [keys_per_step]). With `prefetch_pages` the carry's
    page ids are this step's, loaded one step ahead so that the K/V gather does not wait
    on the block-table load. `alibi` (with `cfg.alibi`): per row, the slope in the
    units of x, float32 [R], and the tile's anchor position (int32 scalar,
    `alibi.alibi_tile_terms`). With `cfg.alibi_folded` x is the raw dot product plus
    the bias over the scale, and `unit` = scale * log2(e) scales it inside exp2.
    `scale_refs` (with `cfg.kv_fp8`): the K and V scales, [L*K*N*B] float32 each.
    `window` (with `cfg.windowed`): (window, kv_lo) (`window_steps`): a masked step
    also hides keys <= pos - window and loads none below kv_lo.
    """
    o, m, denom, pages = carry
    if cfg.prefetch_pages:
        nxt = load_pages(bt_ref, seq, jnp.minimum(j + 1, bt_ref.shape[1] // cfg.pages_per_step
                                                   - 1), cfg)
    else:
        pages = nxt = load_pages(bt_ref, seq, j, cfg)
    kk = jnp.arange(cfg.keys_per_step, dtype=jnp.int32)
    key_pos = j * cfg.block_kv + kk % cfg.block_kv
    # An edge step's keys past kv_len are padding: with mask_kv they are not fetched.
    kv_ok = key_pos < kv_len if masked and cfg.mask_kv else None
    if kv_ok is not None and cfg.windowed:  # nor those older than every row's window
        kv_ok = kv_ok & (key_pos >= window[1])
    k, v, scales = gather_kv(k_ref, v_ref, page_base, pages, cfg, kv_ok, scale_refs)
    if cfg.kv_fp8:  # dequantise: fp8 -> the dots' dtype (exact), the scales per key.
        # A 16-bit query computes in float16, not bfloat16: every e4m3/e5m2 value is exact
        # in both, but fp8 -> f16 is one conversion instruction per pair of values on
        # Hopper where fp8 -> bf16 takes several, and f16 rounds q and p 8x finer.
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        x = _dot_qk(q, k) * scales[0][None, :]
    else:
        x = _dot_qk(q, k)
    x = x if cfg.alibi_folded else _logits(x, cfg)
    if cfg.alibi:  # slope * (key_pos - anchor)
        slope, anchor = alibi
        dist = (key_pos - anchor).astype(jnp.float32)
        if jnp.ndim(slope) == 0:  # one head per tile: a [block_kv] bias, one add per logit
            x = x + (slope * dist)[None, :]
        else:  # a slope per row: one multiply-add per logit
            x = x + slope[:, None] * dist[None, :]
    if cfg.heads_per_tile > 1:  # each row sees only its own head's keys
        x = jnp.where((kk // cfg.block_kv)[None, :] == row_head[:, None], x, -jnp.inf)
    if masked:
        if cfg.causal:
            visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < kv_len)
        else:
            visible = key_pos[None, :] < kv_len
        if cfg.windowed:
            visible = visible & (key_pos[None, :] > (pos - window[0])[:, None])
        x = jnp.where(visible, x, -jnp.inf)
    if cfg.alibi_folded:  # (unit > 0: the max commutes with the scale)
        unit = cfg.scale * LOG2E
        m_new = jnp.maximum(m, x.max(axis=1) * unit)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(x * unit - m_new[:, None])
    else:
        m_new = jnp.maximum(m, x.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(x - m_new[:, None])
    precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    pw = p * scales[1][None, :] if cfg.kv_fp8 else p  # (the denominator takes p)
    pv = plgpu.dot(pw.astype(v.dtype), v, precision=precision)
    return o * alpha[:, None] + pv, m_new, denom * alpha + p.sum(axis=1), nxt


def ragged_paged_attention_kernel(
    meta_ref,  # [NT, 5] int32 (tile_metadata)
    bt_ref,  # [S, Mp] int32 block tables, Mp a multiple of pages_per_step
    layer_ref,  # [1] int32; cfg.windowed: [2], [layer, window]
    q_ref,  # [T*H, D]
    k_ref,  # [L*K*N*B, D]
    v_ref,  # [L*K*N*B, D]
    *refs,  # cfg.alibi: slopes [H] float32; cfg.kv_fp8: k, v scales [L*K*N*B] float32;
    # then the outputs:
    # o [T*H(+R), D] out dtype, or [splits*(T*H(+R)), D] float32 partials;
    # kv_splits > 1: m, l partials [splits*(T*H(+R))] float32;
    # kv_splits == 1 and return_lse: lse [T*H(+R)] float32
    cfg: KernelConfig,
):
    """Program (tile, KV head group, split) of the grid (NT, K / heads_per_tile,
    kv_splits). R = tile_rows extra output rows exist with `cfg.dump_rows` (interpret
    mode), where masked rows store."""
    tile, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # The grid has room for the most tiles a ragged batch of S sequences can need; the
    # tiles past the batch's last (valid 0) return at once: they store nothing, and
    # loading their queries is not free (a step padded to 8 sequence slots with one
    # short prompt has 1 live prefill tile of 9 per head and split).
    # (The program ids are read out here: interpret mode cannot lower them inside a cond.)
    pl.when(meta_ref[tile, 2] > 0)(functools.partial(
        _tile, tile, kvh, split, meta_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, *refs,
        cfg=cfg))


def _tile(tile, kvh, split, meta_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, *refs,
          cfg: KernelConfig):
    """The kernel's work for one live tile (`ragged_paged_attention_kernel`)."""
    slopes_ref, refs = (refs[0], refs[1:]) if cfg.alibi else (None, refs)
    scale_refs, (o_ref, *stat_refs) = (refs[:2], refs[2:]) if cfg.kv_fp8 else (None, refs)
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
    if cfg.kv_fp8 and q.dtype != jnp.float32:  # the dots in float16 (`_step`)
        q = q.astype(jnp.float16)
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
    # steps before `first` hold no key of any row's window; from n_win on, all are seen
    first, n_win, window = window_steps(layer_ref, first_pos, valid, kv_len, n_steps, cfg)
    per_split = pl.cdiv(n_steps - first, cfg.kv_splits)
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, n_steps)

    page_base = (layer_ref[0] * cfg.num_kv_heads + kvh) * cfg.num_blocks
    step = functools.partial(
        _step, q=q, pos=pos, row_head=row_head, kv_len=kv_len, seq=seq, page_base=page_base,
        bt_ref=bt_ref, k_ref=k_ref, v_ref=v_ref, cfg=cfg, scale_refs=scale_refs,
        window=window,
    )
    if cfg.alibi:
        if cfg.group == 1 and cfg.heads_per_tile == 1:  # every row is head kvh: one slope
            tile_slopes = slopes_ref[kvh]
        else:
            tile_slopes = slopes_ref[jnp.minimum((kvh + row_head) * cfg.group + g,
                                                 cfg.num_heads - 1)]
        slope, anchor, row_shift = alibi_tile_terms(
            tile_slopes, tok, first_pos, kv_len, causal=cfg.causal,
            unit=cfg.scale * LOG2E if cfg.alibi_folded else 1.0)
        step = functools.partial(step, alibi=(slope, anchor))
    carry = (
        jnp.zeros((cfg.tile_rows, cfg.head_dim), jnp.float32),
        jnp.full((cfg.tile_rows,), _M_INIT, jnp.float32),
        jnp.zeros((cfg.tile_rows,), jnp.float32),
        load_pages(bt_ref, seq, jnp.minimum(lo, max_steps - 1), cfg),
    )
    if cfg.single_loop:
        o, m, denom, _ = lax.fori_loop(lo, hi, functools.partial(step, masked=True), carry)
    else:  # the window's edge (masked), the steps every row sees whole, the causal edge
        edge = jnp.clip(n_win, lo, hi)
        mid = jnp.clip(n_full, edge, hi)
        if cfg.windowed:
            carry = lax.fori_loop(lo, edge, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(edge, mid, functools.partial(step, masked=False), carry)
        o, m, denom, _ = lax.fori_loop(mid, hi, functools.partial(step, masked=True), carry)
    if cfg.alibi:  # the running max of the true logits (the output does not move)
        m = m - row_shift

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


def combine_splits(o: jax.Array, m: jax.Array, denom: jax.Array, num_rows: int, dtype,
                   return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Merges per-split partials into [num_rows, D] in `dtype`: o [splits, rows, D]
    (unnormalised), m and denom [splits, rows] (running max in log2 units, denominator).

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


def run_kernel(q2: jax.Array, k2: jax.Array, v2: jax.Array, layer: jax.Array,
               block_tables: jax.Array, meta: jax.Array, cfg: KernelConfig, *,
               num_warps: int, num_stages: int, interpret: bool,
               alibi_slopes: jax.Array | None = None,
               kv_scales: tuple[jax.Array, jax.Array] | None = None,
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Launches the kernel: q2 [T*H, D]; k2, v2 the caches as [L*K*N*B, D]; layer [1]
    int32 ([2]: [layer, window] with `cfg.windowed`); block_tables [S, Mp] int32 (Mp a
    multiple of pages_per_step); meta [NT, 5] int32 (`tile_metadata`); alibi_slopes [H]
    float32, given iff `cfg.alibi`; kv_scales (k's, v's [L*K*N*B] float32), given iff
    `cfg.kv_fp8`.

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
    if cfg.alibi != (alibi_slopes is not None):
        raise ValueError("alibi_slopes must be given exactly when cfg.alibi is set")
    inputs = (meta, block_tables, layer, q2, k2, v2)
    if cfg.kv_fp8 != (kv_scales is not None):
        raise ValueError("kv_scales must be given exactly when cfg.kv_fp8 is set")
    inputs += (alibi_slopes,) if cfg.alibi else ()
    inputs += tuple(kv_scales) if cfg.kv_fp8 else ()
    outs = pl.pallas_call(
        functools.partial(ragged_paged_attention_kernel, cfg=cfg),
        grid=(meta.shape[0], cfg.num_kv_heads // cfg.heads_per_tile, cfg.kv_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=cfg.kernel_name,
    )(*inputs)
    if cfg.kv_splits == 1:
        if cfg.return_lse:
            return outs[0][: cfg.num_rows], outs[1][: cfg.num_rows]
        return outs[0][: cfg.num_rows]
    o, m, denom = outs
    s = cfg.kv_splits
    return combine_splits(o.reshape(s, rows, d), m.reshape(s, rows), denom.reshape(s, rows),
                          cfg.num_rows, q2.dtype, return_lse=cfg.return_lse)
