"""How far one request travels: the first-party files a `generate` call (or a streamed
request through the async API) passes through once compiled, and how often a call
turns back up a layer (a callee in a layer above its caller's: core < worker < engine <
entrypoints; models and pallas_kernels below core). Runs the tiny dummy model on the CPU.

    python scripts/probes/probe_walk.py [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS = {"models": 0, "pallas_kernels": 0, "jprefix/core": 1, "jprefix/worker": 2,
          "jprefix/engine": 3, "jprefix/entrypoints": 4, "jprefix": 4}


def layer(path: str) -> int | None:
    rel = Path(path).resolve()
    try:
        rel = rel.relative_to(ROOT)
    except ValueError:
        return None
    for prefix, level in LAYERS.items():
        if str(rel).startswith(prefix + "/") or str(rel) == prefix + ".py":
            return level
    return None


def trace(run) -> dict:
    """Files entered (in first-call order) and calls back up a layer while `run()` runs."""
    files: dict[str, None] = {}
    turns: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        to = layer(callee)
        if to is None:
            return
        files[str(Path(callee).resolve().relative_to(ROOT))] = None
        caller = frame.f_back
        while caller is not None and layer(caller.f_code.co_filename) is None:
            caller = caller.f_back  # (through library frames: asyncio, threading)
        if caller is not None and layer(caller.f_code.co_filename) < to:
            turns.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_code.co_name} -> "
                         f"{Path(callee).name}:{frame.f_code.co_name}")

    import threading
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {"files": len(files), "back_turns": len(set(turns)), "file_list": list(files),
            "turn_list": sorted(set(turns))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stream", action="store_true", help="a streamed request instead")
    args = ap.parse_args()
    import jprefix
    from jprefix import LLM, SamplingParams

    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    llm = LLM(tiny, block_size=8, num_kv_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 40))
    llm.generate([prompt], sp, use_tqdm=False)  # compile first

    async def stream():
        async for _ in llm.stream_async(prompt, sp):
            pass

    def run():
        if args.stream:
            asyncio.run(stream())
        else:
            llm.generate([prompt], sp, use_tqdm=False)

    print(json.dumps(trace(run), indent=1))


if __name__ == "__main__":
    main()
