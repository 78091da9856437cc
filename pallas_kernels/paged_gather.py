"""One key step's gather for the paged attention kernel (`paged_attention_kernel.py`):
the page id of each key from the block table, then the keys' K/V rows (and, for an fp8
cache, their per-row scales) from the caches viewed as `[L*K*N*B, D]`, one row pointer
per key (not a [P, B, D] page load reshaped: docs/KERNEL_NOTES.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def load_pages(bt_ref, seq, j, cfg):
    """Page id of each key of step j from bt_ref [S, Mp], [keys_per_step] (each page's id
    repeated B times, and the step's ids repeated for each of the tile's heads)."""
    kk = jnp.arange(cfg.keys_per_step, dtype=jnp.int32) % cfg.block_kv
    return bt_ref[seq, j * cfg.pages_per_step + kk // cfg.block_size]


def gather_kv(k_ref, v_ref, page_base, pages, cfg, kv_ok=None, scale_refs=None):
    """The step's keys and values from k_ref, v_ref [L*K*N*B, D], [keys_per_step, D]
    each, one row pointer per key (not a [P, B, D] page load reshaped, see
    docs/KERNEL_NOTES.md); `page_base` is the block index of the (layer, first head)'s
    block 0, `pages` [keys_per_step] the keys' page ids; rows where `kv_ok`
    [keys_per_step] is False are not loaded (zeros). Returns (k, v, scales): scales
    (k's, v's [keys_per_step] float32) from `scale_refs` [L*K*N*B] each, or None."""
    kk = jnp.arange(cfg.keys_per_step, dtype=jnp.int32)
    if cfg.heads_per_tile > 1:  # page_base is the tile's first head's; key kk is of head
        page_base = page_base + (kk // cfg.block_kv) * cfg.num_blocks  # kk // block_kv
    rows = (page_base + pages) * cfg.block_size + kk % cfg.block_size
    cols = jnp.arange(cfg.head_dim, dtype=jnp.int32)
    idx = (rows[:, None], cols[None, :])
    scales = None
    if scale_refs is not None:
        skw = {} if kv_ok is None else {"mask": kv_ok, "other": 0.0}
        scales = tuple(plgpu.load(r.at[rows], **skw) for r in scale_refs)
    if kv_ok is None and not cfg.evict_first:
        return k_ref[idx], v_ref[idx], scales
    kw = {} if kv_ok is None else {"mask": kv_ok[:, None], "other": 0.0}
    if cfg.evict_first:
        kw["eviction_policy"] = "evict_first"
    return plgpu.load(k_ref.at[idx], **kw), plgpu.load(v_ref.at[idx], **kw), scales
