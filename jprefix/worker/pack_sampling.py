"""Packs the arrays of a step's logits processing and logprobs (host side, no jax): the
`extra` variant of the step, for steps where some row has penalties, min_p, a logit bias
or wants logprobs (`jprefix.worker.logits_processing` documents the arrays).

Output-token counts are packed per step as sparse (row, token, 1) entries, one per known
output token of each penalised row (the device's scatter-add counts repeats; the row's
newest token may be pending: the device counts it), from an int32 array kept on the
sequence and extended by its new tokens only; with them the prompt's distinct tokens
(computed once per sequence) for the repetition penalty and the logit-bias entries, all
in one entry list. Entry counts are rounded up to powers of two (at most twice the
entries, a few words each): the variant compiles once per (shape bucket, entry bucket),
so a penalised decode compiles again only when its entries double, never per request
mix.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jprefix.worker.pack import bucket

_MIN_ENTRIES = 16


def _entries(parts: list[np.ndarray], dtype: Any, size: int) -> np.ndarray:
    out = np.zeros(size, dtype)
    if parts:
        joined = np.concatenate(parts)
        out[: len(joined)] = joined
    return out


def _prompt_tokens(seq: Any) -> np.ndarray:
    """The distinct prompt tokens of `seq` (computed once, kept on the sequence)."""
    cached = getattr(seq, "_distinct_prompt", None)
    if cached is None:
        cached = seq._distinct_prompt = np.unique(np.asarray(seq.prompt_token_ids, np.int32))
    return cached


def _output_tokens(seq: Any) -> np.ndarray:
    """`seq`'s known output tokens as int32, kept on the sequence and extended by the
    tokens appended since the last call (output tokens are only ever appended)."""
    num = seq.num_output_tokens
    cached = getattr(seq, "_output_array", None)
    if cached is None or len(cached) > num:
        cached = np.asarray(seq.all_token_ids[seq.num_prompt_tokens:], np.int32)
    elif len(cached) < num:
        tail = seq.all_token_ids[seq.num_prompt_tokens + len(cached):]
        cached = np.concatenate([cached, np.asarray(tail, np.int32)])
    seq._output_array = cached
    return cached


def pack_sampling(rows: Seq, num_rows: int, cu_q_lens: np.ndarray
                  ) -> tuple[dict[str, np.ndarray], list[tuple[Any, int]]]:
    """The extra arrays for `rows` (ScheduledSeq, in device order) of a step with
    `num_rows` (S) row slots and query offsets `cu_q_lens` [S+1]; and, per `plp_idx` entry,
    (sequence, prompt position p): the entry's logprobs are of prompt token p + 1."""
    presence = np.zeros(num_rows, np.float32)
    frequency = np.zeros(num_rows, np.float32)
    repetition = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    pen: dict[str, list[np.ndarray]] = {"rows": [], "ids": [], "out": [], "prompt": [],
                                        "bias": []}
    plp_idx: list[int] = []
    plp_target: list[int] = []
    plp_meta: list[tuple[Any, int]] = []
    for i, (seq, start, q, sample) in enumerate(rows):
        if not seq.sampling_extra:
            continue
        sp = seq.sampling_params
        if seq.num_prompt_logprobs is not None:
            prompt = seq.prompt_token_ids
            for p in range(start, min(start + q, len(prompt) - 1)):
                plp_idx.append(int(cu_q_lens[i]) + p - start)
                plp_target.append(prompt[p + 1])
                plp_meta.append((seq, p))
        if not sample:
            continue
        presence[i], frequency[i] = sp.presence_penalty, sp.frequency_penalty
        repetition[i], min_p[i] = sp.repetition_penalty, sp.min_p
        if sp.logit_bias:
            n = len(sp.logit_bias)
            _add(pen, i, np.fromiter(sp.logit_bias, np.int32, n), np.zeros(n, np.int32), 0,
                 np.fromiter(sp.logit_bias.values(), np.float32, n))
        if sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1:
            output = _output_tokens(seq)
            if len(output):
                _add(pen, i, output, np.ones(len(output), np.int32), 0)
            if sp.repetition_penalty != 1:
                ids = _prompt_tokens(seq)
                _add(pen, i, ids, np.zeros(len(ids), np.int32), 1)
    P = bucket(sum(map(len, pen["ids"])), _MIN_ENTRIES)
    Q = bucket(len(plp_idx), _MIN_ENTRIES)
    arrays = dict(
        presence=presence, frequency=frequency, repetition=repetition, min_p=min_p,
        pen_rows=_entries(pen["rows"], np.int32, P), pen_ids=_entries(pen["ids"], np.int32, P),
        pen_out=_entries(pen["out"], np.int32, P),
        pen_prompt=_entries(pen["prompt"], np.int32, P),
        pen_bias=_entries(pen["bias"], np.float32, P),
        plp_idx=_entries([np.asarray(plp_idx, np.int32)], np.int32, Q),
        plp_target=_entries([np.asarray(plp_target, np.int32)], np.int32, Q),
    )
    return arrays, plp_meta


def _add(pen: dict[str, list[np.ndarray]], row: int, ids: np.ndarray, out: np.ndarray,
         in_prompt: int, bias: np.ndarray | None = None) -> None:
    pen["rows"].append(np.full(len(ids), row, np.int32))
    pen["ids"].append(ids)
    pen["out"].append(out)
    pen["prompt"].append(np.full(len(ids), in_prompt, np.int32))
    pen["bias"].append(np.zeros(len(ids), np.float32) if bias is None else bias)
