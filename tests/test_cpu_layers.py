"""The CPU's layer loop (`worker.layer_switch`): per-layer weight buffers under one scan,
fused (the default: Q/K/V one matrix, gate/up one) or not, give the stacked scan's and
the dense reference's tokens, the fused scan really runs 4 matmuls per layer (not 7), and
the compiled step copies no layer's weights (a stacked scan slices a copy of every layer's
matrices on every step); one stream decoding packs into T = 2, S = 1
(`BucketConfig.single_stream`)."""

import re

import jax
import numpy as np
import pytest

import jprefix
import jprefix.worker.params as worker_params
from jprefix import LLM, SamplingParams
from jprefix.core.scheduler import ScheduledSeq
from jprefix.core.sequence import Sequence
from jprefix.worker.layer_switch import MATMUL_FIELDS
from jprefix.worker.pack import BucketConfig, pack_step
from models.reference import dense_generate
from scripts.memcheck import compile_step, synthetic_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's layout")


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")


def _unfused(monkeypatch) -> None:
    """The CPU's default layout with per-layer buffers left unfused (layout "per_layer")."""
    unstack = worker_params._unstack_in_host_memory
    monkeypatch.setattr(worker_params, "_unstack_in_host_memory",
                        lambda params, fuse=False: unstack(params, False))


def test_scanned_layer_buffers_match_stacked_layers_and_the_reference(tiny, monkeypatch):
    prompts = [np.random.default_rng(i).integers(3, 200, 11 + 5 * i).tolist() for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [dense_generate(tiny.params, tiny.config, p, 6, eos_token_ids=()) for p in prompts]
    outs, layouts = {}, {}
    for name, unroll in (("fused", None), ("unfused", None), ("stacked", False),
                         ("unrolled", True)):
        if name == "unfused":
            _unfused(monkeypatch)
        llm = LLM(tiny, block_size=8, num_kv_blocks=64, unroll_layers=unroll)
        monkeypatch.undo()
        layouts[name] = llm.engine.runner.params.layout
        batch = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        alone = llm.generate(prompts[:1], sp, use_tqdm=False)[0].token_ids  # T=2, S=1
        outs[name] = (batch, alone)
    assert layouts == {"fused": "fused", "unfused": "per_layer", "stacked": "stacked",
                       "unrolled": "fused"}
    assert outs["fused"] == outs["unfused"] == outs["stacked"] == outs["unrolled"]
    assert outs["fused"][0] == want and outs["fused"][1] == want[0]


def _num_dots(runner) -> int:
    rows = synthetic_rows([[1] * 9], [[1, 2]], [1])
    return len(re.findall(r" dot\(", compile_step(runner, rows).as_text()))


def test_fused_scan_runs_four_matmuls_per_layer(tiny, monkeypatch):
    fused = LLM(tiny, block_size=8, num_kv_blocks=32).engine.runner
    _unfused(monkeypatch)
    unfused = LLM(tiny, block_size=8, num_kv_blocks=32).engine.runner
    lp = fused.params.layers[0]
    assert lp.wk is None and lp.w_up is None and lp.wq.shape[1] == unfused.params.layers[0].wq \
        .shape[1] + 2 * unfused.params.layers[0].wk.shape[1]
    # each layer's branch: Q/K/V and gate/up one dot each, where the unfused run five
    assert _num_dots(unfused) - _num_dots(fused) == tiny.config.num_layers * 3


def _weight_copies(runner) -> list[str]:
    """The compiled decode step's instructions that make an array of a layer matmul
    weight's shape out of a dynamic slice (a per-step copy of that layer's weights)."""
    lp = jax.tree.map(lambda x: x[0], runner.params.layers) if runner.params.layout == \
        "stacked" else runner.params.layers[0]
    shapes = {",".join(map(str, getattr(lp, f).shape)) for f in MATMUL_FIELDS
              if getattr(lp, f) is not None}
    rows = synthetic_rows([[1] * 9], [[1, 2]], [1])
    text = compile_step(runner, rows).as_text()
    made = re.compile(r"= f32\[([0-9,]+)\]\S* (dynamic-slice|fusion)\(")
    return [line for line in text.splitlines()
            if (m := made.search(line)) and m.group(1) in shapes and "dynamic_slice" in line]


def test_scanned_layer_buffers_copy_no_layer_weights(tiny):
    stacked = LLM(tiny, block_size=8, num_kv_blocks=32, unroll_layers=False).engine.runner
    assert _weight_copies(stacked)  # (the check sees the stacked scan's copies)
    runner = LLM(tiny, block_size=8, num_kv_blocks=32).engine.runner
    assert runner.params.layout == "fused"
    assert _weight_copies(runner) == []


def test_one_stream_decoding_packs_two_tokens_and_one_sequence():
    seq = Sequence("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    seq.block_table = [1]
    row = [ScheduledSeq(seq, 2, 1, True)]
    on = pack_step(row, 8, BucketConfig(single_stream=True))
    off = pack_step(row, 8, BucketConfig())
    assert (len(on["token_ids"]), len(on["kv_lens"])) == (2, 1)
    assert (len(off["token_ids"]), len(off["kv_lens"])) == (16, 8)
    assert on["token_ids"][0] == off["token_ids"][0] == 7
    assert on["slot_mapping"][1] == 0  # the padding row writes to the null block
    two = [ScheduledSeq(seq, 2, 1, True), ScheduledSeq(seq, 2, 1, True)]
    assert len(pack_step(two, 8, BucketConfig(single_stream=True))["token_ids"]) == 16


@pytest.mark.parametrize("n,T", [(3, 4), (5, 8), (8, 8), (9, 16)])
def test_one_stream_of_a_few_tokens_packs_one_sequence(n, T):
    """A verify row or a short chunk of one stream: S = 1 and the power of two >= its
    tokens up to `single_stream_tokens`, the minimums past it."""
    seq = Sequence("a", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=4))
    seq.block_table = [1, 2, 3]
    batch = pack_step([ScheduledSeq(seq, 0, n, False)], 8, BucketConfig(single_stream=True))
    assert (len(batch["token_ids"]), len(batch["kv_lens"])) == (T, 1 if T < 16 else 8)
    assert batch["token_ids"][:n].tolist() == list(range(5, 5 + n))
    assert (batch["slot_mapping"][n:] == 0).all()  # padding writes to the null block
