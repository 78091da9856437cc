"""Which Pallas backend runs each kernel, per kernel and shape: the one place that
chooses between Mosaic GPU (wgmma + TMA, Hopper) and Triton (Pallas's first GPU backend,
deprecated since jax 0.11.0 but still the faster one on most of our shapes).

A kernel with a Mosaic GPU version asks `choose(kernel, rows, k=..., n=...)` and runs
what it answers. The table (`TABLE`) holds, per kernel, row ranges (optionally for one
K x N operand shape) and the backend measured faster there on an H200 (the figures and
the in-run peers: docs/PERF.md, "Mosaic GPU kernels"); whatever no rule covers runs
Triton. "triton" means today's path for that kernel, whatever it is made of (for
`fp8_matmul`: the Triton few-row kernel where it takes the rows, else XLA's fp8 dot
between a quantising and a scaling fusion; for `prefill_attention`: the Triton
`paged_attention` / `mixed_paged_attention` of a step that is not pure decode). Two
kernels have a Mosaic GPU version: the fp8 matmul and prefill attention
(`mgpu_paged_prefill`, rows = the step's query tokens).

The environment variable `JPREFIX_KERNEL_BACKEND` overrides the table, for comparison:
`triton` or `mosaic` forces every kernel, `fp8_matmul=mosaic` (comma-separated
`kernel=backend` items) the kernels named, the rest following the table. A forced Mosaic
choice applies only where the Mosaic kernel can run the shape here (`mosaic_ok`: a
Hopper GPU, the kernel's shape constraints). The variable is read at each call, so a
jitted function takes the value in force when it was traced.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

ENV_VAR = "JPREFIX_KERNEL_BACKEND"
BACKENDS = ("triton", "mosaic")
KERNELS = ("fp8_matmul", "prefill_attention")  # the kernels with a Mosaic GPU version


@dataclasses.dataclass(frozen=True)
class Rule:
    """`kernel` runs on `backend` for row counts in [min_rows, max_rows] and, where `k`
    / `n` are given, only for that contraction size / output columns."""

    kernel: str
    min_rows: int
    max_rows: int
    backend: str
    k: int | None = None
    n: int | None = None

    def covers(self, kernel: str, rows: int, k: int | None, n: int | None) -> bool:
        return (self.kernel == kernel and self.min_rows <= rows <= self.max_rows
                and self.k in (None, k) and self.n in (None, n))


# Measured faster on one H200 (docs/PERF.md, "Mosaic GPU kernels"); Triton elsewhere.
# fp8_matmul: the Mosaic kernel (activations quantised by XLA as today, both scales in
# its epilogue) beat today's path only on Llama-2-7B's o projection at 4,096 rows (107
# against 117 us); it tied or lost on every other projection and row count measured.
# prefill_attention: the Mosaic kernel beat Triton's on both shapes measured, causal
# 8 x 2,048 (16,384 rows: 0.590 against 0.767 ms) and prefix-cached 64 x (596 + 104)
# (6,656 rows: 0.261 against 0.316 ms), ALiBi included; steps of fewer rows (mostly
# decode-heavy mixed steps) are unmeasured and stay on Triton.
TABLE: tuple[Rule, ...] = (
    Rule("fp8_matmul", 4096, 4096, "mosaic", k=4096, n=4096),
    Rule("prefill_attention", 4096, 1 << 30, "mosaic"),
)


# the jax whose Mosaic GPU lowering the kernels were built and measured with
MOSAIC_MIN_JAX = (0, 11, 2)


def mosaic_available() -> bool:
    """Whether Mosaic GPU kernels can run here: a Hopper GPU (compute capability 9.0)
    is the default device and jax is at least MOSAIC_MIN_JAX."""
    import jax

    version = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
    if jax.default_backend() != "gpu" or version < MOSAIC_MIN_JAX:
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


def parse_override(value: str | None) -> dict[str, str]:
    """The kernels an override value forces, kernel -> backend ({} for None or "").
    Raises ValueError naming a backend or kernel it does not know."""
    if not value:
        return {}
    value = value.strip()
    if value in BACKENDS:
        return dict.fromkeys(KERNELS, value)
    forced = {}
    for item in value.split(","):
        kernel, sep, backend = (part.strip() for part in item.partition("="))
        if not sep or kernel not in KERNELS or backend not in BACKENDS:
            raise ValueError(
                f"{ENV_VAR}={value!r}: {item!r} is not 'kernel=backend' with kernel one of "
                f"{KERNELS} and backend one of {BACKENDS} (or give one backend for all)")
        forced[kernel] = backend
    return forced


def table_choice(kernel: str, rows: int, table: tuple[Rule, ...] = TABLE, *,
                 k: int | None = None, n: int | None = None) -> str:
    """The table's backend for `kernel` on `rows` rows of a K x N operand ("triton"
    where no rule covers)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    if rows < 0:
        raise ValueError(f"rows {rows} must be >= 0")
    for rule in table:
        if rule.covers(kernel, rows, k, n):
            return rule.backend
    return "triton"


