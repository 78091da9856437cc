"""Per-layer sliding windows as the attention functions take them.

`ModelConfig.layer_windows` gives each layer's window (None: full attention). The layers
may run under `lax.scan` (the "stacked" layout), where the layer index is traced, so a
model mixing window and full layers (Gemma 3, Qwen2 with `use_sliding_window`) cannot
hand each layer a Python int. `layer_window` therefore returns the one Python int when
every layer has the same window (Mistral: one program, a constant), None when no layer
has one (no window code at all), the layer's own window when its index is concrete
(unrolled layers), and otherwise the window read from a per-layer int32 table at the
traced layer index, full layers holding FULL_WINDOW: every attention op
takes the window as a traced int32 scalar, which only bounds its key loop and its mask,
so one compiled body serves both kinds of layer.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

# A full-attention layer's entry in a mixed model's window table: larger than any
# position, so p - FULL_WINDOW < 0 <= k and every earlier key is seen.
FULL_WINDOW = 1 << 30


def layer_window(windows: tuple[int | None, ...], layer: jax.Array | int
                 ) -> jax.Array | int | None:
    """The window of `layer` given every layer's `windows`: None (no layer has one), the
    common int, the layer's own (int or None) for a concrete index, or for a traced one
    an int32 scalar read from the table."""
    if all(w is None for w in windows):
        return None
    if len(set(windows)) == 1:
        return windows[0]
    try:  # a concrete layer index (unrolled layers): the layer's own window, static
        return windows[operator.index(layer)]
    except TypeError:  # a traced one (lax.scan): read from the table
        pass
    table = jnp.asarray([FULL_WINDOW if w is None else w for w in windows], jnp.int32)
    return table[layer]
