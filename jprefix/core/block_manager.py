"""BlockManager: physical KV-cache blocks, reference counts and the free/LRU list.

Block 0 is the reserved null block (padding writes there) and is never handed out. Every
other block is either used (ref count > 0) or in the free list. The free list is also the
LRU order of unreferenced cached blocks: a released block that still holds a cached
prefix goes to the tail and stays matchable; a plain free block goes to the head.
Allocation pops the head, so uncached blocks are reused first and cached ones in LRU
order; a cached block is evicted from the prefix trie (through `on_evict`) on reuse.
Sequences release their blocks in reverse order, so a block's cached descendants always
sit nearer the head than the block itself: eviction takes trie leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

NULL_BLOCK = 0


class BlockManager:
    """Ref-counted physical blocks with O(1) allocate / incref / decref / evict."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: set[int] = set()  # blocks that are prefix-trie nodes
        self._num_evictable = 0  # cached blocks in the free list
        self._on_evict: Callable[[int], None] = lambda block: None

    def set_evictor(self, on_evict: Callable[[int], None]) -> None:
        """`on_evict(block)` is called when a cached free block is reused."""
        self._on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: plain free + evictable cached."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix."""
        return self._num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes n blocks from the head of the free list (evicting cached ones), ref 1."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        return [self._pop_free() for _ in range(n)]

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        if block in self._cached:
            self._cached.discard(block)
            self._num_evictable -= 1
            self._on_evict(block)
        self._ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
            self._num_evictable -= block in self._cached
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise RuntimeError(f"block {block} released more times than it was taken")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None  # tail: most recently used
            if block in self._cached:
                self._num_evictable += 1
            else:
                self._free.move_to_end(block, last=False)

    def free(self, blocks: Iterable[int]) -> None:
        """Releases one reference to each block, deepest first (leaves-first eviction);
        null entries (a sliding-window table's freed blocks) hold none and are skipped."""
        for block in reversed(list(blocks)):
            if block != NULL_BLOCK:
                self.decref(block)

    def mark_cached(self, block: int) -> None:
        """The block became a prefix-trie node (it must be in use)."""
        if self._ref[block] == 0:
            raise RuntimeError(f"block {block} must be in use to be cached")
        self._cached.add(block)

    def uncache(self, block: int) -> None:
        """The block left the trie; if it is free it moves to the head as plain free."""
        if block not in self._cached:
            return
        self._cached.discard(block)
        if self._ref[block] == 0:
            self._num_evictable -= 1
            self._free.move_to_end(block, last=False)

    def free_order(self) -> list[int]:
        """The free list, head (next allocated) first; for tests and debugging."""
        return list(self._free)

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (tests)."""
        assert NULL_BLOCK not in self._free and self._ref[NULL_BLOCK] == 0
        assert NULL_BLOCK not in self._cached
        assert all(r >= 0 for r in self._ref)
        for block in range(1, self.num_blocks):
            assert (self._ref[block] == 0) == (block in self._free), block
        assert self._num_evictable == len(self._cached.intersection(self._free))
        assert len(self._free) + self.num_used_blocks == self.num_blocks - 1