def choose(kernel: str, rows: int, *, k: int | None = None, n: int | None = None,
           mosaic_ok: bool = True, table: tuple[Rule, ...] = TABLE,
           env: str | None = None) -> str:
    """The backend that runs `kernel` on `rows` rows (of a K x N operand, where the
    table has shape rules): the override (`env`, None: the environment's
    `JPREFIX_KERNEL_BACKEND`) where it names the kernel, else the table; "triton"
    whenever the Mosaic kernel cannot run the shape here (`mosaic_ok` False)."""
    value = os.environ.get(ENV_VAR) if env is None else env
    forced = parse_override(value).get(kernel)
    backend = forced or table_choice(kernel, rows, table, k=k, n=n)
    return backend if mosaic_ok else "triton"


def _check_table(table: tuple[Rule, ...]) -> None:
    """Raises ValueError on a rule with an unknown kernel or backend, an empty range,
    or two overlapping ranges of one kernel."""
    for i, rule in enumerate(table):
        if rule.kernel not in KERNELS or rule.backend not in BACKENDS:
            raise ValueError(f"rule {rule}: kernel must be one of {KERNELS} and backend "
                             f"one of {BACKENDS}")
        if not 0 <= rule.min_rows <= rule.max_rows:
            raise ValueError(f"rule {rule}: needs 0 <= min_rows <= max_rows")
        for other in table[:i]:
            if _overlap(other, rule):
                raise ValueError(f"rules {other} and {rule} overlap")


def _overlap(a: Rule, b: Rule) -> bool:
    """Whether some call would match both rules."""
    def same(x, y):
        return x is None or y is None or x == y

    return (a.kernel == b.kernel and a.min_rows <= b.max_rows and b.min_rows <= a.max_rows
            and same(a.k, b.k) and same(a.n, b.n))


_check_table(TABLE)


def fp8_matmul_mosaic(x2, w8, w_scale, quantize: Callable):
    """x2 [M, K] bf16 @ the fp8 weight w8 [N, K] (per-channel scales w_scale [N]) by the
    Mosaic GPU kernel, bf16 [M, N], where the table chooses Mosaic for the shape and the
    kernel can run it; else None (the caller runs today's path). `quantize` maps x2 to
    (fp8 x2, row scales [M, 1]): `models.fp8_linear.quantize_activations`, the engine's
    arithmetic, injected (pallas_kernels do not import models)."""
    import jax.numpy as jnp

    (m, k), n = x2.shape, w8.shape[0]
    if x2.dtype != jnp.bfloat16 or choose("fp8_matmul", m, k=k, n=n,
                                          mosaic_ok=mosaic_available()) != "mosaic":
        return None
    from pallas_kernels import mgpu_fp8_matmul as mgpu  # (Mosaic GPU's package needs absl)

    if not mgpu.takes(k, n):
        return None
    x8, row_scale = quantize(x2)
    return mgpu.mgpu_fp8_matmul(x8, w8, w_scale, quant="pre", x_scale=row_scale[:, 0],
                                config=mgpu.ENGINE_CONFIG)


def prefill_attention_mosaic(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens,
                             *, scale: float, num_decode=None, alibi_slopes=None,
                             sliding_window=None, k_scale=None, v_scale=None):
    """A step's paged attention (`paged_attention`'s arguments and contract, causal) by
    the Mosaic GPU prefill kernel, [T, H, D], where the table (or the override) chooses
    Mosaic for T rows and the kernel takes the call (`mgpu_paged_prefill.takes`: bf16,
    D = 128, no fp8 cache (`k_scale`, `v_scale`), no window); else None (the caller runs
    today's path).

    `num_decode` (int32 scalar, or None): the step's first num_decode sequences are
    one-row decodes (`mixed_paged_attention`'s contract). Those rows run the Triton
    decode tiling, as in `mixed_paged_attention`, and the other sequences the Mosaic
    kernel: a decode row would take a 64-row tile per head of its own."""
    if choose("prefill_attention", q.shape[0], mosaic_ok=mosaic_available()) != "mosaic":
        return None
    from pallas_kernels import mgpu_paged_prefill as mgpu  # (Mosaic GPU's package needs absl)

    if not mgpu.takes(q, k_cache, scale=scale, k_scale=k_scale,
                      sliding_window=sliding_window):
        return None
    prefill = functools.partial(mgpu.mgpu_paged_prefill, scale=scale,
                                alibi_slopes=alibi_slopes, config=mgpu.ENGINE_CONFIG)
    args = (q, k_cache, v_cache, layer, block_tables)
    if num_decode is None:
        return prefill(*args, kv_lens, cu_q_lens)
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention

    t, num_seqs = q.shape[0], kv_lens.shape[0]
    decoding = jnp.arange(num_seqs) < num_decode
    rows = min(t, num_seqs)  # the decode rows come first: 0:num_decode within 0:S
    out_decode = paged_attention(  # later sequences: no rows, no keys
        q[:rows], *args[1:], jnp.where(decoding, kv_lens, 0),
        jnp.minimum(cu_q_lens, num_decode), scale=scale, max_q_len=1,
        alibi_slopes=alibi_slopes)
    out = prefill(*args, jnp.where(decoding, 0, kv_lens),  # rows 0:num_decode: none
                  jnp.maximum(cu_q_lens, num_decode))
    decode_rows = (jnp.arange(rows) < num_decode)[:, None, None]
    return out.at[:rows].set(jnp.where(decode_rows, out_decode, out[:rows]))
