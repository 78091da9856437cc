"""Which layers of a model attend through a sliding window, as transformers' configs say
(pure Python: `models.config` reads configs with it; `models.window` turns the windows
into what the attention ops take).

A layer type is "sliding_attention" or "full_attention" (transformers' `layer_types`).
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"


def hf_window(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as transformers reads them per family:
    Mistral windows every layer (4096 when config.json has no `sliding_window` key,
    transformers' default; null: none); Qwen2 only with `use_sliding_window`, on the
    layers from `max_window_layers` on (or as its `layer_types` say); Llama has none."""
    if arch == "mistral":
        return dict(sliding_window=hf.get("sliding_window", 4096))
    if arch != "qwen2" or not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return {}
    n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
    return dict(sliding_window=hf["sliding_window"], layer_types=tuple(types))


def check_window(sliding_window: Any, layer_types: tuple[str, ...] | None,
                 num_layers: int) -> None:
    """ValueError naming a window that is not an integer >= 1, or layer_types of the wrong
    length or with a type other than sliding_attention / full_attention."""
    w = sliding_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"sliding_window must be an integer >= 1 or None, got {w!r}")
    if layer_types is None:
        return
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    bad = sorted(set(layer_types) - {SLIDING, FULL})
    if bad:
        raise ValueError(f"unsupported layer_types {bad}; supported: {[SLIDING, FULL]}")


def layer_windows(sliding_window: int | None, layer_types: tuple[str, ...] | None,
                  num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window: `sliding_window` on the sliding layers (all of them when
    `layer_types` is None), None on the others."""
    if sliding_window is None:
        return (None,) * num_layers
    types = layer_types or (SLIDING,) * num_layers
    return tuple(sliding_window if t == SLIDING else None for t in types)


def uniform_window(windows: tuple[int | None, ...]) -> int | None:
    """The window when every layer has the same one (blocks older than it are then never
    read again and can be freed); None when some layer attends to everything."""
    distinct = set(windows)
    return distinct.pop() if len(distinct) == 1 else None
