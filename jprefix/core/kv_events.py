"""KV cache events in vLLM's format (pure Python): BlockStored, BlockRemoved and
AllBlocksCleared, each naming its tier in `medium` ("GPU": the device's HBM pool, also on
the CPU backend; "CPU": the host tier), for prefix-cache-aware routers (llm-d's precise
mode) that track which replica holds which block.

A block is named by its chained `prefix_hash` (`prefix_trie.block_hash`: the parent's
hash and the block's tokens, from the cache salt's root), the same in both tiers;
`parent_block_hash` is None for a first block. The prefix cache and the host pool append
to one `KVEventSink` as their blocks change; the engine drains it after every step
(`engine/kv_events.py` publishes the batch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

GPU, CPU = "GPU", "CPU"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def as_array(event: KVEvent) -> list:
    """vLLM's wire form of an event (a tagged, array-like msgspec struct): the class name,
    then the fields in order."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                event.block_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


class KVEventSink:
    """The events since the last `drain`, and running counts of blocks stored and removed
    per medium (what a subscriber replaying the events must arrive at)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self.stored: Counter[str] = Counter()
        self.removed: Counter[str] = Counter()
        self.cleared = 0

    def stored_block(self, prefix_hash: int, parent_hash: int | None, tokens: tuple,
                     medium: str) -> None:
        self._events.append(BlockStored([prefix_hash], parent_hash, list(tokens),
                                        self.block_size, None, medium))
        self.stored[medium] += 1

    def removed_blocks(self, hashes: list[int], medium: str) -> None:
        if hashes:
            self._events.append(BlockRemoved(hashes, medium))
            self.removed[medium] += len(hashes)

    def all_cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self.cleared += 1

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
