"""Host work of one engine step, without a device: the engine steps a decode-heavy
workload with the model runner replaced by a stub that packs the step (as the real one
does) and returns fixed tokens. Measures scheduling + cascade planning + packing +
postprocessing, i.e. what async scheduling must hide behind the device step.
`--sampling` gives every request every sampling feature (bench_step's EXTRA: penalties,
min_p, a logit bias, logprobs): every step is the extra variant, its logits-processing
arrays packed (`jprefix.worker.pack_sampling`) and its (zero) logprobs attached.

    python scripts/bench_host.py --num-prompts 256 [--sampling] [--profile]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import time
from types import SimpleNamespace

import numpy as np

from jprefix.core.sampling_params import MAX_LOGPROBS, SamplingParams
from jprefix.engine.args import EngineArgs
from jprefix.engine.llm_engine import LLMEngine
from jprefix.worker.input_batch import StepPacker
from jprefix.worker.pack import BucketConfig
from jprefix.worker.step_handle import StepHandle
from scripts.bench_step import EXTRA


class PackingStub:
    """ModelRunner's host half: packs and flattens every step, samples token 42 (an extra
    step's logprobs: zeros, of the device output's shapes)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size  # (as ModelRunner)
        self.buckets = BucketConfig(min_seqs=8)
        self.last_timing, self.shapes_seen = (0.0, 0.0), set()
        self.packer = StepPacker(block_size, self.buckets)

    def dispatch(self, scheduled, plan=None, token_masks=None) -> StepHandle:
        packed = self.packer.pack(scheduled, plan)
        return StepHandle(None, len(packed.rows), packed.order,
                          packed.prompt_positions if packed.kind.extra else None)

    def fetch(self, handle: StepHandle) -> np.ndarray:
        return np.full(handle.num_rows, 42, np.int32)

    def fetch_logprobs(self, handle: StepHandle) -> tuple[tuple, tuple]:
        def zeros(n: int) -> tuple:
            return (np.zeros(n, np.float32), np.ones(n, np.int32),
                    np.zeros((n, MAX_LOGPROBS), np.int32),
                    np.zeros((n, MAX_LOGPROBS), np.float32))
        return zeros(handle.num_rows), zeros(len(handle.prompt_positions))


def stub_engine(args: EngineArgs) -> LLMEngine:
    """An LLMEngine over the stub runner (no model, no device)."""
    cfg = SimpleNamespace(max_position_embeddings=4096, eos_token_ids=[2], vocab_size=32000,
                          uniform_sliding_window=None, layer_windows=(None,))
    model = SimpleNamespace(config=cfg, tokenizer=None, name="stub", params=None)
    return LLMEngine(model, args, runner=PackingStub(args.num_kv_blocks, args.block_size))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=596)
    ap.add_argument("--unique-len", type=int, default=104)
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps (10 chunks)")
    ap.add_argument("--no-cascade", action="store_true")
    ap.add_argument("--sampling", action="store_true",
                    help="every request sets every sampling feature (the extra step)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    args = ap.parse_args(argv)
    engine = stub_engine(EngineArgs(num_kv_blocks=16384, enable_cascade=not args.no_cascade))
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 32000, args.prefix_len).tolist()
    sp = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    if args.sampling:
        sp = dataclasses.replace(EXTRA, max_tokens=args.steps + 64, ignore_eos=True)
    for _ in range(args.num_prompts):
        prompt = shared + rng.integers(10, 32000, args.unique_len).tolist()
        engine.add_request(None, prompt, sp, args.prefix_len)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running.values()) or \
            len(engine.scheduler.running) < args.num_prompts:
        engine.step()  # prefill
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    chunks = []
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(args.steps // 10):
            engine.step()
        chunks.append((time.perf_counter() - t) / (args.steps // 10) * 1e3)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    result = dict(num_seqs=args.num_prompts, cascade=not args.no_cascade,
                  sampling=args.sampling,
                  ms_per_step_min=min(chunks), ms_per_step_median=statistics.median(chunks))
    features = ", every sampling feature" if args.sampling else ""
    print(f"host work per decode step, {args.num_prompts} sequences, cascade "
          f"{'off' if args.no_cascade else 'on'}{features}: min {min(chunks):.2f} ms, median "
          f"{statistics.median(chunks):.2f} ms (10 chunks of {args.steps // 10} steps)")
    return result


if __name__ == "__main__":
    main()
