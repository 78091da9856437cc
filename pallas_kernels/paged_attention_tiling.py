"""How `paged_attention` cuts a ragged batch into kernel programs: its tuning knobs
(`BlockSizes`) and how their defaults follow the shapes, the kernel's static
configuration (`KernelConfig`), and the per-tile metadata (`tile_metadata`).

A tile is `tokens x padded query group` rows of one sequence against one KV head: the G
query heads that share a KV head sit in one tile, so each gathered K/V page serves all
of them. The decode tiling (`max_q_len=1`) has one token per tile (rows = the group
padded to 16, the smallest `dot`) and splits each tile's key range over `kv_splits`
programs; the prefill tiling packs `block_q // padded group` tokens per tile. Tiles never
straddle two sequences, so a tile's sequence, lengths and block table are scalars read
from a small metadata array (no scalar prefetch on Triton).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.common import is_pow2, next_pow2

# decode tiling: split the key range until about this many programs, at most 8 ways
_DECODE_TARGET_PROGRAMS, _DECODE_MAX_SPLITS = 1024, 8
# decode over an fp8 cache: one-warp programs on 32-key steps (16 while the tables hold at
# most _FP8_SHORT_KEYS), and at least two key splits once they hold _FP8_SPLIT_KEYS (a
# one-warp program walking them alone is latency-bound)
_FP8_SHORT_KEYS, _FP8_SPLIT_KEYS = 256, 1024
# prefill tiling: a batch of few tiles (one short prompt: time to first token) splits its
# key range until about this many programs, at most this many ways
_PREFILL_TARGET_PROGRAMS, _PREFILL_MAX_SPLITS = 256, 4


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The kernel's tuning knobs (static; none changes the function computed). None:
    chosen from the shapes and the tiling (`resolve_block_sizes`)."""

    block_q: int = 128  # prefill tiling: rows (tokens x padded query group) per tile
    block_kv: int | None = None  # keys per inner step (raised to one page if smaller)
    kv_splits: int | None = None  # programs splitting one tile's key range
    num_warps: int | None = None  # Triton's, per program
    num_stages: int | None = None  # Triton's software-pipelining depth
    prefetch_pages: bool | None = None  # load the next step's page ids a step early
    single_loop: bool = False  # one masked key loop, not unmasked steps + masked edge
    evict_first: bool = False  # cache hint on the K/V loads
    mask_q: bool | None = None  # skip loading a tile's padding query rows
    mask_kv: bool = True  # edge steps skip loading keys past kv_len
    # decode tiling: KV heads per tile, each row masked to its own head's keys
    heads_per_tile: int = 1


