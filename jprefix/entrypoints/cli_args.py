"""`jprefix serve`'s engine flags: one per EngineArgs field, named as vLLM names them
(`max_model_len` -> `--max-model-len`; a bool -> `--flag/--no-flag`), so a field added to
EngineArgs is a flag at once."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jprefix.engine.args import KV_CACHE_DTYPES, QUANTIZATIONS, EngineArgs

DTYPES = ["auto", "float32", "bfloat16", "float16"]
HELP = {
    "dtype": "auto: float32 on the CPU, the checkpoint's dtype or bfloat16 on an accelerator",
    "load_format": "auto, safetensors, gguf or dummy (random weights)",
    "tokenizer": "a tokenizer directory or hub id instead of the checkpoint's (Baichuan2's "
                 "needs one: its own is remote code)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (default: sized from --gpu-memory-utilization)",
    "gpu_memory_utilization": "fraction of free device memory the KV cache may take",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step",
    "max_model_len": "context length (default: the model's, capped to the KV cache)",
    "enable_prefix_caching": "share the KV blocks of common prompt prefixes",
    "enable_chunked_prefill": "split long prompts over several steps",
    "policy": "waiting-queue policy: fcfs, lpm or greedy",
    "attention_backend": "pallas, xla or pallas-interpret (default: pallas on GPU)",
    "unroll_layers": "per-layer weight buffers (default: on GPU)",
    "enable_cascade": "decode attends each shared prefix once per group",
    "disable_hybrid_kv_cache_manager": "a model mixing window and full layers keeps every "
                                       "layer's blocks instead of freeing window blocks",
    "cascade_min_group": "sequences sharing a prefix before cascade attention groups them",
    "cascade_min_blocks": "shared blocks before cascade attention groups them",
    "async_scheduling": "schedule step N+1 while step N runs on the device",
    "seed": "seed of requests that give none",
    "tensor_parallel_size": "devices the weights and KV heads are split over",
    "cpu_num_kv_blocks": "KV-cache blocks where device memory cannot be measured (CPU; "
                         "default: what fits in 1 GiB, at most 4096)",
    "fixed_inputs": "step inputs in device buffers refilled in place (default: where XLA "
                    "records command buffers)",
    "coordinator_address": "multi-host: host:port of process 0's jax.distributed coordinator "
                           "(default: JAX_COORDINATOR_ADDRESS)",
    "num_processes": "multi-host: processes in the run (one per host)",
    "process_id": "multi-host: this process's index; 0 serves HTTP and schedules",
    "distributed_timeout_s": "multi-host: seconds for every process to join, and before a "
                             "silent process stops the run",
    "data_parallel_size": "engine replicas, each on its own --tensor-parallel-size devices",
    "routing_policy": "how requests pick a replica: prefix (cache affinity, least loaded "
                      "otherwise; 'prefix:balance_rel=0.25,balance_abs=2048') or round_robin",
    "kv_cache_dtype": "the KV cache's format: auto = the model dtype; fp8 = fp8_e4m3 "
                      "(per-row scales), fp8_e5m2",
    "quantization": "fp8: the linear layers' weights quantised to fp8 at load time",
    "kv_offloading_size": "GiB of host memory for the prefix cache's host tier (0: off)",
    "kv_offloading_step_tokens": "host tier: the most tokens one step brings back (a request "
                                 "past it starts next step; 0: no bound)",
    "speculative_config": "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'",
}
_TYPES: dict[str, Any] = {"int": int, "int | None": int, "float": float, "float | None": float,
                          "str": str, "str | None": str}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, its default the field's."""
    for f in dataclasses.fields(EngineArgs):
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type)
        kwargs: dict[str, Any] = {"default": f.default, "help": HELP.get(f.name)}
        if kind in ("bool", "bool | None"):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind in _TYPES or f.name == "speculative_config":  # (JSON text)
            kwargs["type"] = _TYPES.get(kind, str)
        else:
            raise TypeError(f"EngineArgs.{f.name}: no command-line type for {kind!r}")
        if f.name == "dtype":
            kwargs["choices"] = DTYPES
        elif f.name == "kv_cache_dtype":
            kwargs["choices"] = KV_CACHE_DTYPES
        elif f.name == "quantization":
            kwargs["choices"] = [q for q in QUANTIZATIONS if q is not None]
        parser.add_argument(flag, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as EngineArgs' (and so LLM's) keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}


def add_fp8_flags(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --quantization as `jprefix serve` takes them (EngineArgs'
    fields), for tools that take no other engine flag (`jprefix generate`, benchmarks)."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help=HELP["kv_cache_dtype"])
    parser.add_argument("--quantization", default=None,
                        choices=[q for q in QUANTIZATIONS if q is not None],
                        help=HELP["quantization"])


def fp8_kwargs(args: argparse.Namespace) -> dict:
    """The two fp8 flags as LLM keyword arguments (and --speculative-config where the
    parser has it: `add_spec_flag`)."""
    return dict(kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                **({} if getattr(args, "speculative_config", None) is None
                   else {"speculative_config": args.speculative_config}))


def add_spec_flag(parser: argparse.ArgumentParser) -> None:
    """--speculative-config (JSON) as `jprefix serve` takes it, for `jprefix generate`
    and the benchmarks."""
    parser.add_argument("--speculative-config", default=None, help=HELP["speculative_config"])
