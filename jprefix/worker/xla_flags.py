"""The one place jprefix reads and sets XLA's flags.

Three settings differ from XLA's defaults, each with an environment variable to keep XLA's:

- Command buffers (CUDA graphs) off. XLA:GPU records a step's kernels into command
  buffers and records them again whenever one of the step's buffers moves, which happens
  on every engine step; the recording delays the launch, while a plain launch lets the
  first kernels run while the rest are issued. `JPREFIX_XLA_COMMAND_BUFFERS=1`, or the
  flag set in XLA_FLAGS by the user, keeps XLA's behaviour; the runner then refills each
  step's inputs in place (`model_runner.FixedInputs`) so a replay moves few buffers.
- The rematerialization pass off for the step. XLA:GPU weighs the step's memory against
  a limit that the donated KV cache already fills, so it recomputes work (whole Q/K/V
  matmuls) to save bytes that are never short: the default cache size leaves gigabytes
  for temporaries. `JPREFIX_XLA_REMAT=1` keeps the pass, for engines sized near the limit.
- For a step over fp8 weights, XLA's Triton GEMM emitter off (`step_compiler_options(
  fp8_weights=True)`, that step's compile only): XLA autotunes each fp8 dot fusion over
  Triton tilings, compiling a kernel per candidate, which keeps a 7B model's engine in
  its first compiles for minutes; cuBLASLt's fp8 GEMMs need no such search (docs/PERF.md,
  fp8). A `--xla_gpu_enable_triton_gemm=` in XLA_FLAGS, or JPREFIX_XLA_TRITON_GEMM=1,
  keeps XLA's choice.

XLA parses XLA_FLAGS once, when jax initialises its backend, so `apply()` takes effect
only if it runs before the process's first jax computation or device query. The
entrypoints that load a model (`jprefix.load`, `LLM`, `generate`, the CLI) call it first;
`import jprefix` changes no environment variable.
"""

from __future__ import annotations

import os

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="
TRITON_GEMM_FLAG = "--xla_gpu_enable_triton_gemm="


def apply() -> None:
    """Turns XLA:GPU's command buffers off in XLA_FLAGS, unless the user set the flag or
    JPREFIX_XLA_COMMAND_BUFFERS=1. Idempotent."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JPREFIX_XLA_COMMAND_BUFFERS") == "1" or COMMAND_BUFFER_FLAG in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}".strip()


def command_buffers_on() -> bool:
    """Whether XLA:GPU records jitted steps into command buffers: the last
    `--xla_gpu_enable_command_buffer=` in XLA_FLAGS decides; absent, XLA's default (on)."""
    value = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith(COMMAND_BUFFER_FLAG):
            value = flag.split("=", 1)[1]
    return value != ""


def step_compiler_options(xla_flags: str | None = None, keep_remat: bool | None = None,
                          fp8_weights: bool = False) -> dict[str, str | bool]:
    """XLA options for the jitted step: the rematerialization pass disabled, along with any
    passes XLA_FLAGS already disables (the option replaces the flag's list), unless
    `keep_remat` (default: JPREFIX_XLA_REMAT=1); with `fp8_weights`, also XLA's Triton
    GEMMs off, unless XLA_FLAGS sets them or JPREFIX_XLA_TRITON_GEMM=1 (module docstring)."""
    if xla_flags is None:
        xla_flags = os.environ.get("XLA_FLAGS", "")
    if keep_remat is None:
        keep_remat = os.environ.get("JPREFIX_XLA_REMAT") == "1"
    options: dict[str, str | bool] = {}
    if not keep_remat:
        passes = ["rematerialization"]
        for flag in xla_flags.split():
            if flag.startswith("--xla_disable_hlo_passes="):
                passes += [p for p in flag.split("=", 1)[1].split(",") if p]
        options["xla_disable_hlo_passes"] = ",".join(dict.fromkeys(passes))
    if (fp8_weights and TRITON_GEMM_FLAG not in xla_flags
            and os.environ.get("JPREFIX_XLA_TRITON_GEMM") != "1"):
        options["xla_gpu_enable_triton_gemm"] = False
    return options
