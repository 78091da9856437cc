"""HostPool: the bookkeeping of the prefix cache's host-memory tier (pure Python).

A block that leaves HBM while it still holds a cached prefix is written to a host slot
instead of being lost (write on eviction: nothing is copied for blocks that never leave
HBM, and a block already on the host is not written again: the tier is inclusive, a block
brought back keeps its host copy). The worker (`jprefix.worker.offload`) moves the bytes;
this module only decides which slot holds what.

Keys are exact, as in the HBM trie (`prefix_trie.py`): a host node is one block of token
ids under its parent, and each root is keyed by a tagged tuple (`("salt", cache_salt)`),
so keys of different kinds can never collide. A node may have no slot: it then only
carries the path to deeper nodes whose ancestors live in HBM (a placeholder; a childless
placeholder is pruned). Matching walks the host trie along the prompt: it may pass through
placeholders for the blocks HBM already matched, and continues with slot-holding nodes.

Under host-pool pressure the least recently used unreferenced slot is reused (its node
becomes a placeholder; deeper nodes stay and are reachable again once their ancestors are
back in HBM). Slots are referenced while a copy back to HBM reads them, and by pinned
prefixes; if every slot is referenced, the block being evicted from HBM is not kept.

Invariants (`check_invariants`): every slot is either free or held by exactly one node;
a referenced node holds a slot; the LRU holds exactly the slot-holding nodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from jprefix.core.kv_events import CPU, KVEventSink
from jprefix.core.prefix_trie import block_hash, root_hash


def root_key(salt: str | None) -> tuple[str, str | None]:
    """A root's key, tagged by kind (a salt can never equal a key of another kind)."""
    return ("salt", salt)


@dataclass(eq=False)
class HostNode:
    """One block of token ids under its parent; `slot` None for a placeholder."""

    tokens: tuple[int, ...]
    parent: HostNode | None
    prefix_hash: int = 0  # as the HBM trie's node for this path (routing affinity)
    slot: int | None = None
    ref: int = 0  # copies back to HBM reading the slot, and pins
    children: dict[tuple[int, ...], HostNode] = field(default_factory=dict)

    def depth(self) -> int:
        n, node = 0, self
        while node.parent is not None:
            n, node = n + 1, node.parent
        return n


