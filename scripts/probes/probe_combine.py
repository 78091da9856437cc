"""Probe: how many kernels XLA makes of the paged attention's split combine, and their
time, for three formulations of the same function (GPU; runs anywhere).

The attention kernel's key splits leave float32 partials o [S, rows, D], m and denom
[S, rows]; `combine_splits` merges them (S = 4, 16,384 rows at the time-to-first-token
step's shape). Tried here: the shipped reduction over the split axis, the splits
unrolled into elementwise ops, and one einsum over precomputed weights. Each prints its
largest difference from the shipped one (bfloat16 outputs).

    python scripts/probes/probe_combine.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention_kernel import combine_splits

SHAPES = ((4, 4096 * 4), (8, 512), (4, 8192))  # (splits, rows): TTFT, batch-1 decode, ...


def unrolled(o, m, denom, num_rows, dtype):
    """The splits as separate elementwise terms (no reduction over the split axis)."""
    s = o.shape[0]
    o, m, denom = o[:, :num_rows], m[:, :num_rows], denom[:, :num_rows]
    m_max = functools.reduce(jnp.maximum, [m[i] for i in range(s)])
    w = [jnp.exp2(m[i] - m_max) for i in range(s)]
    total = functools.reduce(jnp.add, [denom[i] * w[i] for i in range(s)])
    acc = functools.reduce(jnp.add, [o[i] * w[i][:, None] for i in range(s)])
    return (acc / jnp.where(total == 0.0, 1.0, total)[:, None]).astype(dtype)


def weighted(o, m, denom, num_rows, dtype):
    """Normalized weights [S, rows] first, then one weighted sum over the splits."""
    o, m, denom = o[:, :num_rows], m[:, :num_rows], denom[:, :num_rows]
    w = jnp.exp2(m - m.max(axis=0))
    inv = 1.0 / jnp.maximum((denom * w).sum(axis=0), 1e-30)
    return jnp.einsum("srd,sr->rd", o, w * inv[None]).astype(dtype)


def kernels(fn, *args) -> int:
    """Fusions and custom calls in the compiled module's entry computation."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return sum(" fusion(" in line or "custom-call(" in line for line in entry.splitlines())


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # (--help)
    rng = np.random.default_rng(0)
    for s, rows in SHAPES:
        o = jnp.asarray(rng.standard_normal((s, rows, 128)), jnp.float32)
        m = jnp.asarray(rng.standard_normal((s, rows)), jnp.float32)
        den = jnp.asarray(rng.random((s, rows)) + 0.1, jnp.float32)
        ref = None
        for name, fn in (("reduce", combine_splits), ("unrolled", unrolled),
                         ("weighted", weighted)):
            f = jax.jit(functools.partial(fn, num_rows=rows, dtype=jnp.bfloat16))
            out = f(o, m, den).block_until_ready().astype(jnp.float32)
            ref = out if ref is None else ref
            err = float(jnp.max(jnp.abs(out - ref)))
            n = 200
            t = time.perf_counter()
            for _ in range(n):
                r = f(o, m, den)
            r.block_until_ready()
            us = (time.perf_counter() - t) / n * 1e6
            print(f"S={s} rows={rows} {name:9s} kernels {kernels(f, o, m, den)} "
                  f"max|diff| {err:.3g} us/call {us:.1f}")


if __name__ == "__main__":
    main()
