"""EngineArgs: the engine's knobs, named as vLLM names them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from jprefix.core.routing import parse_routing_policy
from jprefix.core.spec_config import SpeculativeConfig
from jprefix.engine.kv_events import parse_config as parse_kv_events

_CHECKPOINT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
# the KV cache's number format: "auto" = the model's dtype; "fp8" = "fp8_e4m3" (as vLLM)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# weight quantisation: None (the model's dtype) or "fp8" (e4m3, quantised at load)
QUANTIZATIONS = (None, "fp8")


def resolve_dtype(dtype: Any, model: Any = None) -> Any:
    """The concrete dtype "auto" stands for, any other value unchanged (the loader parses it).

    "auto": float32 when jax computes on the CPU (XLA:CPU converts every bf16 matmul to
    float32, which makes bf16 several times slower there); on an accelerator the
    checkpoint's own `torch_dtype` when `model` is a Hugging Face directory that names a
    float dtype, else bfloat16. Reading the backend initialises jax: call it after the XLA
    flags are set (`worker.xla_flags.apply`).
    """
    if not (isinstance(dtype, str) and dtype.lower() == "auto"):
        return dtype
    import jax

    if jax.default_backend() == "cpu":
        return "float32"
    return _checkpoint_dtype(model) or "bfloat16"


def _checkpoint_dtype(model: Any) -> str | None:
    """The float dtype a checkpoint directory's config.json names (torch_dtype or dtype)."""
    if not isinstance(model, str | os.PathLike):
        return None
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # the loader reports a broken config with its own message
    named = raw.get("torch_dtype") or raw.get("dtype")
    return _CHECKPOINT_DTYPES.get(str(named).removeprefix("torch."))


@dataclasses.dataclass
class EngineArgs:
    """Engine knobs, named as vLLM names them. `dtype`, `load_format` and `tokenizer`
    apply when the engine loads its model by name (`models.loader.load`); `dtype="auto"`
    is resolved by `resolve_dtype`. `max_model_len` (None: the model's own) must fit in
    the KV cache."""

    dtype: str = "auto"
    load_format: str = "auto"
    # a tokenizer directory or hub id instead of the checkpoint's (Baichuan2's own needs
    # remote code: models.loader.load); None: the checkpoint's, if it has one
    tokenizer: str | None = None
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; fp8: per-row scales (pallas_kernels/fp8)
    quantization: str | None = None  # QUANTIZATIONS; "fp8": the linear layers' weights
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # "pallas" | "xla" | "pallas-interpret": the attention kernels, and on few-row steps
    # the few-row matmuls (jprefix.worker.step); None: Pallas on GPU, XLA elsewhere
    attention_backend: str | None = None
    unroll_layers: bool | None = None  # None: unrolled on GPU, one lax.scan elsewhere
    enable_cascade: bool = True  # decode attends each shared prefix once per group
    # a model mixing window and full layers keeps every layer's blocks (one table), not
    # a table per layer group with window blocks freed (core.kv_groups); vLLM's name
    disable_hybrid_kv_cache_manager: bool = False
    cascade_min_group: int = 8  # sequences sharing a prefix before a group pays off
    cascade_min_blocks: int = 4  # shared blocks before a group pays off
    # Schedule and dispatch step N+1 before step N's tokens reach the host, so the host
    # work of a step overlaps the device's; a stop found one step late costs one slot.
    async_scheduling: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1  # devices the weights and KV heads are split over
    # engine replicas, each on its own tensor_parallel_size devices, behind one front
    # (jprefix.engine.dp_engine); routing_policy: jprefix.core.routing's spec
    data_parallel_size: int = 1
    routing_policy: str = "prefix"
    # KV blocks where device memory cannot be measured (CPU); None: as many as fit in
    # 1 GiB, at most 4,096 (a laptop's default must not zero gigabytes at start-up)
    cpu_num_kv_blocks: int | None = None
    # step inputs in device buffers refilled in place (model_runner.FixedInputs); None:
    # where XLA records command buffers (jprefix.worker.xla_flags)
    fixed_inputs: bool | None = None
    # Multi-host (jprefix.worker.multihost, through jax.distributed): None leaves a value
    # to JAX (JAX_COORDINATOR_ADDRESS, or a cluster it detects); one process without them.
    coordinator_address: str | None = None  # host:port of process 0's coordinator
    num_processes: int | None = None
    process_id: int | None = None
    distributed_timeout_s: int = 60  # for every process to join; for a silent process
    # The prefix cache's host-memory tier (jprefix.engine.kv_tier), GiB of host memory
    # per replica (vLLM's --kv-offloading-size); 0: off
    kv_offloading_size: float = 0.0
    # the most tokens the host tier brings back in one step (a request whose loads would
    # pass it starts the next step; a step's first load always goes): in-stream loads run
    # before the step, so one step carrying a whole round's loads delays each of its
    # first tokens. 0: no bound
    kv_offloading_step_tokens: int = 0
    # a prefix cache saved by LLM.save_prefix_cache, loaded into the host tier at start
    # (a tier just large enough is made when kv_offloading_size is 0)
    prefix_cache_path: str | None = None
    # vLLM's KVEventsConfig as JSON (jprefix.engine.kv_events): KV cache events over ZMQ
    kv_events_config: str | None = None
    # vLLM's speculative_config (a dict, its JSON, or a `core.spec_config.SpeculativeConfig`;
    # parsed into the latter): "ngram" (prompt lookup) or "draft_model". None: off
    speculative_config: Any = None

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of "
                             f"{', '.join(map(str, QUANTIZATIONS))}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size {dp!r} must be a positive int")
        parse_routing_policy(self.routing_policy)  # ValueError naming a bad spec
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not (
                0 <= self.process_id < (self.num_processes or self.process_id + 1)):
            raise ValueError(f"process_id {self.process_id} is outside [0, num_processes="
                             f"{self.num_processes})")
        if self.distributed_timeout_s < 1:
            raise ValueError(f"distributed_timeout_s must be >= 1, got "
                             f"{self.distributed_timeout_s}")
        parse_kv_events(self.kv_events_config)  # ValueError naming a bad config
        self.speculative_config = spec = SpeculativeConfig.parse(self.speculative_config)
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if spec is not None and spec.method == "draft_model" and getattr(self, name) > 1:
                raise ValueError(f"speculative_config draft_model with {name} "
                                 f"{getattr(self, name)} is not supported (the draft runs on "
                                 "one device, in one replica)")
        if self.kv_offloading_step_tokens < 0:
            raise ValueError(f"kv_offloading_step_tokens must be >= 0, got "
                             f"{self.kv_offloading_step_tokens}")
        if not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got "
                             f"{self.kv_offloading_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization {self.gpu_memory_utilization} is outside (0, 1]"
            )
