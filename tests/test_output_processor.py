"""The output processor's DELTA outputs: they concatenate to the final output (text,
tokens, logprobs), never send text a stop string later cuts, and end with the finish
reason; FINAL_ONLY requests get one output."""

import numpy as np
import pytest

from jprefix.core.outputs import RequestOutputKind
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.sequence import Sequence
from jprefix.engine.output_processor import OutputProcessor


class CharTokenizer:  # token id = one character
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _run(text, stop, kind=RequestOutputKind.DELTA, per_step=1, logprobs=None):
    """Feeds `text` to one request `per_step` characters a step, as the engine does after
    `Scheduler.update`; returns every output and the request."""
    proc = OutputProcessor(CharTokenizer())
    sp = SamplingParams(max_tokens=len(text), stop=stop, output_kind=kind, logprobs=logprobs)
    seq = Sequence("r", [ord(">")], sp)
    proc.add(seq, ">")
    outs, finished = [], []

    def finish(s, reason):
        s.set_finished(reason)
        finished.append(s)

    for start in range(0, len(text), per_step):
        rows = []
        for ch in text[start:start + per_step]:
            seq.all_token_ids.append(ord(ch))
            rows.append((seq, 0, 1, True))
            if logprobs is not None:  # one device logprob row per sampled token
                lp = np.array([-float(ord(ch))], np.float32)
                top = np.array([[ord(ch)]], np.int32)
                proc.attach_logprobs(rows[-1:], ((lp, np.ones(1, np.int32), top,
                                                  lp[:, None]), None), None)
        done = proc.check_stop_strings(finish)
        if not done and start + per_step >= len(text):
            finish(seq, "length")
            done = [seq]
        outs += proc.deltas() + proc.outputs(done)
        if done:
            break
    return outs, seq


@pytest.mark.parametrize("stop", [["w"], ["wise"], ["a"], ["owl", "old", "zz"], [" o", "se o"],
                                  ["nope"], []])
@pytest.mark.parametrize("per_step", [1, 3])
def test_deltas_concatenate_to_the_final_text_and_never_leak_a_stop_string(stop, per_step):
    text = "a wise old owl"
    outs, _ = _run(text, stop, per_step=per_step)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    final = text[: min(hits)] if hits else text
    sent = ""
    for out in outs:
        sent += out.text
        assert final.startswith(sent), (stop, sent)  # nothing past the cut, ever
    assert sent == final
    assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    assert outs[-1].finish_reason == ("stop" if hits else "length")
    tokens = sum((o.token_ids for o in outs), [])
    assert "".join(map(chr, tokens)).startswith(final)


def test_final_only_gives_one_output_equal_to_the_deltas_joined():
    text = "hello there"
    (final,), _ = _run(text, ["re"], RequestOutputKind.FINAL_ONLY)
    deltas, _ = _run(text, ["re"])
    assert final.text == "".join(d.text for d in deltas) == "hello the"
    assert final.token_ids == sum((d.token_ids for d in deltas), [])
    assert final.prompt == ">" and final.finish_reason == "stop"


def test_delta_logprobs_are_the_new_tokens_and_concatenate():
    text = "abcdefg"
    deltas, _ = _run(text, [], logprobs=1, per_step=2)
    (final,), _ = _run(text, [], RequestOutputKind.FINAL_ONLY, logprobs=1, per_step=2)
    joined = sum((d.logprobs for d in deltas), [])
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [list(p) for p in joined] == [list(p) for p in final.logprobs]
    assert [p[ord(c)].logprob for p, c in zip(joined, text, strict=True)] == \
        [-float(ord(c)) for c in text]
    assert final.cumulative_logprob == pytest.approx(-sum(map(ord, text)))


def test_cumulative_outputs_hold_everything_so_far():
    outs, _ = _run("abcdef", ["zz"], RequestOutputKind.CUMULATIVE, per_step=2)
    # (the last character waits while a two-character stop string could still start)
    assert [o.text for o in outs] == ["a", "abc", "abcdef"]
    assert outs[-1].token_ids == list(map(ord, "abcdef"))
