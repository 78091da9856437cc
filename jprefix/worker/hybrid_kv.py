"""The hybrid KV cache on the device side: per-group tables packed, and each layer's view.

A hybrid model (`core.kv_groups`) keeps its K/V in one pool of pages, the cache's layer
axis holding `page_layers` (P) slots instead of L layers: `[P, K, N, B, D]`. Group 0's
tables travel as the step's usual `block_tables` [S, M] and `slot_mapping` [T]; the
other groups' as `group_block_tables` [G-1, S, M] and `group_slot_mapping` [G-1, T]
(padding: the null block). A layer writes and attends at its slot of the page through
its group's table (`group_view`), with its own window: the kernels take a cache layer
index and a table as ever, so none of them changes. Under `lax.scan` the layer index is
traced and the group and slot are read from small int32 tables; unrolled layers get
them statically.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.core.kv_groups import KVCacheGroups, kv_cache_groups

GROUP_KEYS = ("group_block_tables", "group_slot_mapping")


def step_groups(layer_windows: tuple[int | None, ...], batch: dict) -> KVCacheGroups | None:
    """The step's groups: a batch packed with group tables is a hybrid cache's."""
    return kv_cache_groups(layer_windows) if GROUP_KEYS[0] in batch else None


def group_view(groups: KVCacheGroups | None, layer: Any, batch: dict) -> tuple[Any, dict]:
    """(the cache slot, the batch with its group's `block_tables` and `slot_mapping`)
    of model layer `layer`; (layer, batch) unchanged when the cache is not hybrid."""
    if groups is None:
        return layer, batch
    try:  # a concrete layer index (unrolled layers): static group and slot
        i = operator.index(layer)
    except TypeError:  # traced (lax.scan): read from the tables
        group = jnp.asarray(groups.layer_group, jnp.int32)[layer]
        slot = jnp.asarray(groups.layer_slot, jnp.int32)[layer]
        tables = jnp.concatenate([batch["block_tables"][None], batch["group_block_tables"]])
        slots = jnp.concatenate([batch["slot_mapping"][None], batch["group_slot_mapping"]])
        return slot, {**batch,
                      "block_tables": jax.lax.dynamic_index_in_dim(tables, group, 0, False),
                      "slot_mapping": jax.lax.dynamic_index_in_dim(slots, group, 0, False)}
    group, slot = groups.layer_group[i], groups.layer_slot[i]
    if group == 0:
        return slot, batch
    return slot, {**batch, "block_tables": batch["group_block_tables"][group - 1],
                  "slot_mapping": batch["group_slot_mapping"][group - 1]}


def pack_group_tables(rows: Seq[Any], batch: dict[str, np.ndarray], block_size: int,
                      num_groups: int) -> dict[str, np.ndarray]:
    """The step's groups 1.. tables [G-1, S, M] and slot mappings [G-1, T], shaped as
    `batch`'s group-0 `block_tables` and `slot_mapping` (whose positions they reuse)."""
    S, M = batch["block_tables"].shape
    T, num_other = len(batch["slot_mapping"]), num_groups - 1
    tables = np.zeros((num_other, S, M), np.int32)
    slots = np.zeros((num_other, T), np.int32)
    q_lens = np.fromiter((r.num_new_tokens for r in rows), np.int64, len(rows))
    num_tokens = int(q_lens.sum())
    seq_of_token = np.repeat(np.arange(len(rows)), q_lens)
    positions = batch["positions"][:num_tokens]
    for s, r in enumerate(rows):
        for g, table in enumerate(r.seq.group_tables):
            tables[g, s, : len(table)] = table
    for g in range(num_other):
        slots[g, :num_tokens] = (tables[g, seq_of_token, positions // block_size] * block_size
                                 + positions % block_size)
    return dict(group_block_tables=tables, group_slot_mapping=slots)
