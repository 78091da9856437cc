"""PrefixTrie: block-granular, exact-token trie of cached KV blocks (pure Python).

A node is one full block of token ids, keyed under its parent by the exact tuple of those
ids, so two prompts can only share a block if every token up to it is equal (no hash can
alias them). Each cache salt has its own root: tenants never share blocks. A node's
`prefix_hash` is a stable hash of (salt, every token from the root to the node); it names
a prefix for `PrefixPool.delete_prefix`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


def root_hash(salt: str | None) -> int:
    """Hash of the empty prefix of a salt."""
    data = b"jprefix" if salt is None else b"jprefix:salt:" + salt.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hash(parent_hash: int, tokens: Seq[int]) -> int:
    """Chained hash: the parent's prefix hash and this block's tokens."""
    data = struct.pack(f"<Q{len(tokens)}q", parent_hash, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_hash_of(token_ids: Seq[int], block_size: int, salt: str | None = None) -> int:
    """The prefix_hash of the whole blocks of token_ids (what the trie node would carry)."""
    h = root_hash(salt)
    for i in range(len(token_ids) // block_size):
        h = block_hash(h, token_ids[i * block_size : (i + 1) * block_size])
    return h


@dataclass(eq=False)
class PrefixNode:
    """One full cached block. The root of a salt has block -1 and no tokens."""

    tokens: tuple[int, ...]
    block: int
    prefix_hash: int
    parent: PrefixNode | None = None
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)

    def path(self) -> list[PrefixNode]:
        """The nodes from the first block down to this one."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


class PrefixTrie:
    """Block-granular token trie with one root per cache salt."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._roots: dict[str | None, PrefixNode] = {}
        self._by_block: dict[int, PrefixNode] = {}
        self._by_hash: dict[int, PrefixNode] = {}
        self._salts: dict[int, str | None] = {}  # id(root) -> its salt

    def __len__(self) -> int:
        return len(self._by_block)

    def root(self, salt: str | None) -> PrefixNode:
        if salt not in self._roots:
            self._roots[salt] = PrefixNode((), -1, root_hash(salt))
            self._salts[id(self._roots[salt])] = salt
        return self._roots[salt]

    def salt_of(self, node: PrefixNode) -> str | None:
        """The cache salt of the root above node (node itself may be a root)."""
        while node.parent is not None:
            node = node.parent
        return self._salts[id(node)]

    def nodes(self) -> list[PrefixNode]:
        return list(self._by_block.values())

    def match(
        self, token_ids: Seq[int], max_blocks: int, salt: str | None = None
    ) -> list[PrefixNode]:
        """Longest cached run of whole blocks of token_ids, at most max_blocks."""
        B, node, out = self.block_size, self._roots.get(salt), []
        limit = min(max_blocks, len(token_ids) // B)
        while node is not None and len(out) < limit:
            i = len(out)
            node = node.children.get(tuple(token_ids[i * B : (i + 1) * B]))
            if node is not None:
                out.append(node)
        return out

    def insert(self, parent: PrefixNode, tokens: tuple[int, ...], block: int) -> PrefixNode:
        """Adds a child of parent for these tokens in `block`; if that child exists already
        (in another block) it is returned unchanged."""
        if len(tokens) != self.block_size:
            raise ValueError(f"a trie node holds {self.block_size} tokens, got {len(tokens)}")
        node = parent.children.get(tokens)
        if node is None:
            node = PrefixNode(tokens, block, block_hash(parent.prefix_hash, tokens), parent)
            parent.children[tokens] = node
            self._by_block[block] = node
            self._by_hash.setdefault(node.prefix_hash, node)
        return node

    def node_of(self, block: int) -> PrefixNode | None:
        return self._by_block.get(block)

    def find(self, prefix_hash: int) -> PrefixNode | None:
        return self._by_hash.get(prefix_hash)

    def remove_subtree(self, node: PrefixNode) -> list[PrefixNode]:
        """Unlinks node and all its descendants; returns them (node first)."""
        removed, stack = [], [node]
        while stack:
            n = stack.pop()
            removed.append(n)
            stack.extend(n.children.values())
            del self._by_block[n.block]
            if self._by_hash.get(n.prefix_hash) is n:
                del self._by_hash[n.prefix_hash]
        parent = node.parent
        del parent.children[node.tokens]
        for n in removed:
            n.children, n.parent = {}, None
        return removed

    def clear(self) -> list[PrefixNode]:
        """Removes every node; returns them."""
        removed = []
        for root in self._roots.values():
            for child in list(root.children.values()):
                removed += self.remove_subtree(child)
        self._roots.clear()
        self._salts.clear()
        return removed
