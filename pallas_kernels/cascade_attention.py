"""Cascade (shared-prefix) attention: read a shared prefix's K/V once for its whole group.

Query rows are packed so that group g (every sequence sharing one cached prefix) owns the
contiguous rows `prefix_cu_q_lens[g]:prefix_cu_q_lens[g+1]`. Attention splits over two
disjoint key sets:

- prefix: all of the group's rows against the prefix's `prefix_kv_lens[g]` keys, with no
  causal mask (every row sits after the prefix); the kernel's prefill tiling packs many
  rows of the group into one tile, so each prefix page is loaded once per tile instead of
  once per sequence (Hydragen, FlashInfer cascade, RelayAttention);
- suffix: each sequence's causal attention over its own blocks after the prefix
  (`suffix_block_tables[s]` = the block table without the prefix's blocks,
  `suffix_kv_lens[s]` = kv_len - prefix length, the prefix a whole number of blocks);

and the two are merged by log-sum-exp. Rows in no group (before the first group, after
the last, or in a group with prefix_kv_lens 0) get the suffix attention alone.

ALiBi (`alibi_slopes`, `alibi.py`): the suffix part sees its keys and rows at positions
shifted down by the prefix length, which leaves `k_pos - q_pos` and so its bias exact.
The prefix part takes every row at q_pos = prefix length (`paged_attention`'s
non-causal contract), which leaves its output exact but its lse too high by
`slope_h * (q_pos - prefix length)`, the row's suffix position: subtracting that makes
both lse's those of the true logits, so the merge equals ALiBi attention over the
full table.

Sliding window (`sliding_window`): a row's window bound depends on its own position,
which the prefix part (every row of a group against the whole prefix, no position
mask) does not have. A windowed call therefore attends each sequence over its full
table (the group's prefix blocks, then its own: `full_block_tables`) with the windowed
causal kernel, which reads only the pages in each row's window; the prefix is not
shared, but a window row reads at most `window` keys, so there is little to share. A
window reaching past every key the tables can hold is no window (a mixed model's full
layer: `models.window.FULL_WINDOW`): `lax.cond` then takes the shared-prefix pass.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import INT32
from pallas_kernels.fp8 import is_fp8
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    token_positions,
)
from pallas_kernels.paged_attention_tiling import BlockSizes, prefill_kv_splits

# The shared-prefix part: 64-row tiles, its key range split (kv_splits None:
# `resolve_prefix_block_sizes`) within ~384 programs, at most 8 ways. The per-sequence
# suffix is short (a prompt's own tokens and the output): 32-key steps; decoding over an
# fp8 cache, the decode tiling's fp8 defaults, which follow the suffix tables' width
# (`default_suffix_block_sizes`).
PREFIX_BLOCK_SIZES = BlockSizes(block_q=64)
SUFFIX_BLOCK_SIZES = BlockSizes(block_kv=32)
FP8_DECODE_SUFFIX_BLOCK_SIZES = BlockSizes()
_PREFIX_TARGET_PROGRAMS, _PREFIX_MAX_SPLITS = 384, 8


def merge_attention(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array):
    """Merges two attentions over disjoint key sets. o [T, H, D], lse [T, H] natural log.

    Returns `(o [T, H, D] in o1.dtype, lse [T, H] float32)`, computed in float32. A side
    with lse -inf (no keys; its o must be finite, e.g. zeros) contributes nothing; rows
    with both sides -inf come out as zeros with lse -inf.
    """
    lse1, lse2 = lse1.astype(jnp.float32), lse2.astype(jnp.float32)
    m = jnp.maximum(lse1, lse2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # both -inf: weights exp(-inf) = 0
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    total = w1 + w2
    o = o1.astype(jnp.float32) * w1[..., None] + o2.astype(jnp.float32) * w2[..., None]
    o = o / jnp.where(total == 0.0, 1.0, total)[..., None]
    return o.astype(o1.dtype), m + jnp.log(total)


def _check_groups(q, prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens):
    """Raises ValueError naming the prefix argument whose shape or dtype is wrong."""
    if prefix_block_tables.ndim != 2 or jnp.dtype(prefix_block_tables.dtype) != INT32:
        raise ValueError(f"prefix_block_tables must be int32 [G, Mp], got "
                         f"{prefix_block_tables.dtype}{list(prefix_block_tables.shape)}")
    g = prefix_block_tables.shape[0]
    if prefix_kv_lens.shape != (g,) or jnp.dtype(prefix_kv_lens.dtype) != INT32:
        raise ValueError(f"prefix_kv_lens must be int32 [{g}], got "
                         f"{prefix_kv_lens.dtype}{list(prefix_kv_lens.shape)}")
    if prefix_cu_q_lens.shape != (g + 1,) or jnp.dtype(prefix_cu_q_lens.dtype) != INT32:
        raise ValueError(f"prefix_cu_q_lens must be int32 [{g + 1}], got "
                         f"{prefix_cu_q_lens.dtype}{list(prefix_cu_q_lens.shape)}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")


def _with_leading_group(prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens):
    """Prepends an empty group (kv_len 0) owning rows [0, prefix_cu_q_lens[0]).

    The kernels' row contract starts sequences at row 0; this lets the first group start
    anywhere (rows before it get lse -inf) at the cost of one more, keyless, segment.
    """
    return dict(block_tables=jnp.pad(prefix_block_tables, ((1, 0), (0, 0))),
                kv_lens=jnp.pad(prefix_kv_lens, (1, 0)),
                cu_q_lens=jnp.concatenate([jnp.zeros((1,), jnp.int32), prefix_cu_q_lens]))


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "interpret", "use_reference", "max_q_len", "prefix_block_sizes",
    "suffix_block_sizes"))
def cascade_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    prefix_block_tables: jax.Array,  # [G, Mp] int32
    prefix_kv_lens: jax.Array,  # [G] int32, whole blocks
    prefix_cu_q_lens: jax.Array,  # [G + 1] int32, group g owns rows [cu[g], cu[g+1])
    suffix_block_tables: jax.Array,  # [S, M] int32, blocks after the prefix
    suffix_kv_lens: jax.Array,  # [S] int32, kv_len - prefix length
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    interpret: bool = False,
    use_reference: bool = False,
    max_q_len: int | None = None,
    prefix_block_sizes: BlockSizes = PREFIX_BLOCK_SIZES,
    suffix_block_sizes: BlockSizes | None = None,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array:
    """Causal attention of a ragged batch whose groups share cached prefixes. [T, H, D].

    Equals `paged_attention` over the full block tables (prefix blocks + suffix blocks,
    kv_lens = prefix + suffix). `max_q_len` is the suffix part's tiling hint (1 = decode);
    the prefix part always uses the prefill tiling. `prefix_block_sizes` and
    `suffix_block_sizes` tune the two `paged_attention` calls (the prefix's kv_splits
    None: `resolve_prefix_block_sizes`; the suffix's None: `default_suffix_block_sizes`).
    `use_reference` runs the same composition on `paged_attention_reference` (the XLA
    path; the knobs are ignored there).
    `alibi_slopes` as in `paged_attention`, at each row's absolute position; an fp8
    cache's `k_scale`, `v_scale` as there (both parts read the cache through them).
    `sliding_window` as there: each sequence over its full table (module docstring),
    unless the window reaches past every key the tables hold (`lax.cond`).
    """
    _check_groups(q, prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens)
    tables = (prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens, suffix_block_tables,
              suffix_kv_lens, cu_q_lens)
    common = dict(q=q, k_cache=k_cache, v_cache=v_cache, layer=layer, scale=scale,
                  soft_cap=soft_cap, alibi_slopes=alibi_slopes, k_scale=k_scale,
                  v_scale=v_scale)
    kernel = dict(interpret=interpret, use_reference=use_reference, max_q_len=max_q_len)
    shared = functools.partial(_shared_prefix_pass, *tables, common=common, **kernel,
                               prefix_block_sizes=prefix_block_sizes,
                               suffix_block_sizes=suffix_block_sizes)
    if sliding_window is None:
        return shared()
    # a window reaching past every key the tables can hold is none: the shared pass
    reach = (prefix_block_tables.shape[1] + suffix_block_tables.shape[1]) * k_cache.shape[3]
    return jax.lax.cond(sliding_window >= reach, shared, functools.partial(
        _windowed_pass, *tables, common=common, sliding_window=sliding_window, **kernel))


def _windowed_pass(*tables, common, sliding_window, interpret, use_reference, max_q_len):
    """A window's cascade: each sequence's full table with the windowed causal op."""
    full, kv_lens = full_block_tables(common["k_cache"].shape[3], *tables)
    args = dict(common, block_tables=full, kv_lens=kv_lens, cu_q_lens=tables[-1],
                sliding_window=sliding_window)
    if use_reference:
        return paged_attention_reference(**args)
    return paged_attention(**args, interpret=interpret, max_q_len=max_q_len)


def _shared_prefix_pass(prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens,
                        suffix_block_tables, suffix_kv_lens, cu_q_lens, *, common, interpret,
                        use_reference, max_q_len, prefix_block_sizes, suffix_block_sizes):
    """The prefix part and the suffix part, merged by log-sum-exp (module docstring)."""
    q, k_cache, alibi_slopes = common["q"], common["k_cache"], common["alibi_slopes"]
    groups = _with_leading_group(prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens)
    suffix = dict(block_tables=suffix_block_tables, kv_lens=suffix_kv_lens,
                  cu_q_lens=cu_q_lens)
    common = dict(common, return_lse=True)
    if use_reference:
        o1, lse1 = paged_attention_reference(**groups, causal=False, **common)
        o2, lse2 = paged_attention_reference(**suffix, **common)
    else:
        prefix_bs = resolve_prefix_block_sizes(q, k_cache, prefix_block_sizes)
        o1, lse1 = paged_attention(**groups, causal=False, interpret=interpret,
                                   block_sizes=prefix_bs, **common)
        suffix_bs = suffix_block_sizes or default_suffix_block_sizes(k_cache, max_q_len)
        o2, lse2 = paged_attention(**suffix, interpret=interpret, max_q_len=max_q_len,
                                   block_sizes=suffix_bs, **common)
    if alibi_slopes is not None:  # the prefix part's rows at their true positions
        suffix_pos = token_positions(cu_q_lens, suffix_kv_lens, q.shape[0])[1]
        lse1 = lse1 - alibi_slopes[None, :] * suffix_pos[:, None].astype(jnp.float32)
    return merge_attention(o1, lse1, o2, lse2)[0]


def default_suffix_block_sizes(k_cache: jax.Array, max_q_len: int | None) -> BlockSizes:
    """The suffix part's knobs, from the cache [L, K, N, B, D] and the tiling hint.
    FP8_DECODE_SUFFIX_BLOCK_SIZES when decoding (max_q_len 1) over an fp8 cache: every
    knob left to `resolve_block_sizes`, whose fp8 decode defaults follow the suffix
    tables' width (static: the engine buckets it over the longest suffix): one-warp
    programs, one-page (16-key) steps for tables of <= 256 keys, which are bound by each
    program's latency, not by bytes, and 32-key steps split over the key range for longer
    ones (docs/KERNEL_NOTES.md). Else SUFFIX_BLOCK_SIZES."""
    if max_q_len == 1 and is_fp8(k_cache.dtype):
        return FP8_DECODE_SUFFIX_BLOCK_SIZES
    return SUFFIX_BLOCK_SIZES


def resolve_prefix_block_sizes(q: jax.Array, k_cache: jax.Array,
                               block_sizes: BlockSizes = PREFIX_BLOCK_SIZES) -> BlockSizes:
    """The shared-prefix part's knobs: `block_sizes` with kv_splits, where None, the most
    (a power of 2, up to 8) that keep the part within ~384 programs. q [T, H, D], k_cache
    [L, K, N, B, D]."""
    if block_sizes.kv_splits is not None:
        return block_sizes
    t, h, _ = q.shape
    splits = prefill_kv_splits(t, h, k_cache.shape[1], block_sizes.block_q,
                               _PREFIX_TARGET_PROGRAMS, _PREFIX_MAX_SPLITS)
    return dataclasses.replace(block_sizes, kv_splits=splits)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def cascade_attention_reference(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    prefix_block_tables: jax.Array,  # [G, Mp] int32
    prefix_kv_lens: jax.Array,  # [G] int32
    prefix_cu_q_lens: jax.Array,  # [G + 1] int32
    suffix_block_tables: jax.Array,  # [S, M] int32
    suffix_kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array:
    """The dense check: each sequence's full table (`full_block_tables`) and plain
    causal `paged_attention_reference` over it. Returns [T, H, D]."""
    _check_groups(q, prefix_block_tables, prefix_kv_lens, prefix_cu_q_lens)
    tables, kv_lens = full_block_tables(k_cache.shape[3], prefix_block_tables,
                                        prefix_kv_lens, prefix_cu_q_lens, suffix_block_tables,
                                        suffix_kv_lens, cu_q_lens)
    return paged_attention_reference(q, k_cache, v_cache, layer, tables, kv_lens, cu_q_lens,
                                     scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                                     k_scale=k_scale, v_scale=v_scale,
                                     sliding_window=sliding_window)


def full_block_tables(block_size: int, prefix_block_tables: jax.Array,
                      prefix_kv_lens: jax.Array, prefix_cu_q_lens: jax.Array,
                      suffix_block_tables: jax.Array, suffix_kv_lens: jax.Array,
                      cu_q_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each sequence's whole block table, its group's prefix blocks then its own, int32
    [S, Mp + M], and its kv_len (prefix + suffix), int32 [S]. Sequence s belongs to the
    group whose row range holds its first row (if any)."""
    b = block_size
    num_groups, mp = prefix_block_tables.shape
    first_row = cu_q_lens[:-1]
    grp = jnp.searchsorted(prefix_cu_q_lens[1:], first_row, side="right").astype(jnp.int32)
    grp_c = jnp.minimum(grp, num_groups - 1)
    in_group = (grp < num_groups) & (prefix_cu_q_lens[grp_c] <= first_row)
    prefix_len = jnp.where(in_group, prefix_kv_lens[grp_c], 0)  # [S]
    n_prefix = (prefix_len // b)[:, None]  # [S, 1] prefix blocks
    j = jnp.arange(mp + suffix_block_tables.shape[1], dtype=jnp.int32)[None, :]
    from_prefix = prefix_block_tables[grp_c[:, None], jnp.minimum(j, mp - 1)]
    from_suffix = jnp.take_along_axis(
        jnp.pad(suffix_block_tables, ((0, 0), (0, mp))), jnp.maximum(j - n_prefix, 0), axis=1)
    return jnp.where(j < n_prefix, from_prefix, from_suffix), prefix_len + suffix_kv_lens
