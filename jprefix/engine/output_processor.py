"""Output processing: each request's text, stop strings, logprobs, and its RequestOutputs.

The output processor owns everything a request returns besides its tokens (vLLM's
`RequestState`): the incremental detokenizer, the stop-string search, the logprobs the
device computed, and what was already sent. Stop token ids, EOS and max_tokens are the
scheduler's (they need no text); stop strings need the text, so requests that have any,
and requests streamed as deltas, are watched: after each step the text of each watched
request that sampled grows incrementally (each token decoded once, in a short window)
and is searched only where a new match can start.

Per `SamplingParams.output_kind`: FINAL_ONLY requests get one RequestOutput when they
finish; DELTA requests one per step that added text, tokens or logprobs (the new ones
only; their concatenation is the final output) and a last one with the finish reason;
CUMULATIVE requests the same with everything so far. A delta never sends text a stop
string could still cut: the last `len(longest stop) - 1` characters wait for the next
token or the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import Any

from jprefix.core.outputs import RequestOutput, RequestOutputKind
from jprefix.core.sequence import Sequence
from jprefix.engine.detokenizer import IncrementalDetokenizer
from jprefix.engine.logprobs import LogprobState, position_dicts

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


class RequestState:
    """One request's output state. `seq` is read, never written (core owns it)."""

    def __init__(self, seq: Sequence, prompt: str | None, tokenizer: Any):
        sp = seq.sampling_params
        self.seq, self.prompt = seq, prompt
        self.kind = sp.output_kind
        self.stop: list[str] = sp.stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokenizer = tokenizer
        # (only a watched request decodes as it goes: `watched` reads kind and stop)
        self.detokenizer = IncrementalDetokenizer(tokenizer) if self.watched else None
        self.stop_at: int | None = None  # where a matched stop string cuts the text
        self.logprobs = LogprobState(seq.num_logprobs, seq.num_prompt_logprobs)
        self.sent_tokens = 0  # output tokens, characters and logprob entries sent
        self.sent_text = 0
        self.sent_logprobs = 0
        self.sent_any = False  # (prompt logprobs go in a request's first output only)

    @property
    def watched(self) -> bool:
        """Whether its text is needed after every step (stop strings or a stream)."""
        return bool(self.stop) or self.kind is not _FINAL_ONLY

    def push(self) -> str:
        """Decodes the output tokens the detokenizer has not seen; returns their text."""
        seq, det = self.seq, self.detokenizer
        seen = seq.num_prompt_tokens + len(det.ids)
        if len(seq.all_token_ids) == seen:
            return ""
        return det.push(seq.all_token_ids[seen:])

    def find_stop(self, delta: str) -> bool:
        """Searches the text `delta` completed for a stop string (only where a new match
        can start); records where the first one found cuts the text."""
        if not delta or not self.stop or self.stop_at is not None:
            return False
        if self.seq.num_output_tokens < self.seq.sampling_params.min_tokens:
            return False  # (stop strings count only from min_tokens on, as stop ids do)
        text = self.detokenizer.text
        since = max(0, len(text) - len(delta) - self.hold)
        hits = [i for i in (text.find(s, since) for s in self.stop) if i >= 0]
        if hits:
            self.stop_at = min(hits)
        return bool(hits)

    def final_text(self) -> str:
        if self.stop_at is not None:
            return self.detokenizer.text[: self.stop_at]
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.seq.output_token_ids,
                                                 skip_special_tokens=True)

    def safe_text(self) -> str:
        """The text so far that is sure to be in the final text (before a stop string
        found, short of one that may still complete)."""
        text = self.detokenizer.text
        return text[: max(0, len(text) - self.hold)]


