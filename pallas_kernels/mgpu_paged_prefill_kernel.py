"""The Mosaic GPU kernel behind `mgpu_paged_prefill.mgpu_paged_prefill` (its module
docstring has the design): the CTA's shared memory and barriers (`kernel`), the producer
warpgroup's page copies (`_produce`), a consumer warpgroup's online softmax over the key
steps (`_consume`) and its ragged store (`_store_rows`).

`cfg` is an `MgpuPrefillConfig` (block_kv, max_stages, compute_wgs, pingpong).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BF16 = jnp.dtype(jnp.bfloat16)
HEAD_DIM = 128
ROWS = 64  # query rows per consumer warpgroup (wgmma's M)
LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite: a row that sees no key in a step never computes inf - inf


def _swizzled(rows_shape: tuple[int, ...]) -> plgpu.SMEM:
    """A bf16 shared-memory tile laid out for wgmma: 8 x 64 tiles, 128-byte swizzle."""
    return plgpu.SMEM(rows_shape, BF16, transforms=(
        plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def kernel(meta_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, *refs, cfg, scale: float,
           group: int, alibi: bool):
    """One CTA: tile x query head. refs = ([slopes [H]],) out [Tp, H, D]."""
    slopes_ref, o_ref = (refs[0], refs[1]) if alibi else (None, refs[0])
    c = cfg
    wgs, stages, pages = c.compute_wgs, c.max_stages, c.block_kv // k_ref.shape[3]

    def scoped(q_smem, k_smem, v_smem, o_smem, k_full, v_full, q_full, k_free, v_free,
               turn):
        tile, head = lax.axis_index("tile"), lax.axis_index("head")
        wg = lax.axis_index("wg")
        seq, row8, lo, n = (meta_ref[tile, i] for i in range(4))
        pos0, kv_len = meta_ref[tile, 4], meta_ref[tile, 5]
        first_pos = pos0 + lo  # the first valid row's position
        kv_hi = lax.max(lax.min(first_pos + n, kv_len), 0)
        max_steps = bt_ref.shape[1] // pages
        n_steps = lax.min(lax.div(kv_hi + (c.block_kv - 1), c.block_kv), max_steps)
        # steps below n_full hold keys <= first_pos: every valid row sees them whole
        n_full = lax.min(lax.div(lax.max(first_pos + 1, 0), c.block_kv), n_steps)
        kv_head = lax.div(head, group)
        tiles = _TileRefs(q_smem, k_smem, v_smem, o_smem, k_full, v_full, q_full, k_free,
                          v_free, turn)

        @pl.when(n > 0)
        def _live():
            @pl.when(wg == wgs)
            def _producer():
                if wgs == 2:
                    plgpu.set_max_registers(40, action="decrease")
                _produce(tiles, bt_ref, k_ref, v_ref, layer_ref[0], kv_head, seq, n_steps,
                         stages=stages, pages=pages)

            @pl.when(wg < wgs)
            def _consumer():
                if wgs == 2:
                    plgpu.set_max_registers(232, action="increase")
                slope = slopes_ref[head] if alibi else None
                rows = (row8 * 8 + wg * ROWS, lo - wg * ROWS, n)  # (this wg's)
                _consume(tiles, q_ref, o_ref, wg, head, rows, pos0 + wg * ROWS, n_steps,
                         n_full, c=c, scale=scale, slope=slope)

    ring = (stages, c.block_kv, HEAD_DIM)
    pl.run_scoped(
        scoped,
        _swizzled((wgs, ROWS, HEAD_DIM)), _swizzled(ring), _swizzled(ring),
        plgpu.SMEM((wgs, ROWS, HEAD_DIM), BF16),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        plgpu.Barrier(num_barriers=wgs),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs) if c.pingpong else None,
        collective_axes="wg",
    )


@dataclasses.dataclass(frozen=True)
class _TileRefs:
    """The CTA's shared memory and barriers: Q and output tiles per consumer, the K/V
    rings, per slot a 'full' barrier (its pages landed) and a 'free' one (every consumer
    released it), one Q barrier per consumer, and the ping-pong turn barrier."""

    q: object
    k: object
    v: object
    o: object
    k_full: object
    v_full: object
    q_full: object
    k_free: object
    v_free: object
    turn: object


def _produce(t: _TileRefs, bt_ref, k_ref, v_ref, layer, kv_head, seq, n_steps, *,
             stages: int, pages: int):
    """The producer warpgroup: TMA-copies step j's pages into slot j % stages, waiting
    for the slot to be released (steps >= stages)."""
    b = k_ref.shape[3]

    def issue(step, slot, wait: bool):
        ids = [bt_ref[seq, step * pages + p] for p in range(pages)]
        for cache, smem, full, free in ((k_ref, t.k, t.k_full, t.k_free),
                                        (v_ref, t.v, t.v_full, t.v_free)):
            if wait:
                plgpu.barrier_wait(free.at[slot])
            for p, page in enumerate(ids):
                plgpu.copy_gmem_to_smem(cache.at[layer, kv_head, page],
                                        smem.at[slot, pl.ds(p * b, b)], full.at[slot])

    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(issue, i, i, False))

    @pl.loop(stages, lax.max(n_steps, stages))
    def _refill(step):
        issue(step, lax.rem(step, stages), True)


def _row_vec(value: float):
    """[64] float32 `value` in the layout of a wgmma tile's row reductions."""
    return plgpu.layout_cast(jnp.full((ROWS,), value, jnp.float32),
                             plgpu.Layout.WGMMA.reduce(1))


