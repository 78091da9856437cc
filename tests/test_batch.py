"""Step packing: slots follow block tables, padding goes to the null block, shapes bucket."""

import numpy as np
import pytest

from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import ScheduledSeq
from jprefix.core.sequence import Sequence
from jprefix.worker.flat_batch import flatten_batch
from jprefix.worker.pack import BucketConfig, bucket, pack_step
from jprefix.worker.request_rows import RequestRows

B = 4


def _sched(tokens, blocks, start, n, out=()):
    sp = SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    seq = Sequence("r", list(tokens), sp, seed=7)
    for t in out:
        seq.append_token(t)
    seq.block_table = list(blocks)
    return ScheduledSeq(seq, start, n, start + n == seq.num_tokens)


def test_bucket_is_next_power_of_two():
    assert [bucket(n, 8) for n in (1, 8, 9, 16, 17, 300)] == [8, 8, 16, 16, 32, 512]
    # past the step, multiples of it (a big prefill step pads at most step - 1 tokens)
    assert [bucket(n, 16, 512) for n in (300, 512, 513, 700, 4099, 8192)] == [
        512, 512, 1024, 1024, 4608, 8192]


def test_big_steps_pad_tokens_to_a_multiple_of_the_token_step():
    rows = [_sched(range(3, 3 + 1100), range(1, 300), 0, 1100)]
    b = pack_step(rows, B, BucketConfig())
    assert len(b["token_ids"]) == 1536 and b["cu_q_lens"][-1] == 1100
    assert len(pack_step(rows, B, BucketConfig(token_step=None))["token_ids"]) == 2048


def test_pack_places_every_token_at_its_slot():
    rng = np.random.default_rng(0)
    scheduled = [
        _sched(range(100, 110), [5, 9, 2], 0, 10),  # plain prefill
        _sched(range(200, 209), [7, 3, 11], 8, 1),  # prefix-cached: 8 cached, 1 new
        _sched(range(300, 306), [4, 6], 6, 1, out=[42]),  # decode of output 0
    ]
    rng.shuffle(scheduled)
    b = pack_step(scheduled, B, BucketConfig(min_tokens=16, min_seqs=8, min_blocks=4))
    assert b["token_ids"].shape == (16,) and b["block_tables"].shape == (8, 4)
    for i, sc in enumerate(scheduled):
        lo, hi = b["cu_q_lens"][i], b["cu_q_lens"][i + 1]
        assert hi - lo == sc.num_new_tokens
        assert b["kv_lens"][i] == sc.start + sc.num_new_tokens
        assert b["logits_idx"][i] == hi - 1
        for t in range(lo, hi):
            pos = b["positions"][t]
            assert b["token_ids"][t] == sc.seq.all_token_ids[pos]
            assert b["slot_mapping"][t] == sc.seq.block_table[pos // B] * B + pos % B
    n = b["cu_q_lens"][len(scheduled)]
    assert (b["slot_mapping"][n:] == 0).all()  # padding writes the null block
    assert (b["cu_q_lens"][len(scheduled):] == n).all()  # padding sequences have q_len 0
    assert (b["kv_lens"][len(scheduled):] == 0).all()
    assert b["temperature"][0] == np.float32(0.5) and b["top_k"][0] == 3
    assert (b["token_src"] == -1).all()  # every token known on the host
    decode = [i for i, sc in enumerate(scheduled) if sc.seq.num_output_tokens][0]
    assert b["counters"][decode] == 1  # samples its second output token


def test_pending_token_reads_the_previous_steps_output_row():
    sc = _sched(range(300, 306), [4, 6], 6, 1)  # position 6 is not on the host yet
    sc.seq.num_pending = 1
    other = _sched(range(10, 13), [3], 0, 3)
    b = pack_step([other, sc], B, BucketConfig(), pending_rows={sc.seq: 5})
    assert b["token_src"].tolist()[:4] == [-1, -1, -1, 5]
    assert (b["token_src"][4:] == -1).all()
    assert b["positions"][3] == 6 and b["kv_lens"][1] == 7
    assert b["counters"][1] == 1  # the pending token is output 0; this row samples output 1


def test_flatten_batch_round_trips_through_one_buffer():
    from jprefix.worker.flat_batch import unflatten_batch

    scheduled = [_sched(range(100, 110), [5, 9, 2], 0, 10), _sched(range(7), [4], 6, 1)]
    batch = pack_step(scheduled, B, BucketConfig())
    batch["seeds"][:2] = [2**32 - 1, 7]  # uint32 beyond int32 survives the int32 buffer
    batch["top_p"][:2] = [np.nan, -0.0]  # float bit patterns survive the int32 buffer
    flat, layout = flatten_batch(batch)
    assert flat.dtype == np.int32 and flat.size == sum(v.size for v in batch.values())
    back = unflatten_batch(flat, layout)
    assert set(back) == set(batch)
    for name, value in batch.items():
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(np.asarray(back[name]).view(np.uint32),
                                      value.view(np.uint32), err_msg=name)
    with pytest.raises(TypeError, match="'wide' is int64"):  # offsets count 4-byte items
        flatten_batch(batch | {"wide": np.zeros(3, np.int64)})


def test_table_arrays_follow_the_list_through_growth_and_replacement():
    seq, rows = Sequence("r", [1, 2, 3], SamplingParams()), RequestRows()
    seq.block_table = [5, 9]
    first = rows.table(seq)
    assert first.tolist() == [5, 9] and first.dtype == np.int32
    assert rows.table(seq) is first  # unchanged list: the same array
    seq.block_table.append(4)
    seq.block_table.extend([8, 1])
    assert rows.table(seq).tolist() == [5, 9, 4, 8, 1]
    seq.reset_blocks()  # preemption: a new, empty list
    assert rows.table(seq).tolist() == []
    seq.block_table = [7, 3, 2]  # replaced (e.g. by the prefix cache's match)
    assert rows.table(seq).tolist() == [7, 3, 2]
    tail = rows.suffix(seq, 1)
    assert tail.tolist() == [3, 2] and rows.suffix(seq, 1) is tail
    seq.block_table.append(6)
    assert rows.suffix(seq, 1).tolist() == [3, 2, 6]
    other = Sequence("r", [4, 5], SamplingParams())  # a later request reusing the id
    other.block_table = [7, 3, 2, 6]
    assert rows.table(other).tolist() == [7, 3, 2, 6]
    assert rows.distinct_prompt(other).tolist() == [4, 5]
    seq.block_table = [7]
    b = pack_step([ScheduledSeq(seq, 0, 3, True)], B, BucketConfig())
    assert b["block_tables"][0, :2].tolist() == [7, 0]


def _random_seqs(rng, n, prompt_len, num_blocks):
    """Sequences with random prompts, sampling settings and block tables."""
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", rng.integers(3, 99, prompt_len).tolist(), SamplingParams(
            temperature=float(rng.random()), top_k=int(rng.integers(1, 9)), seed=i))
        seq.block_table = rng.integers(1, 500, num_blocks).tolist()
        seqs.append(seq)
    return seqs


