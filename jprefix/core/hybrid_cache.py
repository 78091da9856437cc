"""The prefix cache of a hybrid model: one trie, a page per KV cache group per node.

A trie node is one token block, keyed by its exact tokens and named (`PrefixNode.block`)
by its page of group 0 (a full group, `core.kv_groups`); `parts[page0]` lists its page
per group. The node lives while its full groups' pages do: evicting any of them removes
the node's subtree, as in the single-table cache (a held descendant would hold them too,
so a free full page has no held descendant). A window group's page is only needed while
some query's window still reaches it, so it is released on its own: once freed it waits
in the LRU like any cached page, and when the block manager reuses it the node merely
loses that part (null). A prefix hit is then the longest run of matched nodes whose full
parts are there (all of them, by construction) and whose window parts are there for the
blocks the first computed query's window reaches: `first_needed_block(g, n * B)` .. n - 1
for each window group g (vLLM's rule for sliding-window groups). The hit takes a
reference to exactly those pages; the older window entries of its tables are null.

Every page of a node is cached in the block manager (`mark_cached`), so the LRU, the
evictable count and `free` work on pages unchanged. The host tier is refused for hybrid
models (its pool stores one block per node).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from jprefix.core.block_manager import NULL_BLOCK, BlockManager
from jprefix.core.kv_events import GPU
from jprefix.core.kv_groups import KVCacheGroups
from jprefix.core.prefix_cache import Prefix, PrefixNode, PrefixPool


class HybridPrefixPool(PrefixPool):
    """`PrefixPool` over per-group pages; `acquire_groups` replaces `acquire`."""

    def __init__(self, block_manager: BlockManager, groups: KVCacheGroups):
        super().__init__(block_manager)
        self.groups = groups
        self.parts: dict[int, list[int]] = {}  # page of group 0 -> page per group
        self.owner: dict[int, tuple[int, int]] = {}  # cached page -> (page of group 0, group)

    def acquire(self, token_ids: Seq[int], max_blocks: int, salt: str | None = None) -> list[int]:
        raise RuntimeError("a hybrid model's cache is matched by acquire_groups")

    def acquire_groups(self, token_ids: Seq[int], max_blocks: int,
                       salt: str | None = None) -> list[list[int]]:
        """The longest prefix hit valid for every group (at most max_blocks blocks): one
        table per group, a reference taken to each non-null page."""
        nodes = self.trie.match(token_ids, max_blocks, salt)
        parts = [self.parts[n.block] for n in nodes]
        n = self._longest_valid(parts)
        B, G = self.block_size, self.groups.num_groups
        tables: list[list[int]] = [[] for _ in range(G)]
        for g, table in enumerate(tables):
            first = self.groups.first_needed_block(g, n * B, B)
            table += [NULL_BLOCK] * first + [p[g] for p in parts[first:n]]
            for page in table[first:]:
                self.block_manager.incref(page)
        return tables

    def _longest_valid(self, parts: list[list[int]]) -> int:
        """The largest n whose window parts are all present over each window group's
        needed blocks for a query at n * B."""
        B, groups = self.block_size, self.groups
        missing = {g: [0] for g in groups.window_groups}  # prefix counts of null parts
        for p in parts:
            for g, counts in missing.items():
                counts.append(counts[-1] + (p[g] == NULL_BLOCK))
        for n in range(len(parts), 0, -1):
            if all(c[n] == c[groups.first_needed_block(g, n * B, B)]
                   for g, c in missing.items()):
                return n
        return 0

    def register_blocks(self, seq: Any, num_tokens: int, max_blocks: int) -> None:
        """As `PrefixPool.register_blocks`, over every group's page of each new node; a
        window page freed before its block was registered leaves that part null."""
        B, tokens, table = self.block_size, seq.all_token_ids, seq.block_table
        end = min(num_tokens // B, max_blocks)
        while seq.num_registered_blocks < end:
            i = seq.num_registered_blocks
            parent = self.trie.root(seq.cache_salt) if i == 0 else self.trie.node_of(table[i - 1])
            if parent is None:  # its path was deleted while it ran
                return
            node = self.trie.insert(parent, tuple(tokens[i * B : (i + 1) * B]), table[i])
            if node.block != table[i]:
                return
            pages = [table[i]] + [t[i] for t in seq.group_tables]
            self.parts[table[i]] = pages
            for g, page in enumerate(pages):
                if page != NULL_BLOCK:
                    self.block_manager.mark_cached(page)
                    self.owner[page] = (table[i], g)
            seq.num_registered_blocks += 1
            if self.events is not None:
                self.events.stored_block(node.prefix_hash, None if i == 0 else
                                         parent.prefix_hash, node.tokens, GPU)

    def _evict(self, page: int) -> None:
        page0, g = self.owner.pop(page)
        if self.groups.windows[g] is not None:  # a window part: the node stays
            self.parts[page0][g] = NULL_BLOCK
            return
        self.parts[page0][g] = NULL_BLOCK  # (reused already: not uncached below)
        self._remove(self.trie.remove_subtree(self.trie.node_of(page0)))

    def _remove(self, removed: list[PrefixNode]) -> int:
        """Uncaches the removed nodes' pages; returns how many were free (now plain)."""
        freed = 0
        for node in removed:
            for page in self.parts.pop(node.block):
                if page != NULL_BLOCK:
                    del self.owner[page]
                    freed += self.block_manager.ref_count(page) == 0
                    self.block_manager.uncache(page)
        if self.events is not None:
            self.events.removed_blocks([n.prefix_hash for n in removed], GPU)
        return freed

    def _drop(self, node: PrefixNode) -> int:
        return self._remove(self.trie.remove_subtree(node))

    def reset(self) -> bool:
        if self.block_manager.num_used_blocks:
            return False
        for node in self.trie.clear():
            for page in self.parts.pop(node.block):
                if page != NULL_BLOCK:
                    self.block_manager.uncache(page)
        self.owner.clear()
        if self.events is not None:
            self.events.all_cleared()
        return True

    def pin(self, prefix_hash: int) -> int:
        """Holds every cached page of the prefix's path (all groups); returns the number
        of its blocks cached."""
        prefix = self._registered(prefix_hash)
        self._unpin(prefix)
        path = self._cached_path(prefix)
        prefix.pinned_blocks = [p for n in path for p in self.parts[n.block] if p != NULL_BLOCK]
        for page in prefix.pinned_blocks:
            self.block_manager.incref(page)
        return len(path)

    def _unpin(self, prefix: Prefix) -> None:
        self.block_manager.free(prefix.pinned_blocks)
        prefix.pinned_blocks = []

    def check_invariants(self, prefix_closed: bool = False) -> None:
        """Raises AssertionError if trie, parts and block manager disagree (tests): every
        node has its full pages, every non-null part is cached and owned by its node,
        and the cached pages are exactly the parts."""
        bm, full = self.block_manager, self.groups.full_groups
        nodes = self.trie.nodes()
        assert {n.block for n in nodes} == set(self.parts)
        num_parts = 0
        for node in nodes:
            pages = self.parts[node.block]
            assert pages[0] == node.block and len(pages) == self.groups.num_groups
            assert node.parent.children[node.tokens] is node
            assert all(pages[g] != NULL_BLOCK for g in full), pages
            for g, page in enumerate(pages):
                if page != NULL_BLOCK:
                    num_parts += 1
                    assert bm.is_cached(page) and self.owner[page] == (node.block, g)
        assert num_parts == len(self.owner)
        assert num_parts == sum(bm.is_cached(b) for b in range(bm.num_blocks))
