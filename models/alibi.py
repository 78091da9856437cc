"""ALiBi (attention with linear biases), the model's side: the slope of each query head.

An ALiBi model (`ModelConfig.position_embedding == "alibi"`, Baichuan2-13B) rotates
nothing; its attention adds `slope_h * (k_pos - q_pos)` to query head h's scaled logit
against the key at position k_pos, before the causal mask and the softmax. The bias
depends on positions only, so a prefill over a cached prefix computes the same logits as
one without it. The engine's kernels take these slopes as an [H] float32 array.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig


def _pow2_slopes(n: int) -> list[float]:
    """Slopes of a power-of-2 head count n: 2^(-8/n), 2^(-16/n), ..., 2^(-8)."""
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """float32 [num_heads]: the slope of each query head.

    With p the largest power of 2 <= num_heads, the first p heads take the slopes of p
    heads, the other num_heads - p heads every other slope (1st, 3rd, ...) of 2p heads
    (the ALiBi paper's rule, which Baichuan2-13B's 40 heads use). ValueError for < 1 head.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int | np.integer) \
            or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    n = int(num_heads)
    p = 1 << (n.bit_length() - 1)
    slopes = _pow2_slopes(p) + _pow2_slopes(2 * p)[0::2][: n - p]
    return np.asarray(slopes, np.float32)


def model_slopes(cfg: ModelConfig) -> np.ndarray | None:
    """`alibi_slopes(cfg.num_heads)` for an ALiBi model, None for a RoPE one."""
    return alibi_slopes(cfg.num_heads) if cfg.alibi else None


def check_slopes(slopes: np.ndarray | None, num_heads: int) -> None:
    """ValueError, naming the shape, unless `slopes` is None or one value per query head."""
    if slopes is not None and tuple(np.shape(slopes)) != (num_heads,):
        raise ValueError(f"alibi slopes have shape {tuple(np.shape(slopes))}, expected "
                         f"({num_heads},): one per query head")
