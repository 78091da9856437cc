"""The embedded default model on the CPU: decode speed against HF transformers, start-up.

Decode: jprefix (`LLM("smollm2-135m")`, the CPU defaults) and HF transformers eager
(torch, float32, the same GGUF dequantised by transformers' own loader; at torch's
default threads and at one thread, `HFEager`) in one process, alternating run by run,
best of `--repeats`. A run's decode rate is measured the same
way for both: the time of a generation of `--output-len` + 1 tokens minus that of a
generation of 1 token (the prefill), over `--output-len` tokens per stream; greedy, EOS
ignored, token-id prompts of `--input-len` tokens, one stream and `--batch` streams.

Start-up: `jprefix generate` (the README's first command, cache warm: the model already
fetched) in a fresh process, seconds to its first text on stdout; and, in this process,
seconds to load (`LLM(...)`) and to compile and run the first generation.

The machine's load average is recorded before and after: on a shared machine the
absolute rates move with the load, the in-run ratio much less; the start-up figures
come with the CPU seconds they took.

    python scripts/bench_cpu.py --repeats 3 --output-json cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as `python scripts/bench_cpu.py`
    sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"


def cli_first_text_s(timeout_s: float = 600) -> tuple[float, float]:
    """Seconds from starting `jprefix generate` in a fresh interpreter to its first line
    of generated text (the first "### " header and the text after it are printed
    together, once the batch is done), and the CPU seconds the process used until then
    (on a loaded machine the wall time is mostly waiting for a core)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-c", "import sys; from jprefix.entrypoints.cli import main; "
           "sys.exit(main(['generate']))"]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, cwd=ROOT)
    try:
        for line in proc.stdout:
            if line.startswith("### "):
                wall = time.perf_counter() - start
                break
        else:
            raise RuntimeError(f"jprefix generate printed no text (exit {proc.wait()})")
    finally:
        proc.kill()
        proc.wait(timeout=timeout_s)
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (now.ru_utime + now.ru_stime) - (used.ru_utime + used.ru_stime)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """n token-id prompts of `length` tokens (the same for both engines)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(n)]


class Jprefix:
    name = "jprefix"

    def __init__(self):
        from jprefix import LLM, SamplingParams

        t0 = time.perf_counter()
        self.llm = LLM(MODEL)
        self.load_s = time.perf_counter() - t0
        self._sp = SamplingParams

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        sp = self._sp(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        self.llm.generate(batch, sp, use_tqdm=False)


class HFEager:
    """transformers' eager generate at `threads` torch threads (torch's default: one per
    core). On a loaded machine torch's default threads can run many times slower than
    one (its workers spin-wait for cores that other processes hold), so both run and
    the ratio is taken against the faster."""

    def __init__(self, gguf_path: Path, threads: int, model=None):
        import torch
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = model or AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t0
        self.threads, self.name = threads, f"hf_eager_{threads}t"
        self._torch = torch

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        self._torch.set_num_threads(self.threads)
        ids = self._torch.tensor(batch)
        with self._torch.inference_mode():
            self.model.generate(ids, attention_mask=self._torch.ones_like(ids),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)


def decode_rate(engine, batch: list[list[int]], output_len: int) -> float:
    """Output tokens per second of decoding alone (module docstring)."""
    t0 = time.perf_counter()
    engine.generate(batch, 1)
    t1 = time.perf_counter()
    engine.generate(batch, output_len + 1)
    t2 = time.perf_counter()
    return len(batch) * output_len / max((t2 - t1) - (t1 - t0), 1e-9)


def run(args) -> dict:
    from models.fetch import fetch_embedded

    loads = [os.getloadavg()]
    path = fetch_embedded(MODEL)
    out: dict = {"model": MODEL, "cpus": os.cpu_count(),
                 "args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_startup:
        out["cli_first_text_s"], out["cli_first_text_cpu_s"] = cli_first_text_s()
    t0, c0 = time.perf_counter(), time.process_time()
    ours = Jprefix()
    out["jprefix_load_cpu_s"] = time.process_time() - c0
    vocab = ours.llm.engine.model.config.vocab_size
    first = prompts(1, args.input_len, vocab)
    t1 = time.perf_counter()
    ours.generate(first, 8)
    out["jprefix_load_s"] = ours.load_s
    out["jprefix_first_generation_s"] = time.perf_counter() - t1  # (compiles included)
    out["jprefix_to_first_text_s"] = time.perf_counter() - t0
    out["jprefix_to_first_text_cpu_s"] = time.process_time() - c0
    import torch

    default_threads = torch.get_num_threads()
    hf = HFEager(path, default_threads)
    out["hf_load_s"] = hf.load_s
    engines = [ours, hf]
    if default_threads != 1:
        engines.append(HFEager(path, 1, hf.model))
    for streams in (1, args.batch):
        batch = prompts(streams, args.input_len, vocab)
        rates: dict[str, list[float]] = {e.name: [] for e in engines}
        for e in engines:  # warm-up: every shape compiled once
            decode_rate(e, batch, 4)
        for rep in range(args.repeats):
            for e in engines if rep % 2 == 0 else engines[::-1]:
                rates[e.name].append(decode_rate(e, batch, args.output_len))
                print(f"streams {streams} {e.name}: {rates[e.name][-1]:.1f} tok/s", flush=True)
        best = {k: max(v) for k, v in rates.items()}
        peer = max(v for k, v in best.items() if k != "jprefix")
        out[f"decode_{streams}"] = {"runs": rates, "best": best,
                                    "ratio_to_best_hf": best["jprefix"] / peer}
    loads.append(os.getloadavg())
    out["loadavg_before_after"] = loads
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine (best kept)")
    parser.add_argument("--batch", type=int, default=16, help="streams of the batch case")
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skip-startup", action="store_true",
                        help="skip the fresh-process `jprefix generate` timing")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.output_json:
        args.output_json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