def test_pack_cache_gives_the_same_arrays_as_packing_afresh():
    """Steps that grow, replace, drop and reorder rows: packing with the cache carried
    between steps equals packing from scratch, array for array (cascade tables too)."""
    from jprefix.core.cascade import CascadePlan
    from jprefix.worker.pack import PackCache, pack_cascade

    rng = np.random.default_rng(5)
    seqs = _random_seqs(rng, 12, prompt_len=20, num_blocks=6)
    cache = PackCache()
    for step in range(40):
        for seq in seqs:
            seq.append_token(int(rng.integers(3, 99)))
            if len(seq.block_table) * B < seq.num_tokens:
                seq.block_table.append(int(rng.integers(1, 500)))  # grows in place
        change = rng.integers(0, 4)
        victim = seqs[int(rng.integers(len(seqs)))]
        if change == 1:  # replaced (as after preemption and a new prefix match)
            victim.block_table = rng.integers(1, 500, -(-victim.num_tokens // B)).tolist()
        elif change == 2 and len(seqs) > 3:
            seqs.remove(victim)  # finished
        elif change == 3:
            rng.shuffle(seqs)
        rows = [ScheduledSeq(s, s.num_tokens - 1, 1, True) for s in seqs]
        fresh = pack_step(rows, B, BucketConfig())
        cached = pack_step(rows, B, BucketConfig(), cache)
        assert fresh.keys() == cached.keys()
        for k in fresh:
            np.testing.assert_array_equal(cached[k], fresh[k], err_msg=f"step {step}: {k}")
        plan = CascadePlan(list(range(len(rows))), [2] * 3 + [0] * (len(rows) - 3), [3])
        S = len(fresh["kv_lens"])
        a = pack_cascade(rows, plan, B, S, 4)
        b = pack_cascade(rows, plan, B, S, 4, cache)
        for k in a:
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"step {step}: cascade {k}")


def test_steady_decode_repacking_equals_packing_afresh():
    """Decode steps of the same rows (tokens known or pending on the device, tables
    growing past their bucket, with and without a cascade plan) are repacked from the last
    step's buffers; between them rows are replaced, dropped, reordered and prefilled. The
    runner's packing with its cache equals packing from scratch, buffer for buffer."""
    from jprefix.core.cascade import CascadePlan
    from jprefix.worker.input_batch import StepPacker

    rng = np.random.default_rng(11)
    seqs = _random_seqs(rng, 10, prompt_len=14, num_blocks=4)
    packer, plan, repacked, last_decode = StepPacker(B, BucketConfig()), None, 0, None
    for step in range(160):
        mode = rng.integers(0, 3)  # newest tokens known, pending on the device, or a mix
        pending = {s.request_id for s in seqs if mode == 1 or mode == 2 and rng.random() < .5}
        output_rows = {}  # where each sequence's newest token sits in the last step's output
        for row, seq in enumerate(seqs):
            seq.append_token(int(rng.integers(3, 99)))
            output_rows[seq] = row + 1
            if len(seq.block_table) * B <= seq.num_tokens:
                seq.block_table.append(int(rng.integers(1, 500)))  # grows in place
        change = rng.integers(0, 13)
        victim = seqs[int(rng.integers(len(seqs)))]
        if change == 6 and plan is not None:  # a group's first row, under the same plan
            victim = seqs[plan.order[0]]
        if change in (1, 6):  # replaced (preemption, a new prefix match): shorter or longer
            extra = int(rng.choice([0, 1, 9]))
            victim.block_table = rng.integers(1, 500, victim.num_tokens // B + 1 + extra).tolist()
        elif change == 2 and len(seqs) > 3:
            seqs.remove(victim)  # finished
        elif change == 3:
            rng.shuffle(seqs)
        if change in (2, 3, 4) or plan is not None and len(plan.order) != len(seqs):
            plan = None if rng.random() < 0.4 else CascadePlan(
                list(range(len(seqs)))[::-1], [3] * 3 + [0] * (len(seqs) - 3), [3])
        if change == 5:  # a prefill chunk in between: not a decode step
            rows = [ScheduledSeq(s, s.num_tokens - 3, 3, True) for s in seqs]
            plan = None
        else:
            rows = [ScheduledSeq(s, s.num_tokens - (s.request_id not in pending), 1, True)
                    for s in seqs]
        fresh_packer = StepPacker(B, BucketConfig(), reuse=False)
        fresh_packer.pending_rows, packer.pending_rows = output_rows, dict(output_rows)
        fresh = fresh_packer.pack(rows, plan).packed
        cached = packer.pack(rows, plan).packed
        assert cached.layout == fresh.layout, f"step {step}"
        for k in fresh.arrays:
            np.testing.assert_array_equal(cached.arrays[k], fresh.arrays[k],
                                          err_msg=f"step {step}: {k}")
        np.testing.assert_array_equal(cached.flat, fresh.flat)
        repacked += packer.decode is not None and packer.decode is last_decode
        last_decode = packer.decode
    assert repacked >= 50  # the steady path ran, and not only a few times


def test_repacking_follows_a_table_that_shrinks_below_its_width_bucket():
    """A row's table replaced by a shorter one (re-admitted after preemption) can shrink
    the tables' width bucket; the repacked step has the fresh width, cascade tables too."""
    from jprefix.core.cascade import CascadePlan
    from jprefix.worker.input_batch import StepPacker

    rng = np.random.default_rng(3)
    seqs = _random_seqs(rng, 2, prompt_len=10, num_blocks=3)
    seqs[0].block_table = rng.integers(1, 500, 9).tolist()  # width bucket 16
    for plan in (None, CascadePlan([0, 1], [2, 2], [2])):
        packer = StepPacker(B, BucketConfig())
        for step in range(3):
            if step == 2:
                seqs[0].block_table = rng.integers(1, 500, 3).tolist()  # bucket 4
            for seq in seqs:
                seq.append_token(int(rng.integers(3, 99)))
            rows = [ScheduledSeq(s, s.num_tokens - 1, 1, True) for s in seqs]
            fresh = StepPacker(B, BucketConfig(), reuse=False).pack(rows, plan).packed
            cached = packer.pack(rows, plan).packed
            assert cached.layout == fresh.layout
            np.testing.assert_array_equal(cached.flat, fresh.flat)
        assert fresh.arrays["block_tables"].shape[1] == 4


def test_penalty_entries_never_shrink_within_a_packer():
    """An extra step's penalty entry count is its packer's highest so far: a batch whose
    penalised rows finish keeps the shape it compiled (no recompile as entries shrink);
    a fresh packer sizes from the step alone."""
    from jprefix.worker.input_batch import StepPacker

    rng = np.random.default_rng(5)
    sp = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    seqs = []
    for i in range(4):
        seq = Sequence(f"r{i}", rng.integers(3, 999, 40).tolist(), sp, seed=i)
        seq.block_table = rng.integers(1, 500, 11).tolist()
        seqs.append(seq)
    packer = StepPacker(B, BucketConfig())

    def entries(rows, p):
        return len(p.pack(rows, None).packed.arrays["pen_ids"])

    all_rows = [ScheduledSeq(s, s.num_tokens - 1, 1, True) for s in seqs]
    big = entries(all_rows, packer)
    assert big >= 64  # 4 rows' distinct prompt tokens
    one = all_rows[:1]
    assert entries(one, packer) == big
    assert entries(one, StepPacker(B, BucketConfig())) < big
