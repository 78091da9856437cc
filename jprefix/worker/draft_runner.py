"""The draft model of speculative decoding (`method: "draft_model"`, device side): a small
model with the target's tokenizer proposes k tokens per speculating row, greedily.

Its KV cache is its own buffer (`worker.kv_cache` format, the draft's layers and heads)
laid out like the target's block pool: the same number of blocks of the same size, and
addressed by the TARGET's block ids through the same block tables and slot mapping. So
a block the target holds for a prefix also holds the draft's K/V of those tokens: the
prefix trie needs no second copy, and sharing, eviction and reuse of a block apply to
both caches at once. This holds for a block only if the draft was fed every token of it
(the engine feeds each speculating row's tokens exactly once, in order; `DraftRow`).

One `propose` runs the engine's own jitted step (`worker.step.step`, greedy) k times on
the draft's params and cache: one step over every row's new tokens, whose last logits
give the first proposal, then k - 1 one-token steps, each reading its input token from
the previous step's device output (`token_src`, as async scheduling does), so the k
steps queue without a host sync; the proposals reach the host once. Shapes are bucketed
as the engine's steps are (`pack.bucket`, `BucketConfig`): a steady run compiles a few
(T, S, M) buckets once. The draft runs on one device (no tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jprefix.worker.flat_batch import flatten_batch
from jprefix.worker.kv_bits import bits_dtype, bits_format
from jprefix.worker.kv_cache import KVCache, empty_kv_cache, kv_block_bytes, kv_dtype
from jprefix.worker.pack import BucketConfig, bucket, ragged_rows
from jprefix.worker.params import prepare_params
from jprefix.worker.step import BACKENDS, default_backend, step
from models.loader import LoadedModel, load


class DraftRow(NamedTuple):
    """One speculating row of a `propose` call.

    `token_ids`: the row's tokens whose draft K/V are not in the draft cache yet, at
    positions `start ..`: the whole uncached prompt (and output) on the row's first call,
    then the tokens emitted since its last call (accepted drafts and the target's token;
    the proposals' K/V the last call wrote past them are overwritten or never read).
    Never empty: the last one is the row's newest token, the proposals follow it.
    `block_table`: the target's block ids of the row, covering positions 0 .. start +
    len(token_ids) + k - 1 (the target's verify needs them all; the draft writes up to
    start + len(token_ids) + k - 2). Blocks before `start` must hold the draft's K/V of
    their tokens (fed to the draft earlier, by this row or by a row that shares them).
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


class DraftRunner:
    """The draft model's weights and KV cache, and its proposals (`propose`).

    `num_blocks` and `block_size` must be the target runner's (the block ids are its);
    size the pool for both caches with `target_memory_fraction`. `num_blocks` None: no
    cache yet (the draft's weights placed first, so that the target's runner sizes its
    pool from the memory left); `allocate_cache` once the pool is sized. `target` is
    checked for the same vocabulary (ValueError naming both models otherwise); only its name, config
    and tokenizer are read. `donate_params`: the draft's weights are handed over
    (`prepare_params`). `kv_cache_dtype` ("auto": the draft's dtype, or an fp8 format)
    as the engine's; `backend` and `buckets` as `ModelRunner`'s (None: the defaults)."""

    def __init__(self, draft: LoadedModel, target: LoadedModel, num_blocks: int | None,
                 block_size: int, kv_cache_dtype: str = "auto", backend: str | None = None,
                 buckets: BucketConfig | None = None, unroll_layers: bool | None = None,
                 device: Any = None, donate_params: bool = False):
        check_same_vocab(draft, target)
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
        params, model_dtype = draft.params, draft.params.embed.dtype
        if device is not None:
            params = jax.device_put(params, SingleDeviceSharding(device))
        self.name, self.cfg = draft.name, draft.config
        self.params = prepare_params(params, self.cfg, None, unroll_layers, donate_params)
        self.backend, self.block_size = backend, block_size
        self.buckets = buckets or BucketConfig()
        self.kv_dtype = kv_dtype(kv_cache_dtype, model_dtype)
        self.kv_format = bits_format(self.kv_dtype, backend, None)  # (`worker.kv_bits`)
        self._home = SingleDeviceSharding(
            next(iter(jax.tree.leaves(self.params)[0].devices())))
        self.num_blocks, self.kv_cache = 0, None
        if num_blocks is not None:
            self.allocate_cache(num_blocks)
        self.shapes_seen: set[tuple[int, ...]] = set()  # (T, S, M, decode) of the steps

    def allocate_cache(self, num_blocks: int) -> None:
        """The draft's zeroed KV cache of `num_blocks` blocks (the target pool's count)."""
        self.num_blocks = num_blocks
        self.kv_cache: KVCache | None = empty_kv_cache(
            self.cfg, num_blocks, self.block_size, self.kv_dtype, self._home,
            stored_as=self.kv_format and bits_dtype(self.kv_dtype))

    @classmethod
    def load(cls, model: str, target: LoadedModel, num_blocks: int | None, block_size: int,
             dtype: Any, load_format: str = "auto", **kwargs: Any) -> DraftRunner:
        """The draft model loaded by name as the target is (`models.loader.load`: a
        checkpoint, hub id, embedded model, or with `load_format="dummy"` a preset), its
        weights handed to the runner. `kwargs`: the constructor's."""
        draft = load(model, dtype, load_format)
        return cls(draft, target, num_blocks, block_size, donate_params=True, **kwargs)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the draft cache (all its layers, K and V)."""
        return kv_block_bytes(self.cfg, self.block_size, self.kv_dtype)

    def propose(self, rows: Sequence[DraftRow], k: int) -> np.ndarray:
        """Writes each row's `token_ids`' draft K/V, then proposes k tokens per row by
        greedy decoding (their K/V written as it goes, but the last's): int32 [S, k] in
        `rows`' order, S = len(rows)."""
        if k < 1:
            raise ValueError(f"k {k}: propose at least one token")
        if self.kv_cache is None:
            raise RuntimeError("the draft runner has no KV cache yet: allocate_cache first")
        if not rows:
            return np.zeros((0, k), np.int32)
        self._check(rows, k)
        tables = [np.asarray(r.block_table, np.int32) for r in rows]
        S = bucket(len(rows), self.buckets.min_seqs)
        block_tables = ragged_rows(tables, S, self.buckets.min_blocks)
        lens = np.array([len(r.token_ids) for r in rows], np.int32)
        starts = np.array([r.start for r in rows], np.int32)
        tokens = jnp.zeros(S, jnp.int32, device=self._home)  # (the steps' `prev_tokens`)
        token_ids = np.concatenate([np.asarray(r.token_ids, np.int32) for r in rows])
        proposals = []
        for i in range(k):
            if i == 0:  # every row's new tokens
                batch = self._batch(token_ids, starts, lens, block_tables)
            else:  # each row's previous proposal, read from the last step's output
                batch = self._batch(None, starts + lens + i - 1, np.ones_like(lens),
                                    block_tables)
            # (decode: every row computes one token, as `core.scheduler.is_decode_step`)
            tokens = self._run(batch, tokens, decode=i > 0 or bool((lens == 1).all()))
            proposals.append(tokens)
        return np.stack([np.asarray(t)[: len(rows)] for t in proposals], axis=1)

    def _check(self, rows: Sequence[DraftRow], k: int) -> None:
        for i, r in enumerate(rows):
            if not len(r.token_ids) or r.start < 0:
                raise ValueError(f"draft row {i}: needs token ids and a start >= 0, got "
                                 f"{len(r.token_ids)} tokens at {r.start}")
            last = r.start + len(r.token_ids) + k - 2  # the last position written
            if len(r.block_table) * self.block_size <= last:
                raise ValueError(f"draft row {i}: block table of {len(r.block_table)} blocks "
                                 f"does not cover position {last}")
            if max(r.block_table) >= self.num_blocks or min(r.block_table) < 0:
                raise ValueError(f"draft row {i}: block ids {min(r.block_table)}.."
                                 f"{max(r.block_table)} outside the pool of {self.num_blocks}")

    def _batch(self, token_ids: np.ndarray | None, starts: np.ndarray, lens: np.ndarray,
               block_tables: np.ndarray) -> dict[str, np.ndarray]:
        """The step's arrays (`pack.pack_step`'s names and padding) for rows computing
        `lens` tokens from positions `starts`; `token_ids` None: one token per row, read
        from the previous step's output row (`token_src`)."""
        n, num_tokens, S = len(lens), int(lens.sum()), block_tables.shape[0]
        T = bucket(num_tokens, self.buckets.min_tokens, self.buckets.token_step)
        cu_q_lens = np.full(S + 1, num_tokens, np.int32)
        cu_q_lens[0] = 0
        cu_q_lens[1 : n + 1] = np.cumsum(lens)
        positions = np.zeros(T, np.int32)
        positions[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                                  + np.repeat(starts - cu_q_lens[:n], lens))
        ids, src = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        if token_ids is None:
            src[:n] = np.arange(n)
        else:
            ids[:num_tokens] = token_ids
        row = np.repeat(np.arange(n), lens)
        slot_mapping = np.zeros(T, np.int32)  # padding -> the null block
        pos = positions[:num_tokens]
        slot_mapping[:num_tokens] = (block_tables[row, pos // self.block_size]
                                     * self.block_size + pos % self.block_size)
        kv_lens = np.zeros(S, np.int32)
        kv_lens[:n] = starts + lens
        return dict(token_ids=ids, positions=positions, slot_mapping=slot_mapping,
                    token_src=src, block_tables=block_tables, kv_lens=kv_lens,
                    cu_q_lens=cu_q_lens,
                    logits_idx=np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32))

    def _run(self, batch: dict[str, np.ndarray], prev_tokens: jax.Array, decode: bool
             ) -> jax.Array:
        """One greedy step of the draft: its tokens [S] (on the device)."""
        flat, layout = flatten_batch(batch)
        self.shapes_seen.add((len(batch["token_ids"]), *batch["block_tables"].shape, decode))
        tokens, self.kv_cache = step(self.params, self.kv_cache, flat, prev_tokens,
                                     layout=layout, cfg=self.cfg, backend=self.backend,
                                     decode=decode, greedy=True, kv_format=self.kv_format)
        return tokens


def check_same_vocab(draft: LoadedModel, target: LoadedModel) -> None:
    """ValueError naming both models unless the draft's vocabulary is the target's: the
    same vocab size, and where both have tokenizers, the same token -> id map."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise ValueError(f"draft model {draft.name!r} has vocab size {dv}, target model "
                         f"{target.name!r} {tv}: the draft must share the target's tokenizer")
    vocab = [getattr(m.tokenizer, "get_vocab", None) for m in (draft, target)]
    if all(vocab) and vocab[0]() != vocab[1]():
        raise ValueError(f"draft model {draft.name!r} and target model {target.name!r} "
                         "have different tokenizers: the draft must share the target's")


def target_memory_fraction(memory_fraction: float, target_block_bytes: int,
                           draft_block_bytes: int, num_shards: int = 1) -> float:
    """The `memory_fraction` to size the target's KV pool with (`ModelRunner`, with the
    draft's weights already placed) so that the draft's cache of as many blocks fits in
    the same memory: the target's share of one block's bytes on its first device (which
    holds 1 / `num_shards` of every target block and the whole draft block)."""
    per_device = target_block_bytes / num_shards
    return memory_fraction * per_device / (per_device + draft_block_bytes)
