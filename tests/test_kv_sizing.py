"""KV cache sizing from device memory (`worker.kv_cache.auto_num_blocks`) on a device
whose allocator statistics are given: the cache takes its fraction of the free memory,
never more than the largest free block (its arrays are contiguous)."""

from __future__ import annotations

import jax.numpy as jnp

from jprefix.worker.kv_cache import auto_num_blocks, kv_block_bytes
from models.config import ModelConfig

GB = 2**30


class FakeDevice:
    def __init__(self, **stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def _cfg() -> ModelConfig:
    import jprefix

    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy").config


def test_free_memory_sets_the_block_count():
    cfg = _cfg()
    per_block = kv_block_bytes(cfg, 16, jnp.bfloat16)
    dev = FakeDevice(bytes_limit=100 * GB, bytes_in_use=20 * GB)
    assert auto_num_blocks(cfg, 16, jnp.bfloat16, 0.9, 7, device=dev) == int(
        80 * GB * 0.9) // per_block
    # two shards each hold half of every block
    assert auto_num_blocks(cfg, 16, jnp.bfloat16, 0.9, 7, num_shards=2, device=dev) == int(
        80 * GB * 0.9) // (per_block // 2)


def test_fragmented_memory_sizes_from_the_largest_free_block():
    """Weights replaced after placing (fp8 quantisation) leave holes: 80 GB free in all,
    but no hole above 50 GB; sizing from the total would ask for arrays that cannot be
    placed."""
    cfg = _cfg()
    per_block = kv_block_bytes(cfg, 16, jnp.bfloat16)
    dev = FakeDevice(bytes_limit=100 * GB, bytes_in_use=20 * GB,
                     largest_free_block_bytes=50 * GB)
    blocks = auto_num_blocks(cfg, 16, jnp.bfloat16, 0.9, 7, device=dev)
    assert blocks == int(50 * GB * 0.9) // per_block
    assert blocks * per_block <= 50 * GB


def test_no_device_memory_statistics_takes_the_cpu_default():
    assert auto_num_blocks(_cfg(), 16, jnp.float32, 0.9, 7, device=FakeDevice()) == 7
