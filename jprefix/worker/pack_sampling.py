"""Packs the arrays of a step's logits processing and logprobs (host side, no jax): the
`extra` variant of the step, for steps where some row has penalties, min_p, a logit bias
or wants logprobs (`jprefix.worker.logits_processing` documents the arrays).

Penalty entries are token ids only, one int32 each, laid out row by row: a penalised
row's known output tokens (repeats kept: the device counts them; the row's newest token
may be pending: the device counts it), then, when its repetition penalty is on, its
prompt's distinct tokens; `pen_bounds` says where each row's two segments start and end.
Both per-row arrays are kept by the packer per request (`RequestRows`: the prompt's
once, the output's extended in place by its new tokens only), so a step joins them with
one concatenate. Logit-bias
entries are their own (row, token, bias) triples. Entry counts are rounded up to powers
of two (at most twice the entries), and the penalty entries never below `min_entries`,
the most a step of this packer has sent (`StepPacker` keeps it): the variant compiles
once per (shape bucket, entry buckets), so a penalised decode compiles again only when
its entries pass their highest count so far, never per request mix, nor when a batch's
rows finish and its entries shrink.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jprefix.worker.pack import bucket
from jprefix.worker.request_rows import RequestRows

_MIN_ENTRIES = 16


def _padded(values: list, dtype: Any, size: int, fill: int = 0) -> np.ndarray:
    """`values` as a `size`-entry array of `dtype`, its tail `fill`."""
    out = np.full(size, fill, dtype)
    out[: len(values)] = values
    return out


def pack_sampling(rows: Seq, num_rows: int, cu_q_lens: np.ndarray, arrays: RequestRows,
                  min_entries: int = _MIN_ENTRIES
                  ) -> tuple[dict[str, np.ndarray], list[tuple[Any, int]]]:
    """The extra arrays for `rows` (ScheduledSeq, in device order) of a step with
    `num_rows` (S) row slots and query offsets `cu_q_lens` [S+1] (`arrays`: the packer's
    per-request token arrays); and, per `plp_idx` entry,
    (sequence, prompt position p): the entry's logprobs are of prompt token p + 1.
    `pen_ids` has at least `min_entries` entries."""
    # per row: presence, frequency, repetition, min_p (off: 0, 0, 1, 0)
    params = np.zeros((4, num_rows), np.float32)
    params[2] = 1
    param_rows: list[int] = []
    param_values: list[tuple[float, float, float, float]] = []
    segments: list[np.ndarray] = []  # the entries' token ids, in row order
    lengths = [0] * (2 * num_rows)  # per row: its output, then its prompt segment's length
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
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
        presence, frequency, repetition = (sp.presence_penalty, sp.frequency_penalty,
                                           sp.repetition_penalty)
        param_rows.append(i)
        param_values.append((presence, frequency, repetition, sp.min_p))
        if sp.logit_bias:
            bias = sp.logit_bias
            bias_rows += [i] * len(bias)
            bias_ids += bias
            bias_vals += bias.values()
        if presence or frequency or repetition != 1:
            output = arrays.output_tokens(seq)
            segments.append(output)
            lengths[2 * i] = len(output)
            if repetition != 1:
                distinct = arrays.distinct_prompt(seq)
                segments.append(distinct)
                lengths[2 * i + 1] = len(distinct)
    if param_rows:
        params[:, param_rows] = np.array(param_values, np.float32).T
    bounds = np.zeros(2 * num_rows + 1, np.int32)
    np.cumsum(lengths, out=bounds[1:])
    num_entries = int(bounds[-1])
    pen_ids = np.zeros(bucket(num_entries, max(min_entries, _MIN_ENTRIES)), np.int32)
    if segments:
        np.concatenate(segments, out=pen_ids[:num_entries])
    num_bias = bucket(len(bias_ids), _MIN_ENTRIES)
    num_plp = bucket(len(plp_idx), _MIN_ENTRIES)
    arrays = dict(
        presence=params[0], frequency=params[1], repetition=params[2], min_p=params[3],
        pen_ids=pen_ids, pen_bounds=bounds,
        # (padding rows are `num_rows`: out of range, dropped on the device)
        bias_rows=_padded(bias_rows, np.int32, num_bias, num_rows),
        bias_ids=_padded(bias_ids, np.int32, num_bias),
        bias_vals=_padded(bias_vals, np.float32, num_bias),
        plp_idx=_padded(plp_idx, np.int32, num_plp),
        plp_target=_padded(plp_target, np.int32, num_plp),
    )
    return arrays, plp_meta
