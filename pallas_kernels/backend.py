"""Which Pallas backend runs each kernel, per kernel and shape: the one place that
chooses between Mosaic GPU (wgmma + TMA, Hopper) and Triton (Pallas's first GPU backend,
deprecated since jax 0.11.0 but still the faster one on most of our shapes).

A kernel with a Mosaic GPU version asks `choose(kernel, rows)` and runs what it answers.
The table (`TABLE`) holds, per kernel, row ranges and the backend measured faster on
them on an H200 (the figures and the in-run peers: docs/PERF.md, "Mosaic GPU kernels");
a range absent from the table runs Triton. "triton" means today's path for that kernel,
whatever it is made of (for `fp8_matmul`: the Triton few-row kernel where it takes the
rows, else XLA's fp8 dot around a separate quantising pass).

The environment variable `JPREFIX_KERNEL_BACKEND` overrides the table, for comparison:
`triton` or `mosaic` forces every kernel, `fp8_matmul=mosaic,prefill_attention=triton`
forces the kernels named (the rest follow the table). A forced Mosaic choice applies
only where the Mosaic kernel takes the shape (`mosaic_ok`), since the other shapes have
no Mosaic version to run. The variable is read at each call, so a jitted function takes
the value in force when it was traced.
"""

from __future__ import annotations

import dataclasses
import os

ENV_VAR = "JPREFIX_KERNEL_BACKEND"
BACKENDS = ("triton", "mosaic")
KERNELS = ("fp8_matmul", "prefill_attention")


@dataclasses.dataclass(frozen=True)
class Rule:
    """`kernel` runs on `backend` for row counts in [min_rows, max_rows]."""

    kernel: str
    min_rows: int
    max_rows: int
    backend: str


# Measured faster on one H200 (docs/PERF.md, "Mosaic GPU kernels"); Triton elsewhere.
TABLE: tuple[Rule, ...] = ()


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


def table_choice(kernel: str, rows: int, table: tuple[Rule, ...] = TABLE) -> str:
    """The table's backend for `kernel` on `rows` rows ("triton" where no rule covers)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    if rows < 0:
        raise ValueError(f"rows {rows} must be >= 0")
    for rule in table:
        if rule.kernel == kernel and rule.min_rows <= rows <= rule.max_rows:
            return rule.backend
    return "triton"


def choose(kernel: str, rows: int, *, mosaic_ok: bool = True,
           table: tuple[Rule, ...] = TABLE, env: str | None = None) -> str:
    """The backend that runs `kernel` on `rows` rows: the override (`env`, None: the
    environment's `JPREFIX_KERNEL_BACKEND`) where it names the kernel, else the table;
    "triton" whenever the Mosaic kernel does not take the shape (`mosaic_ok` False)."""
    value = os.environ.get(ENV_VAR) if env is None else env
    forced = parse_override(value).get(kernel)
    backend = forced or table_choice(kernel, rows, table)
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
            if (other.kernel == rule.kernel and other.min_rows <= rule.max_rows
                    and rule.min_rows <= other.max_rows):
                raise ValueError(f"rules {other} and {rule} overlap")


_check_table(TABLE)
