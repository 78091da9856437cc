"""KV cache groups of a model mixing full-attention and sliding-window layers (pure Python).

The hybrid layout (vLLM's hybrid KV cache manager): one pool of pages, each page holding
the K/V rows of `page_layers` (P) layers for B tokens. The layers are split into groups
of P layers of one kind (full, or one window size); P is the gcd of the kinds' layer
counts, so every kind splits into whole groups and every page has the same bytes. Each
group has its own block table per sequence: a token block costs one page per group while
every group holds it, and a window group gives its pages back once they fall out of the
window (`hybrid_scheduler.py`). A model layer reads and writes its group's table at its
slot (0..P-1) of the page. So every layer gets the same share of the pool's bytes: the
budget splits between kinds as their layer counts do (Gemma 3: 5/6 to the window layers).

Gemma-3-12B (48 layers, 8 full, 40 window): P = 8, 6 groups (1 full, 5 window).
Gemma-3-1B (26 layers, 4 full, 22 window): P = 2, 13 groups (2 full, 11 window).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    """The groups of a hybrid model: `windows[g]` (None: full attention) per group, full
    groups first; `layer_group[l]` and `layer_slot[l]` place layer l in a page."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    page_layers: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def full_groups(self) -> tuple[int, ...]:
        return tuple(g for g, w in enumerate(self.windows) if w is None)

    @property
    def window_groups(self) -> tuple[int, ...]:
        return tuple(g for g, w in enumerate(self.windows) if w is not None)

    @property
    def min_window(self) -> int:
        return min(w for w in self.windows if w is not None)

    def first_needed_block(self, group: int, start: int, block_size: int) -> int:
        """The first block of `group` that a query at position `start` (or later) reads:
        0 for a full group, else the block of key start - window + 1."""
        w = self.windows[group]
        return 0 if w is None else max(0, (start - w + 1) // block_size)


def kv_cache_groups(layer_windows: Seq[int | None]) -> KVCacheGroups | None:
    """The hybrid groups of a model whose layers have these windows (None: full), or None
    when the model is not hybrid (no window layer, or no full layer: one table serves)."""
    windows = list(layer_windows)
    for w in windows:
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"a layer window must be an int >= 1 or None, got {w!r}")
    if None not in windows or all(w is None for w in windows):
        return None
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full first
    layers = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    P = math.gcd(*(len(ls) for ls in layers.values()))
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * len(windows), [0] * len(windows)
    for kind in kinds:
        base = len(group_windows)
        group_windows += [kind] * (len(layers[kind]) // P)
        for j, layer in enumerate(layers[kind]):
            layer_group[layer], layer_slot[layer] = base + j // P, j % P
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), P)
