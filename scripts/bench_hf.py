"""In-run peer: HF transformers `generate` on the same shared-prefix workload (GPU, torch).

Random weights of a named architecture, prompts of `prefix` shared + `unique` own tokens,
`--output-len` new tokens (min_new_tokens = max_new_tokens, so EOS never stops early),
batches of `--batch-size`. Reports output tokens/s with the eager (dynamic) KV cache and,
with --static, with HF's static cache (which generate compiles itself).

    python scripts/bench_hf.py --model llama-2-7b --num-prompts 64 --batch-size 64 --output-len 128
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def run(model, prompts: torch.Tensor, output_len: int, batch: int, static: bool) -> float:
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    if static:
        kw["cache_implementation"] = "static"
    model.generate(prompts[:batch], **kw)  # warm-up / compile
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        model.generate(prompts[i : i + batch], **kw)
    torch.cuda.synchronize()
    return len(prompts) * output_len / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-2-7b", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=596)
    ap.add_argument("--unique-len", type=int, default=104)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[args.model], max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(10, cfg.vocab_size, (1, args.prefix_len), generator=g)
    own = torch.randint(10, cfg.vocab_size, (args.num_prompts, args.unique_len), generator=g)
    prompts = torch.cat([shared.expand(args.num_prompts, -1), own], dim=1).cuda()
    res = {"model": args.model, "num_prompts": args.num_prompts, "batch": args.batch_size,
           "output_len": args.output_len}
    with torch.inference_mode():
        res["eager_tok_s"] = run(model, prompts, args.output_len, args.batch_size, False)
        if args.static:
            res["static_tok_s"] = run(model, prompts, args.output_len, args.batch_size, True)
    print(f"HF transformers generate: {res}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
