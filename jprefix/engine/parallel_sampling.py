"""n > 1 and best_of: one request fanned out into `best_of` (default n) sequences, and
their outputs merged back into one RequestOutput of n samples.

The samples are ordinary sequences with the same prompt, queued together: the first one
computes the prompt and registers its full blocks in the prefix trie at schedule time,
so the others (scheduled after it, in the same step or later) share those blocks through
the prefix cache; only the last partial block is each sample's own. Sample i samples
with seed `seed + i` (the request's seed, or the engine's draw for it), so the samples
are distinct and a seeded request is reproducible. Only the first sample computes the
prompt logprobs (a request with them computes its prompt uncached); with best_of > n the
samples track their sampled tokens' logprobs to rank by cumulative logprob.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jprefix.core.outputs import CompletionOutput, RequestOutput
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.sequence import Sequence


class SampleGroup(NamedTuple):
    """One request made (validated, not yet queued): its id, sampling parameters, the
    sequences that generate it and its prompt text (None when given as token ids).
    Entry points hold it as a handle: they read `request_id`, `request_ids`,
    `sampling_params` and `prompt_token_ids`, never the sequences."""

    request_id: str
    sampling_params: SamplingParams
    seqs: list[Sequence]
    prompt: str | None = None

    @property
    def request_ids(self) -> list[str]:
        """The ids of the sequences, in sample order (their outputs carry these)."""
        return [seq.request_id for seq in self.seqs]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids


def fan_out(seq: Sequence, prompt: str | None = None) -> SampleGroup:
    """The sequences that generate `seq`'s request: `seq` itself when it draws one
    sample, else `num_samples` children with ids `<request_id>-<i>` (n = 1 each)."""
    sp = seq.sampling_params
    if sp.num_samples == 1:
        return SampleGroup(seq.request_id, sp, [seq], prompt)
    ranked = sp.best_of is not None and sp.best_of > sp.n
    children = []
    for i in range(sp.num_samples):
        logprobs = sp.logprobs
        if ranked and logprobs is None:
            logprobs = 0  # (its sampled tokens' logprobs only: `merge` ranks by them)
        child_sp = dataclasses.replace(
            sp, n=1, best_of=None, seed=None if sp.seed is None else sp.seed + i,
            logprobs=logprobs, prompt_logprobs=sp.prompt_logprobs if i == 0 else None)
        children.append(Sequence(f"{seq.request_id}-{i}", seq.prompt_token_ids, child_sp,
                                 prefix_len=seq.prefix_len, cache_salt=seq.cache_salt,
                                 arrival_time=seq.arrival_time,
                                 seed=(seq.seed + i) % 2**32))
    return SampleGroup(seq.request_id, sp, children, prompt)


def merge(group: SampleGroup, outs: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput of n samples from the outputs of the group's sequences (in
    their order): with best_of > n the n of highest cumulative logprob, best first."""
    if len(outs) == 1:
        return outs[0]
    request_id, sp = group.request_id, group.sampling_params
    chosen = outs
    if sp.best_of is not None and sp.best_of > sp.n:
        chosen = sorted(outs, key=lambda o: -o.cumulative_logprob)[: sp.n]
    samples = [CompletionOutput(i, o.text, o.token_ids, o.finish_reason, o.cumulative_logprob,
                                o.logprobs if sp.logprobs is not None else None)
               for i, o in enumerate(chosen)]
    first = outs[0]
    metrics = dict(first.metrics)
    ends = [o.metrics["finished_time"] for o in outs if "finished_time" in o.metrics]
    if ends:
        metrics["finished_time"] = max(ends)
    best = samples[0]
    return RequestOutput(
        request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
        text=best.text, token_ids=best.token_ids, finish_reason=best.finish_reason,
        num_cached_tokens=first.num_cached_tokens, metrics=metrics, logprobs=best.logprobs,
        cumulative_logprob=best.cumulative_logprob, prompt_logprobs=first.prompt_logprobs,
        samples=samples)
