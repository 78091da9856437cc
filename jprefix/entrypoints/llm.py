"""The user's surface: `jprefix.generate(params, prompts, prefix_len)` and `LLM`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from jprefix.core.outputs import RequestOutput, RequestOutputKind
from jprefix.core.sampling_params import SamplingParams
from jprefix.engine.args import EngineArgs
from jprefix.engine.dp_engine import DataParallelEngine
from jprefix.engine.input_processor import as_prompt_list, broadcast, render_chat
from jprefix.engine.llm_engine import LLMEngine
from jprefix.engine.parallel_sampling import SampleGroup, merge
from jprefix.engine.runner_setup import load_model
from jprefix.entrypoints.driver import EngineDriver
from models import loader
from models.loader import LoadedModel

# what LLM takes as keyword arguments besides its own (model, tensor_parallel_size, ...)
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)} - {
    "tensor_parallel_size", "dtype", "load_format"}


def load(model: str = loader.DEFAULT_MODEL, dtype: str = "auto", load_format: str = "auto",
         **kwargs: Any) -> LoadedModel:
    """`models.loader.load` (a preset name, an HF directory, a .gguf file or a hub id),
    after setting the XLA flags the engine runs with (they must be set before jax
    initialises its backend, which loading does). `dtype="auto"`: float32 on the CPU, the
    checkpoint's dtype or bfloat16 on an accelerator (`engine.args.resolve_dtype`, which
    the engine uses too)."""
    return load_model(model, dtype, load_format, **kwargs)


class LLM:
    """An offline and async LLM with prefix caching, vLLM-style.

    >>> llm = LLM(model="smollm2-135m")
    >>> outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32),
    ...                     prefix_pos=[16, 16])
    """

    def __init__(
        self,
        model: str | LoadedModel = "smollm2-135m",
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        load_format: str = "auto",
        **engine_kwargs: Any,
    ):
        """`model`: a name `jprefix.load` takes (loaded here, in the engine's layout) or a
        LoadedModel; `engine_kwargs`: EngineArgs' fields. With `data_parallel_size=N`
        (N > 1) the engine is a `DataParallelEngine`: N replicas, each on its own
        `tensor_parallel_size` devices, requests routed by `routing_policy`."""
        unknown = set(engine_kwargs) - _ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown engine arguments {sorted(unknown)}")
        args = EngineArgs(tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                          load_format=load_format, **engine_kwargs)
        self.engine: LLMEngine | DataParallelEngine = (
            DataParallelEngine(model, args) if args.data_parallel_size > 1
            else LLMEngine(model, args))
        self._driver = EngineDriver(self.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def scheduler(self):
        """The engine's scheduler (ValueError with data parallelism: one per replica)."""
        return self.engine.scheduler

    @property
    def prefix_pool(self):
        """The prefix cache's user surface (over every replica's with data parallelism)."""
        return self.engine.prefix_pool

    def stats(self) -> dict[str, Any]:
        """Counters for /stats: the prefix cache's (summed over replicas: queried and hit
        tokens, hit rate, cached and evictable blocks), `data_parallel_size`, and
        `replicas`, one dict per replica (requests, running, waiting, queued tokens, its
        hit rate, KV blocks used and usage; `LLMEngine.counters`)."""
        return self.engine.summary()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prefix_pos: int | list[int | None] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for a batch of prompts; outputs come back in prompt order, each with
        its `n` samples in `outputs`. Prompts with different `cache_salt`s (one for all,
        or one per prompt) never share cached blocks.

        Every prompt is validated before any is scheduled, so one bad prompt raises
        ValueError and leaves the engine untouched.
        """
        prompts = as_prompt_list(prompts)
        params = broadcast(sampling_params, len(prompts), "sampling_params")
        prefixes = broadcast(prefix_pos, len(prompts), "prefix_pos")
        salts = broadcast(cache_salt, len(prompts), "cache_salt")
        groups = [
            self.engine.make_request(p, _kind(sp, _FINAL), pl, cache_salt=salt)
            for p, sp, pl, salt in zip(prompts, params, prefixes, salts, strict=True)
        ]
        done = self._driver.run(groups, use_tqdm)
        return [merge(g, [done[rid] for rid in g.request_ids]) for g in groups]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        cache_salt: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation ({"role", "content"}
        dicts) or to each of a list of them, rendered with the model's chat template (the
        renderer the CLI and the server use: message contents are plain text)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs:
            raise ValueError("messages is empty: give a conversation")
        prompts = [render_chat(self.tokenizer, conv, add_generation_prompt) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    async def generate_async(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        prefix_pos: int | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Generates for one prompt (its `n` samples) while other requests run; cancel to
        abort it. Requests with different `cache_salt`s never share cached blocks. The
        prompt is tokenised in a worker thread, so a long one does not stall the event
        loop."""
        group = await self.make_request_async(prompt, _kind(sampling_params, _FINAL),
                                              prefix_pos, request_id, cache_salt)
        return await self.generate_group(group)

    async def make_request_async(self, prompt: Any, sampling_params: SamplingParams | None = None,
                                 prefix_pos: int | None = None, request_id: str | None = None,
                                 cache_salt: str | None = None) -> SampleGroup:
        """Validates and tokenises one request (ValueError naming a bad value) in a worker
        thread, and returns its handle (`engine.make_request`); nothing is scheduled until
        `generate_group` or `stream_group`. Its `sampling_params.output_kind` says what
        `stream_group` yields (DELTA: the new text and tokens of each step)."""
        return await asyncio.to_thread(self.engine.make_request, prompt, sampling_params,
                                       prefix_pos, request_id, cache_salt)

    async def generate_group(self, group: SampleGroup) -> RequestOutput:
        """Runs a request to one merged output of its samples; cancelling aborts all."""
        if group.sampling_params.output_kind is not _FINAL:
            raise ValueError(f"request {group.request_id!r} streams its outputs "
                             f"({group.sampling_params.output_kind.name}): use stream_group")
        return merge(group, await self._driver.submit(group))

    def stream_group(self, group: SampleGroup) -> AsyncIterator[RequestOutput]:
        """Every RequestOutput of a request's samples as steps produce them (each
        `request_id` is one of `group.request_ids`), ending with each one's finished
        output. Leaving the loop early aborts the request and frees its blocks."""
        return self._driver.stream(group)

    def stream_async(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        prefix_pos: int | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validates the request now (ValueError), then returns an async iterator over its
        outputs: with the default `output_kind` a DELTA output per step (the new text,
        token ids and logprobs; they concatenate to the final output, whose
        `finish_reason` is set), or as `sampling_params.output_kind` asks. With n > 1
        the samples' outputs interleave, told apart by `request_id` (`<id>-<i>`)."""
        sp = sampling_params or SamplingParams()
        if sp.output_kind is _FINAL:
            sp = _kind(sp, RequestOutputKind.DELTA)
        return self._driver.stream(self.engine.make_request(prompt, sp, prefix_pos, request_id,
                                                            cache_salt))

    def wait_idle(self) -> None:
        """Returns once the background stepping thread (if one runs) has exited: after
        the last async request finished, a step may still be in flight (the driver's
        exit hook also waits for it: a thread torn down inside XLA aborts the process)."""
        thread = self._driver.thread
        if thread is not None:
            thread.join()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Aborts every request in flight (their callers get a RuntimeError) and waits up
        to `timeout` seconds for the stepping thread to exit; True once none runs. Call it
        before the process exits while callers may still be waiting (the server does);
        the LLM takes new requests afterwards."""
        return self._driver.close(timeout)

    def warmup(self, prefixes: list[Any], pin: bool = False) -> list[Any]:
        """Computes each prefix once so later requests hit the cache; returns the Prefix
        objects (their `.hash` is what `prefix_pool.delete_prefix` takes)."""
        prefixes = as_prompt_list(prefixes)
        warm = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        outs = self.generate(prefixes, warm, prefix_pos=None, use_tqdm=False)
        return [
            self.prefix_pool.add_or_get_prefix(out.prompt_token_ids, len(out.prompt_token_ids),
                                               pin=pin)
            for out in outs
        ]

    def reset_prefix_cache(self) -> bool:
        """Drops every unreferenced cached block; False while blocks are in use."""
        return self.prefix_pool.reset()

    def save_prefix_cache(self, path: str) -> int:
        """Writes the prefix cache (HBM and host tier) to `path`, for
        `LLM(..., prefix_cache_path=path)`; returns the blocks written."""
        return self.engine.save_prefix_cache(path)


_FINAL = RequestOutputKind.FINAL_ONLY


def _kind(sp: SamplingParams | None, kind: RequestOutputKind) -> SamplingParams:
    """`sp` (default: SamplingParams()) with output_kind `kind`."""
    sp = sp or SamplingParams()
    return sp if sp.output_kind is kind else dataclasses.replace(sp, output_kind=kind)


def generate(
    params: LoadedModel | str,
    prompts: Any,
    prefix_len: int | list[int | None] | None = None,
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
    cache_salt: str | list[str | None] | None = None,
    **engine_kwargs: Any,
) -> list[RequestOutput]:
    """Functional form: `generate(jprefix.load("smollm2-135m"), prompts, prefix_len)`.

    `prefix_len` is one int for all prompts, one per prompt, or None (automatic mode: every
    full prompt block is shareable); `cache_salt` as in `LLM.generate`. `engine_kwargs`:
    `LLM`'s (`tensor_parallel_size`, `data_parallel_size`, `routing_policy`, EngineArgs'
    fields).
    """
    use_tqdm = engine_kwargs.pop("use_tqdm", False)
    llm = LLM(params, **engine_kwargs)
    return llm.generate(prompts, sampling_params, prefix_pos=prefix_len, use_tqdm=use_tqdm,
                        cache_salt=cache_salt)