def prefill_kv_splits(num_tokens: int, num_heads: int, num_kv_heads: int, block_q: int,
                      target_programs: int, max_splits: int) -> int:
    """Key-range splits for the prefill tiling: the most (a power of 2, at most
    `max_splits`) that keep ~ceil(T / tile tokens) tiles x KV heads x splits within
    `target_programs` (ragged tile edges aside). Few tiles and many keys (one short prompt,
    a cascade's shared prefix) want splits; more splits cost more partials to combine."""
    tile_tokens = max(1, block_q // next_pow2(num_heads // num_kv_heads))
    programs = -(-num_tokens // tile_tokens) * num_kv_heads
    splits = 1
    while splits < max_splits and programs * splits * 2 <= target_programs:
        splits *= 2
    return splits


def resolve_block_sizes(bs: BlockSizes, q_shape: tuple[int, ...],
                        cache_shape: tuple[int, ...], dtype: jnp.dtype, *,
                        max_q_len: int | None, causal: bool, table_keys: int,
                        kv_fp8: bool = False, alibi: bool = False) -> BlockSizes:
    """`bs` with every None chosen and `block_kv` at least one page (B). `table_keys`:
    the keys the block tables can hold (static width x B). Defaults:

    - block_kv: for the decode tiling over an fp8 cache (`kv_fp8`) 32, or 16 while
      `table_keys` <= 256 (short tables: the steps' dependent loads bound the program,
      and smaller steps fit more programs); else 64;
    - kv_splits: decode, enough for ~1024 programs (at most 8), and over an fp8 cache at
      least 2 once `table_keys` >= 1024; prefill, `prefill_kv_splits` within ~256
      programs (at most 4: one short prompt);
    - num_warps: 8 for a causal prefill tiling split over the key range (few programs,
      each latency-bound); 1 for the decode tiling over an fp8 cache (one warp converts
      and scales a 32-key step's tiles; with these block_kv and splits the fastest of
      1/2 warps, 16-64 keys and 1-8 splits at Llama-2/3 heads, batch 64/256, contexts
      of 2,048 and 100-2,000 on the H200, docs/KERNEL_NOTES.md); else 4;
    - num_stages: 2 for float32 (shared memory) and for an ALiBi prefill (`alibi`: its
      fastest of 2-4 stages in every prefill case measured on the H200), else 3 decode,
      4 prefill;
    - prefetch_pages and mask_q: on for the decode tiling (a decode tile holds 1-8 real
      rows of 16), off for prefill.

    Raises ValueError for a block size that is not a power of 2 or a `heads_per_tile`
    that is not a power of 2 dividing K with the decode tiling.
    """
    t, h, _ = q_shape
    _, k, _, b, _ = cache_shape
    decode = max_q_len == 1
    fp8_decode = decode and kv_fp8
    block_kv = bs.block_kv
    if block_kv is None:
        block_kv = 64 if not fp8_decode else 16 if table_keys <= _FP8_SHORT_KEYS else 32
    block_kv = max(block_kv, b)
    if not (is_pow2(bs.block_q) and is_pow2(block_kv)):
        raise ValueError(f"block_q ({bs.block_q}) and block_kv ({block_kv}) must be powers "
                         "of 2")
    hp = bs.heads_per_tile
    if hp != 1 and not (decode and is_pow2(hp) and k % hp == 0):
        raise ValueError(f"heads_per_tile ({hp}) must be a power of 2 dividing the kv heads "
                         f"({k}), with the decode tiling (max_q_len=1)")
    kv_splits = bs.kv_splits
    if kv_splits is None and decode:  # one tile per token
        kv_splits = min(_DECODE_MAX_SPLITS,
                        next_pow2(max(1, _DECODE_TARGET_PROGRAMS // (t * k))))
        if fp8_decode and table_keys >= _FP8_SPLIT_KEYS:
            kv_splits = max(kv_splits, 2)
    elif kv_splits is None:
        kv_splits = prefill_kv_splits(t, h, k, bs.block_q, _PREFILL_TARGET_PROGRAMS,
                                      _PREFILL_MAX_SPLITS)
    num_warps = bs.num_warps
    if num_warps is None:
        num_warps = (8 if not decode and causal and kv_splits > 1
                     else 1 if fp8_decode else 4)
    num_stages = bs.num_stages
    if num_stages is None:
        num_stages = (2 if jnp.dtype(dtype) == jnp.float32 or (alibi and not decode)
                      else 3 if decode else 4)
    return dataclasses.replace(
        bs, block_kv=block_kv, kv_splits=kv_splits, num_warps=num_warps,
        num_stages=num_stages,
        prefetch_pages=decode if bs.prefetch_pages is None else bs.prefetch_pages,
        mask_q=decode if bs.mask_q is None else bs.mask_q)


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
    tile_rows: int  # max(16, tile_tokens * group_padded * heads_per_tile)
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
    alibi: bool = False  # add slope_h * (k_pos - q_pos) to the logits ([H] slopes input)
    kv_fp8: bool = False  # fp8 caches with float32 scales per row (two scales inputs)
    # sliding-window attention: the layer input holds [layer, window] and a row at q_pos
    # sees keys k with q_pos - window < k <= q_pos (causal only); steps wholly older than
    # the tile's first row's window are never run, so their pages are never read
    windowed: bool = False

    @property
    def block_kv(self) -> int:
        return self.pages_per_step * self.block_size

    @property
    def alibi_folded(self) -> bool:
        """ALiBi's bias joins the raw dot product, scaled with it inside exp2's argument
        (no soft cap, scale > 0): no more element-wise work per logit than without."""
        return self.alibi and self.soft_cap is None and self.scale > 0

    @property
    def kernel_name(self) -> str:
        """The Pallas call's name: the tiling and the static options it was built with."""
        name = f"ragged_paged_attention_r{self.tile_rows}_kv{self.block_kv}_s{self.kv_splits}"
        name += "" if self.causal else "_full"
        name += "_lse" if self.return_lse else ""
        name += "_alibi" if self.alibi else ""
        name += "_fp8" if self.kv_fp8 else ""
        name += "_window" if self.windowed else ""
        name += f"_hp{self.heads_per_tile}" if self.heads_per_tile > 1 else ""
        return name + "_1loop" * self.single_loop

    @property
    def keys_per_step(self) -> int:
        """Rows gathered per step: block_kv keys of each of the tile's KV heads."""
        return self.heads_per_tile * self.block_kv


def kernel_config(bs: BlockSizes, q_shape: tuple[int, ...], cache_shape: tuple[int, ...],
                  *, decode: bool, scale: float, soft_cap: float | None, interpret: bool,
                  causal: bool, return_lse: bool, alibi: bool = False,
                  kv_fp8: bool = False, windowed: bool = False) -> KernelConfig:
    """The kernel's static facts from resolved knobs `bs` (`resolve_block_sizes`)."""
    t, h, d = q_shape
    _, k, n, b, _ = cache_shape
    gp = next_pow2(h // k)
    tile_tokens = 1 if decode else max(1, bs.block_q // gp)
    return KernelConfig(
        num_heads=h, num_kv_heads=k, num_blocks=n, block_size=b, head_dim=d, group=h // k,
        group_padded=gp, tile_tokens=tile_tokens,
        tile_rows=max(16, tile_tokens * gp * bs.heads_per_tile),
        pages_per_step=bs.block_kv // b, kv_splits=bs.kv_splits, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap), num_rows=t * h,
        dump_rows=interpret, prefetch_pages=bs.prefetch_pages, causal=causal,
        return_lse=return_lse, single_loop=bs.single_loop, evict_first=bs.evict_first,
        mask_q=bs.mask_q, mask_kv=bs.mask_kv, heads_per_tile=bs.heads_per_tile,
        alibi=alibi, kv_fp8=kv_fp8, windowed=windowed,
    )


def window_steps(layer_ref, first_pos, valid, kv_len, n_steps, cfg: KernelConfig):
    """A tile's key steps under a window (`cfg.windowed`; layer_ref [2] = [layer,
    window]): (the first step holding a key of the tile's first row's window, the first
    step whose keys are all in every row's window, (window, kv_lo)); without one (0, 0,
    None). Row q_pos sees keys > q_pos - window, so the tile's rows (positions first_pos
    .. first_pos + valid - 1) see no key below kv_lo = first_pos - window + 1, and every
    row sees the keys from first_pos + valid - window to first_pos."""
    if not cfg.windowed:
        return 0, 0, None
    window = layer_ref[1]
    kv_lo = jnp.clip(first_pos - window + 1, 0, kv_len)
    every = jnp.clip(first_pos + valid - window, 0, kv_len)
    first = jnp.minimum(kv_lo // cfg.block_kv, n_steps)
    return first, -(-every // cfg.block_kv), (window, kv_lo)


def num_tiles(num_tokens: int, num_seqs: int, tile_tokens: int) -> int:
    """Static upper bound on the tiles of a ragged batch (+1 segment for padding rows)."""
    return (num_tokens + (num_seqs + 1) * (tile_tokens - 1)) // tile_tokens


def tile_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int,
                  tile_tokens: int) -> jax.Array:
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