def _consume(t: _TileRefs, q_ref, o_ref, wg, head, rows, q_pos0, n_steps, n_full, *, c,
             scale: float, slope):
    """Consumer warpgroup `wg`: query rows row0 .. row0 + 63 (row0 a multiple of 8) of
    head `head` over the tile's key steps, row i at position q_pos0 + i; stores its rows
    i in [lo, lo + n) (`rows` = (row0, lo, n), lo may be negative)."""
    row0, lo, n = rows
    q_smem = t.q.at[wg]
    q_rows = q_ref.at[pl.ds(row0, ROWS), pl.ds(head * HEAD_DIM, HEAD_DIM)]  # q: [Tp, H*D]
    plgpu.copy_gmem_to_smem(q_rows, q_smem, t.q_full.at[wg])
    plgpu.barrier_wait(t.q_full.at[wg])
    unit = scale * LOG2E
    turn = t.turn if c.pingpong else None
    if turn is not None:  # consumer 1 starts a turn behind: consumer 0 goes first
        pl.when(wg == 1)(functools.partial(_sync, turn))

    def step(j, carry, masked: bool):
        acc, m_i, l_i = carry
        slot = lax.rem(j, c.max_stages)
        plgpu.barrier_wait(t.k_full.at[slot])

        def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(t.k.at[slot], (1, 0)))
            if turn is not None:  # the other consumer's turn on the tensor cores
                _sync(turn)
            return acc_ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, c.block_kv), jnp.float32))
        plgpu.barrier_arrive(t.k_free.at[slot])
        if slope is not None or masked:
            shape = (ROWS, c.block_kv)
            k_pos = j * c.block_kv + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                            layout=plgpu.Layout.WGMMA)
            if slope is not None:  # slope * (k_pos - q_pos) over the scale (unit folds it
                # in), less slope * (q_pos - q_pos0): a row's constant, which its softmax
                # ignores, and the terms stay small near the diagonal
                s = s + (k_pos - q_pos0).astype(jnp.float32) * (slope / scale)
            if masked:
                q_pos = q_pos0 + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                                        layout=plgpu.Layout.WGMMA)
                s = jnp.where(q_pos >= k_pos, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1) * unit)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s * unit - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p16 = p.astype(BF16)
        if turn is not None:  # softmax done: wait for the tensor cores' turn
            plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(t.v_full.at[slot])
        if turn is not None:
            plgpu.barrier_wait(turn)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, t.v.at[slot])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(t.v_free.at[slot])
        return acc, m_new, l_i

    carry = (plgpu.layout_cast(jnp.zeros((ROWS, HEAD_DIM), jnp.float32), plgpu.Layout.WGMMA),
             _row_vec(_M_INIT), _row_vec(0.0))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, _, l_i = lax.fori_loop(n_full, n_steps, functools.partial(step, masked=True), carry)
    if turn is not None:  # consumer 0 takes the turn consumer 1 took at the start
        pl.when(wg == 0)(functools.partial(_sync, turn))
    # a row with no key (a padding row: kv_len 0) has acc = 0 and l = 0: it stores 0
    out = acc / lax.broadcast_in_dim(jnp.maximum(l_i, _row_vec(1e-30)), acc.shape, [0])
    t.o[wg] = out.astype(BF16)
    plgpu.commit_smem()
    first = lax.max(lo, 0)
    _store_rows(t.o.at[wg], o_ref, row0, head, first, lax.max(lax.min(lo + n, ROWS) - first, 0))


def _sync(barrier):
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _store_rows(o_smem, o_ref, row0, head, start, n):
    """o_smem's rows start .. start + n - 1 (0 <= n <= 64 - start) to o_ref's rows
    row0 + start .. of `head`: TMA stores of 64, 32, ..., 1 rows, the sizes of n's set
    bits (a TMA box's shape is static)."""
    size = ROWS
    while size:
        @pl.when(n & size != 0)
        def _(start=start, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                                    o_ref.at[pl.ds(row0 + start, size), head])

        start = start + (n & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0)
