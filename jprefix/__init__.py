"""jprefix: a JAX/Pallas LLM inference engine built around prefix (system-prompt) KV caching."""

from jprefix.api import LLM, generate
from jprefix.engine import EngineArgs, LLMEngine
from jprefix.outputs import CompletionOutput, RequestOutput
from jprefix.sampling_params import SamplingParams
from models.loader import LoadedModel, load

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoadedModel",
    "RequestOutput",
    "SamplingParams",
    "generate",
    "load",
]
__version__ = "0.1.0"
