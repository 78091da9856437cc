"""Output processing: stop strings, detokenization and the finished RequestOutputs.

Stop token ids, EOS and max_tokens are the scheduler's (they need no text); stop strings
need the text, so the requests that have any are watched here: after each step the text
of each watched request that sampled grows incrementally (each token decoded once, in a
short window) and is searched only where a new match can start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jprefix.core.outputs import RequestOutput
from jprefix.core.sequence import Sequence
from jprefix.engine.detokenizer import IncrementalDetokenizer
from jprefix.engine.logprobs import position_dicts


class OutputProcessor:
    """Watches the requests that have stop strings and builds finished outputs."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # the requests with stop strings, in arrival order (a dict used as an ordered set)
        self._watched: dict[Sequence, None] = {}

    def add(self, seq: Sequence) -> None:
        """Starts watching a request that entered the scheduler, if it has stop strings."""
        if seq.sampling_params.stop:
            self._watched[seq] = None

    def check_stop_strings(self, finish: Callable[[Sequence, str], None]) -> list[Sequence]:
        """Finishes (`finish(seq, "stop")`) the watched requests whose output grew and whose
        text now contains a stop string, keeping the text before it; returns them. Before
        `min_tokens` output tokens no stop string is looked for, and one that ends in the
        text of those tokens never stops the request (vLLM's rule)."""
        finished = []
        for seq in self._watched:
            stops = seq.sampling_params.stop
            det = seq.detokenizer
            seen = seq.num_prompt_tokens + (0 if det is None else len(det.ids))
            if len(seq.all_token_ids) == seen or seq.is_finished():
                continue  # (no new token)
            if det is None:
                det = seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            delta = det.push(seq.all_token_ids[seen:])  # the tokens it has not seen
            if not delta or seq.num_output_tokens < seq.sampling_params.min_tokens:
                continue  # (stop strings count only from min_tokens on, as stop ids do)
            since = max(0, len(det.text) - len(delta) - max(map(len, stops)) + 1)
            hits = [i for i in (det.text.find(s, since) for s in stops) if i >= 0]
            if hits:
                seq.stop_text = det.text[: min(hits)]
                finish(seq, "stop")
                finished.append(seq)
        return finished

    def outputs(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The RequestOutputs of finished requests (which are no longer watched)."""
        now = time.monotonic()
        for seq in finished:
            self._watched.pop(seq, None)
        return [self._output(seq, now) for seq in finished]

    def _output(self, seq: Sequence, now: float) -> RequestOutput:
        text = seq.stop_text
        if text is None:
            text = self._detokenize(seq.output_token_ids)
        metrics = {"arrival_time": seq.arrival_time, "finished_time": now}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
            **self._logprobs(seq),
        )

    def _logprobs(self, seq: Sequence) -> dict[str, Any]:
        """The logprob fields of a finished request's output (those it asked for)."""
        out: dict[str, Any] = {}
        if seq.num_logprobs is not None:
            out["logprobs"] = position_dicts(seq.output_logprobs, self.tokenizer)
            out["cumulative_logprob"] = seq.cumulative_logprob
        if seq.num_prompt_logprobs is not None:
            out["prompt_logprobs"] = [None] + position_dicts(seq.prompt_logprobs,
                                                             self.tokenizer)
        return out

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