class OutputProcessor:
    """Keeps each request's RequestState and builds its RequestOutputs."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        # the states whose text is needed every step, in arrival order (an ordered set)
        self._watched: dict[str, RequestState] = {}

    def add(self, seq: Sequence, prompt: str | None = None) -> None:
        """Starts a request's output state (`prompt`: its text, when it was given so)."""
        state = RequestState(seq, prompt, self.tokenizer)
        self.states[seq.request_id] = state
        if state.watched:
            self._watched[seq.request_id] = state

    def attach_logprobs(self, scheduled: Seq, logprobs: tuple | None,
                        prompt_positions: list[tuple[Any, int]] | None) -> None:
        """A processed step's device logprobs (`ModelRunner.fetch_logprobs`) to each
        row's request (`LogprobState.attach` says which entries are kept); a verify
        row's are its emitted tokens' (`spec_verify.verify_logprobs`)."""
        if logprobs is None:
            return
        (lp, rank, top_ids, top_lp), prompt, *spec = logprobs
        states = self.states
        for i, (seq, _, _, sample) in enumerate(scheduled):
            state = states.get(seq.request_id)
            if not sample or state is None:
                continue
            if spec and spec[0][4][i]:  # (a verify row)
                state.logprobs.attach_outputs(seq, [a[i] for a in spec[0][:4]])
            else:
                state.logprobs.attach_output(seq, float(lp[i]), int(rank[i]), top_ids[i],
                                             top_lp[i])
        for j, (seq, p) in enumerate(prompt_positions or ()):
            state = states.get(seq.request_id)
            if state is not None:
                state.logprobs.attach_prompt(seq, p, prompt, j)

    def check_stop_strings(self, finish: Callable[[Sequence, str], None]) -> list[Sequence]:
        """Decodes the new tokens of every watched request and finishes
        (`finish(seq, "stop")`) those whose text now holds a stop string; returns them.
        Before `min_tokens` output tokens no stop string is looked for, and one that ends
        in the text of those tokens never stops the request (vLLM's rule)."""
        finished = []
        for state in self._watched.values():
            seq = state.seq
            if seq.is_finished():
                continue
            if state.find_stop(state.push()):
                finish(seq, "stop")
                finished.append(seq)
        return finished

    def deltas(self) -> list[RequestOutput]:
        """A RequestOutput for each unfinished DELTA / CUMULATIVE request with something
        new since its last one (call after `check_stop_strings`)."""
        out, now = [], None
        for state in self._watched.values():
            if state.kind is _FINAL_ONLY or state.seq.is_finished():
                continue
            seq = state.seq
            if seq.num_output_tokens == state.sent_tokens:
                continue
            now = now or time.monotonic()
            out.append(self._output(state, state.safe_text(), None, now))
        return out

    def outputs(self, finished: Iterable[Sequence]) -> list[RequestOutput]:
        """The last RequestOutput of each finished request; forgets their states."""
        now, out = time.monotonic(), []
        for seq in finished:
            state = self.states.pop(seq.request_id, None)
            self._watched.pop(seq.request_id, None)
            if state is None:
                continue
            if state.watched:  # (an unwatched request's text is decoded once, below)
                state.push()
            out.append(self._output(state, state.final_text(), seq.finish_reason, now))
        return out

    def _output(self, state: RequestState, text: str, finish_reason: str | None,
                now: float) -> RequestOutput:
        """The request's output: everything (FINAL_ONLY, CUMULATIVE) or what is new since
        the last one sent (DELTA); marks it sent."""
        seq, lps = state.seq, state.logprobs
        tokens = seq.output_token_ids
        entries = lps.output
        delta = state.kind is RequestOutputKind.DELTA
        if delta:
            new_text = text[state.sent_text:] if text.startswith(
                state.detokenizer.text[: state.sent_text]) else ""
            tokens, entries = tokens[state.sent_tokens:], entries[state.sent_logprobs:]
        state.sent_tokens = seq.num_output_tokens
        state.sent_text = max(state.sent_text, len(text))
        state.sent_logprobs = len(lps.output)
        metrics = {"arrival_time": seq.arrival_time}
        if finish_reason is not None:
            metrics["finished_time"] = now
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        first, state.sent_any = not (delta and state.sent_any), True
        return RequestOutput(
            request_id=seq.request_id,
            prompt=state.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=new_text if delta else text,
            token_ids=list(tokens),
            finish_reason=finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
            logprobs=(None if lps.num_logprobs is None
                      else position_dicts(entries, self.tokenizer)),
            cumulative_logprob=None if lps.num_logprobs is None else lps.cumulative,
            prompt_logprobs=(None if lps.num_prompt_logprobs is None or not first
                             else [None] + position_dicts(lps.prompt, self.tokenizer)),
        )
