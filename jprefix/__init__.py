"""jprefix: a JAX/Pallas LLM inference engine built around prefix (system-prompt) KV caching.

The public names load lazily (PEP 562): `import jprefix` imports neither jax nor the
engine, and changes no environment variable. `jprefix.core` (the host side) never
imports jax at all; the XLA flags the engine needs are set when a model runner is built
(`jprefix.worker.xla_flags`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jprefix.core.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
    from jprefix.core.sampling_params import SamplingParams
    from jprefix.core.structured_outputs import StructuredOutputsParams
    from jprefix.engine.args import EngineArgs
    from jprefix.engine.llm_engine import LLMEngine
    from jprefix.entrypoints.llm import LLM, generate, load
    from models.loader import LoadedModel

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "jprefix.entrypoints.llm",
    "generate": "jprefix.entrypoints.llm",
    "EngineArgs": "jprefix.engine.args",
    "LLMEngine": "jprefix.engine.llm_engine",
    "CompletionOutput": "jprefix.core.outputs",
    "Logprob": "jprefix.core.outputs",
    "RequestOutput": "jprefix.core.outputs",
    "RequestOutputKind": "jprefix.core.outputs",
    "SamplingParams": "jprefix.core.sampling_params",
    "StructuredOutputsParams": "jprefix.core.structured_outputs",
    "LoadedModel": "models.loader",
    "load": "jprefix.entrypoints.llm",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoadedModel",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "generate",
    "load",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jprefix' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (later lookups skip this function)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