class HostPool:
    """`num_slots` host blocks with their own LRU, keyed by exact token paths."""

    def __init__(self, num_slots: int, block_size: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._roots: dict[tuple, HostNode] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self._lru: OrderedDict[int, HostNode] = OrderedDict()  # by slot, oldest first
        self._by_hash: dict[int, HostNode] = {}  # slot-holding nodes by prefix_hash
        self.num_stored_blocks = 0  # blocks written to the host (saves)
        self.num_dropped_blocks = 0  # slots reused under pressure
        self.num_rejected_blocks = 0  # evicted from HBM and not kept (all slots held)
        self.events: KVEventSink | None = None  # KV events, if on
        # the worker copies a step's loads before the step runs (their sequences may run
        # in it) rather than while later steps run (`jprefix.worker.offload`)
        self.loads_in_step = False
        # the most tokens whose loads start in one step (`kv_offloading_step_tokens`: a
        # step's in-stream loads delay its every row); 0: no bound
        self.step_load_tokens = 0

    @property
    def num_used_slots(self) -> int:
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    # -- lookup ----------------------------------------------------------------------

    def _walk(self, salt: str | None, blocks: Seq[tuple[int, ...]], create: bool
              ) -> HostNode | None:
        key = root_key(salt)
        node = self._roots.get(key)
        if node is None:
            if not create:
                return None
            node = self._roots[key] = HostNode((), None, root_hash(salt))
        for tokens in blocks:
            child = node.children.get(tokens)
            if child is None:
                if not create:
                    return None
                child = node.children[tokens] = HostNode(
                    tokens, node, block_hash(node.prefix_hash, tokens))
            node = child
        return node

    def match(self, token_ids: Seq[int], start: int, max_blocks: int,
              salt: str | None = None) -> list[HostNode]:
        """The slot-holding nodes for blocks start, start+1, ... of token_ids (at most
        max_blocks - start), found along the exact path of its first `start` blocks."""
        B = self.block_size
        head = [tuple(token_ids[i * B:(i + 1) * B]) for i in range(start)]
        node, out = self._walk(salt, head, create=False), []
        limit = min(max_blocks, len(token_ids) // B)
        while node is not None and start + len(out) < limit:
            i = start + len(out)
            node = node.children.get(tuple(token_ids[i * B:(i + 1) * B]))
            if node is None or node.slot is None:
                break
            out.append(node)
            self._lru.move_to_end(node.slot)
        return out

    def holds(self, prefix_hash: int) -> bool:
        """Whether a slot holds the block whose chained hash is prefix_hash (the DP
        router's affinity; safe to call from another thread: one dict lookup)."""
        return prefix_hash in self._by_hash

    def find(self, salt: str | None, blocks: Seq[tuple[int, ...]]) -> HostNode | None:
        return self._walk(salt, blocks, create=False)

    # -- store -----------------------------------------------------------------------

    def store(self, salt: str | None, blocks: Seq[tuple[int, ...]]) -> int | None:
        """Keeps the last block of the path `blocks`: returns the slot to write it to, or
        None when nothing needs writing (it is on the host already) or no slot can be
        had (every slot referenced)."""
        node = self._walk(salt, blocks, create=True)
        if node.slot is not None:
            self._lru.move_to_end(node.slot)
            return None
        slot = self._take_slot(keep=node)
        if slot is None:
            self.num_rejected_blocks += 1
            self._prune(node)
            return None
        node.slot = slot
        self._lru[slot] = node
        self._by_hash[node.prefix_hash] = node
        self.num_stored_blocks += 1
        if self.events is not None:
            parent = node.parent
            self.events.stored_block(node.prefix_hash, None if parent.parent is None else
                                     parent.prefix_hash, node.tokens, CPU)
        return slot

    def _take_slot(self, keep: HostNode) -> int | None:
        """A free slot, or the LRU unreferenced one (its node pruned, never `keep`)."""
        if self._free:
            return self._free.pop()
        for slot, node in self._lru.items():  # oldest first
            if node.ref == 0:
                del self._lru[slot]
                self._unhash(node)
                node.slot = None
                if self.events is not None:
                    self.events.removed_blocks([node.prefix_hash], CPU)
                self.num_dropped_blocks += 1
                self._prune(node, keep)
                return slot
        return None

    def _unhash(self, node: HostNode) -> None:
        if self._by_hash.get(node.prefix_hash) is node:
            del self._by_hash[node.prefix_hash]

    def _prune(self, node: HostNode, keep: HostNode | None = None) -> None:
        """Removes childless placeholders upwards from node (up to `keep`, excluded)."""
        while (node.parent is not None and node.slot is None and not node.children
               and node is not keep):
            del node.parent.children[node.tokens]
            node = node.parent

    # -- references, deletion --------------------------------------------------------

    def incref(self, nodes: Seq[HostNode]) -> None:
        for node in nodes:
            if node.slot is None:
                raise RuntimeError("only a slot-holding host node can be referenced")
            node.ref += 1

    def decref(self, nodes: Seq[HostNode]) -> None:
        for node in nodes:
            if node.ref <= 0:
                raise RuntimeError("host node released more times than it was taken")
            node.ref -= 1

    def drop(self, node: HostNode) -> int:
        """Removes node and its subtree (delete_prefix); returns the slots freed.
        Referenced nodes (a copy in flight) keep their slot until released."""
        gone = []
        for n in list(_subtree(node)):
            if n.slot is not None and n.ref == 0:
                del self._lru[n.slot]
                self._unhash(n)
                self._free.append(n.slot)
                n.slot = None
                gone.append(n.prefix_hash)
        if self.events is not None:
            self.events.removed_blocks(gone, CPU)
        if node.parent is not None and not _holds_slots(node):
            del node.parent.children[node.tokens]
            self._prune(node.parent)
        return len(gone)

    def clear(self) -> bool:
        """Drops every block (reset_prefix_cache); refused (False) while any is referenced."""
        if any(n.ref for n in self._lru.values()):
            return False
        self._roots.clear()
        self._lru.clear()
        self._by_hash.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return True

    def entries(self) -> Iterator[tuple[str | None, list[tuple[int, ...]], HostNode]]:
        """(salt, block path, node) of every slot-holding node, parents first."""
        for key, root in self._roots.items():
            stack = [(root, [])]
            while stack:
                node, path = stack.pop()
                if node.slot is not None:
                    yield key[1], path, node
                for tokens, child in node.children.items():
                    stack.append((child, path + [tokens]))

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (tests)."""
        held = [n for root in self._roots.values() for n in _subtree(root) if n.slot is not None]
        slots = [n.slot for n in held]
        assert len(slots) == len(set(slots)) == len(self._lru)
        assert not set(slots) & set(self._free), "a slot is both free and held"
        assert len(self._free) == len(set(self._free))
        assert len(slots) + len(self._free) == self.num_slots
        assert all(self._lru[n.slot] is n for n in held)
        assert all(n.slot is not None for n in self._by_hash.values())
        for root in self._roots.values():
            for n in _subtree(root):
                assert n.ref >= 0 and (n.ref == 0 or n.slot is not None)
                for child in n.children.values():
                    assert child.parent is n


def _subtree(node: HostNode) -> Iterator[HostNode]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _holds_slots(node: HostNode) -> bool:
    return any(n.slot is not None for n in _subtree(node))
