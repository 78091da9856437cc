"""Prefix cache: the original's PrefixPool surface over a PrefixTrie (prefix_trie.py).

Multi-level prefixes (policy -> department -> case) share their parents' trie nodes by
construction. LRU eviction lives in the BlockManager's free list (see block_manager.py);
the pool registers `_evict` there and drops the node of a block when the block is reused.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from jprefix.core.block_manager import NULL_BLOCK, BlockManager
from jprefix.core.host_pool import HostNode, HostPool
from jprefix.core.host_tier import HostTierMixin, KVMoves
from jprefix.core.kv_events import GPU, KVEventSink
from jprefix.core.prefix_trie import PrefixNode, PrefixTrie, block_hash, prefix_hash_of, root_hash

__all__ = ["Prefix", "PrefixCacheStats", "PrefixNode", "PrefixPool", "PrefixTrie",
           "block_hash", "prefix_hash_of", "root_hash"]


@dataclass
class Prefix:
    """A registered prefix: its whole blocks of token ids under a salt."""

    prefix_hash: int
    token_ids: tuple[int, ...]
    salt: str | None = None
    pinned_blocks: list[int] = field(default_factory=list)
    pinned_host: list[HostNode] = field(default_factory=list)  # its blocks only on the host

    @property
    def hash(self) -> int:
        return self.prefix_hash

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def pinned(self) -> bool:
        return bool(self.pinned_blocks)


@dataclass(frozen=True)
class PrefixCacheStats:
    num_queried_tokens: int  # prompt tokens of scheduled requests
    num_hit_tokens: int  # of those, served from the cache
    num_cached_blocks: int  # trie nodes (in use or evictable)
    num_evictable_blocks: int  # cached blocks no request holds
    num_host_hit_tokens: int = 0  # of the hits, brought back from the host tier
    num_host_used_blocks: int = 0
    num_host_free_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class PrefixPool(HostTierMixin):
    """The prefix cache the scheduler matches against, with the original's user surface:
    `add_or_get_prefix`, `delete_prefix(prefix_hash)`, pinning of warmed prefixes,
    `reset()` and hit/query counters."""

    def __init__(self, block_manager: BlockManager, host: HostPool | None = None):
        """`host`: the host-memory tier (None: off); see `HostPool` and `KVMoves`."""
        self.block_manager = block_manager
        self.host = host
        self.moves = KVMoves()
        self.num_host_hit_tokens = 0
        self.events: KVEventSink | None = None  # KV events (engine/kv_events.py), if on
        self.block_size = block_manager.block_size
        self.trie = PrefixTrie(self.block_size)
        self._prefixes: dict[int, Prefix] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        block_manager.set_evictor(self._evict)

    # -- scheduler side --------------------------------------------------------------

    def acquire(self, token_ids: Seq[int], max_blocks: int, salt: str | None = None) -> list[int]:
        """Matches whole cached blocks (at most max_blocks) and takes a reference to each."""
        blocks = [n.block for n in self.trie.match(token_ids, max_blocks, salt)]
        for block in blocks:
            self.block_manager.incref(block)
        return blocks

    def register_blocks(self, seq: Any, num_tokens: int, max_blocks: int) -> None:
        """Inserts seq's full blocks among its first num_tokens tokens (at most max_blocks)
        that are not in the trie yet. A block whose tokens are already cached in another
        block stays private, and so do the sequence's later blocks."""
        B, tokens, table = self.block_size, seq.all_token_ids, seq.block_table
        end = min(num_tokens // B, max_blocks)
        while seq.num_registered_blocks < end:
            i = seq.num_registered_blocks
            parent = self.trie.root(seq.cache_salt) if i == 0 else self.trie.node_of(table[i - 1])
            if parent is None or table[i] == NULL_BLOCK:  # its path was deleted while it
                return  # ran, or its window freed the block before its last token was known
            node = self.trie.insert(parent, tuple(tokens[i * B : (i + 1) * B]), table[i])
            if node.block != table[i]:
                return
            self.block_manager.mark_cached(table[i])
            seq.num_registered_blocks += 1
            if self.events is not None:
                self.events.stored_block(node.prefix_hash, None if i == 0 else
                                         parent.prefix_hash, node.tokens, GPU)

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def _evict(self, block: int) -> None:
        node = self.trie.node_of(block)
        if self.host is not None:
            self._save(node)
        removed = self.trie.remove_subtree(node)
        for n in removed:
            self.block_manager.uncache(n.block)
        if self.events is not None:
            self.events.removed_blocks([n.prefix_hash for n in removed], GPU)

    # -- user side -------------------------------------------------------------------

    def add_or_get_prefix(
        self,
        token_ids: Seq[int],
        prefix_len: int | None = None,
        salt: str | None = None,
        pin: bool = False,
    ) -> Prefix:
        """Registers the first prefix_len tokens (rounded down to whole blocks) as a named
        prefix, or returns the one registered already. With pin, its cached blocks are
        held until `unpin` or `delete_prefix` (call after the prefix has been computed)."""
        prefix_len = len(token_ids) if prefix_len is None else prefix_len
        if not 0 <= prefix_len <= len(token_ids):
            raise ValueError(f"prefix_len {prefix_len} is outside [0, {len(token_ids)}]")
        tokens = tuple(int(t) for t in token_ids[: prefix_len // self.block_size * self.block_size])
        h = prefix_hash_of(tokens, self.block_size, salt)
        prefix = self._prefixes.setdefault(h, Prefix(h, tokens, salt))
        if pin:
            self.pin(h)
        return prefix

    def get_prefix(self, prefix_hash: int) -> Prefix | None:
        return self._prefixes.get(prefix_hash)

    def cached_blocks(self, prefix_hash: int) -> list[int]:
        """The physical blocks of a registered prefix that are cached now."""
        return [n.block for n in self._cached_path(self._registered(prefix_hash))]

    def pin(self, prefix_hash: int) -> int:
        """Holds the prefix's cached blocks so they are never evicted; returns their count."""
        prefix = self._registered(prefix_hash)
        self._unpin(prefix)
        prefix.pinned_blocks = self.cached_blocks(prefix_hash)
        for block in prefix.pinned_blocks:
            self.block_manager.incref(block)
        if self.host is not None:  # the rest of its path, where on the host, stays there
            prefix.pinned_host = self.host.match(prefix.token_ids, len(prefix.pinned_blocks),
                                                 len(prefix.token_ids), prefix.salt)
            self.host.incref(prefix.pinned_host)
        return len(prefix.pinned_blocks) + len(prefix.pinned_host)

    def unpin(self, prefix_hash: int) -> None:
        self._unpin(self._registered(prefix_hash))

    def delete_prefix(self, prefix_hash: int) -> int:
        """Drops a prefix (registered, or any cached node's hash) and its unshared blocks.

        Nodes on its path that another registered prefix also uses stay; the first node
        that no other registered prefix needs is removed with its whole subtree. Removed
        blocks no request holds are freed now (the count is returned); blocks still held
        by running requests leave the trie and are freed on their last release.
        """
        prefix = self._prefixes.pop(prefix_hash, None)
        if prefix is not None:
            self._unpin(prefix)
            path = self._cached_path(prefix)
        elif (node := self.trie.find(prefix_hash)) is not None:
            path = node.path()
        else:
            raise ValueError(f"prefix_hash {prefix_hash} is neither registered nor cached")
        needed = {id(n) for p in self._prefixes.values() for n in self._cached_path(p)}
        if self.host is not None:
            self._drop_host(prefix, path, needed)
        for node in path:
            if id(node) not in needed:
                return self._drop(node)
        return 0

    def reset(self) -> bool:
        """reset_prefix_cache: drops every cached block. Refused (False) while any block
        is in use, by a request or a pin; registered prefixes stay registered."""
        if self.block_manager.num_used_blocks:
            return False
        if self.host is not None and not self.host.clear():
            return False
        for node in self.trie.clear():
            self.block_manager.uncache(node.block)
        if self.events is not None:
            self.events.all_cleared()
        return True

    def reset_counters(self) -> None:
        """Zeroes the query, hit and host-hit token counters (`stats`), e.g. after a
        warm-up; the cache itself is untouched."""
        self.num_queried_tokens = self.num_hit_tokens = self.num_host_hit_tokens = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.num_queried_tokens,
            self.num_hit_tokens,
            len(self.trie),
            self.block_manager.num_evictable_blocks,
            self.num_host_hit_tokens,
            0 if self.host is None else self.host.num_used_slots,
            0 if self.host is None else self.host.num_free_slots,
        )

    def _registered(self, prefix_hash: int) -> Prefix:
        if prefix_hash not in self._prefixes:
            raise ValueError(f"prefix_hash {prefix_hash} is not a registered prefix")
        return self._prefixes[prefix_hash]

    def _cached_path(self, prefix: Prefix) -> list[PrefixNode]:
        return self.trie.match(prefix.token_ids, len(prefix.token_ids), prefix.salt)

    def _unpin(self, prefix: Prefix) -> None:
        self.block_manager.free(prefix.pinned_blocks)
        prefix.pinned_blocks = []
        if self.host is not None:
            self.host.decref(prefix.pinned_host)
        prefix.pinned_host = []

    def _drop(self, node: PrefixNode) -> int:
        freed, removed = 0, self.trie.remove_subtree(node)
        for n in removed:
            freed += self.block_manager.ref_count(n.block) == 0
            self.block_manager.uncache(n.block)
        if self.events is not None:
            self.events.removed_blocks([n.prefix_hash for n in removed], GPU)
        return freed

    def check_invariants(self, prefix_closed: bool = True) -> None:
        """Raises AssertionError if trie and block manager disagree (tests). With
        `prefix_closed` False (sliding-window sequences free their oldest blocks first, so
        a held or later-freed child may sit under a free parent) only the structure is
        checked, not the holding and eviction order along a path."""
        bm = self.block_manager
        nodes = self.trie.nodes()
        assert len(nodes) == sum(bm.is_cached(b) for b in range(bm.num_blocks))
        position = {b: i for i, b in enumerate(bm.free_order())}
        for node in nodes:
            assert bm.is_cached(node.block) and node.parent.children[node.tokens] is node
            for child in node.children.values() if prefix_closed else ():
                # Held children imply a held parent; free parents sit behind free children.
                assert bm.ref_count(child.block) <= 0 or bm.ref_count(node.block) > 0
                if bm.ref_count(node.block) == 0:
                    assert position[child.block] < position[node.block]
