"""What the command line tells a person while it works: the loaded engine in one line,
the XLA programs compiled so far (count and seconds), and quiet third-party output.

`CompileWatch` listens to jax's compile events (tracing, lowering, XLA compiling): the
engine compiles one program per step shape on first use, so on the CPU a first run
spends most of its time there, and a table that lumps it with generation misreads the
engine's speed."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

# jax's compile events whose durations make up a compile (jax._src.dispatch's names)
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_BACKEND = _COMPILE_EVENTS[-1]


def quiet_third_parties(progress_bars: bool | None) -> None:
    """Before transformers and huggingface_hub are imported: no transformers advisory
    ("PyTorch was not found...": jprefix runs no torch model), and tqdm bars only on a
    terminal unless `progress_bars` (None: when stderr is a terminal) - written to a log
    or CI, a bar prints a line per refresh."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not (sys.stderr.isatty() if progress_bars is None else progress_bars):
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


class CompileWatch:
    """Counts the XLA programs compiled and the seconds spent compiling, from the moment
    it is made; `on_compile(count, seconds)` (if given) after each program."""

    _instances: list[CompileWatch] = []
    _lock = threading.Lock()

    def __init__(self, on_compile: Any = None):
        self.count, self.seconds, self.on_compile = 0, 0.0, on_compile
        with CompileWatch._lock:
            if not CompileWatch._instances:
                import jax

                jax.monitoring.register_event_duration_secs_listener(CompileWatch._event)
            CompileWatch._instances.append(self)

    def close(self) -> None:
        with CompileWatch._lock:
            if self in CompileWatch._instances:
                CompileWatch._instances.remove(self)

    @staticmethod
    def _event(event: str, duration: float, **_kwargs: Any) -> None:
        if event not in _COMPILE_EVENTS:
            return
        for watch in list(CompileWatch._instances):
            watch.seconds += duration
            if event == _BACKEND:
                watch.count += 1
                if watch.on_compile is not None:
                    try:  # (a progress display never breaks a compile)
                        watch.on_compile(watch.count, watch.seconds)
                    except Exception:
                        watch.on_compile = None


class StatusLine:
    """One line of progress on a terminal (rewritten in place), or plain lines at most
    every `every` seconds elsewhere."""

    def __init__(self, stream: TextIO | None = None, every: float = 5.0):
        self.stream, self.every = stream or sys.stderr, every
        self.tty = self.stream.isatty()
        self._last, self._shown = 0.0, False

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write(f"\r\033[K{text}")
            self._shown = True
        elif force or now - self._last >= self.every:
            self.stream.write(text + "\n")
            self._last = now
        self.stream.flush()

    def done(self, text: str | None = None) -> None:
        """Ends the status line (`text`: its last words, kept)."""
        if self.tty and self._shown:
            self.stream.write("\r\033[K")
            self._shown = False
        if text:
            self.stream.write(text + "\n")
        self.stream.flush()


def describe(llm: Any) -> str:
    """The engine in one line: model, dtype, KV-cache blocks and the context length
    (an object without an engine: its repr)."""
    engine = getattr(llm, "engine", None)
    if engine is None:
        return repr(llm)
    replicas = getattr(engine, "replicas", [engine])
    first = replicas[0]
    blocks = sum(getattr(r.runner, "num_blocks", 0) for r in replicas)
    dtype = getattr(getattr(engine.model.params, "embed", None), "dtype", "?")
    block = first.args.block_size
    over = f" over {len(replicas)} replicas" if len(replicas) > 1 else ""
    return (f"{engine.model.name}: dtype {dtype}, KV cache {blocks} blocks of {block} tokens "
            f"({blocks * block} tokens{over}), max model len {engine.max_model_len}")


def load_error(exc: BaseException, model: str) -> str:
    """A load failure as one line naming the command-line flags (not Python keywords)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.replace("load_format='dummy'", "--load-format dummy")
    return f"--model {model!r}: {text}"
