"""`jprefix serve`: the OpenAI-compatible server, with `vllm serve`'s command line.

The model is positional (`jprefix serve smollm2-135m`) or `--model`; every EngineArgs field
is a flag (`cli_args`); the server's flags carry vLLM's names and meanings. vLLM flags
that mean nothing here (--swap-space, --enable-lora, --pipeline-parallel-size, ...) are
refused with the reason (`REFUSED`), never silently ignored.
Start-up says what it does: loading, the engine chosen (dtype, KV blocks, max length),
the default sampling parameters taken from the checkpoint, and the programs compiled.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from jprefix.entrypoints.cli_args import add_engine_args

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # (= openai_server's, which imports fastapi)
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
# generation_config.json's fields that vLLM takes as default sampling parameters
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                     "max_new_tokens": "max_tokens"}
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="  # (= worker.xla_flags')
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
REFUSED = {
    "--pipeline-parallel-size": "pipeline parallelism is not implemented: split a model "
                                "with --tensor-parallel-size, replicate it with "
                                "--data-parallel-size",
    "--device": "jprefix runs on JAX's default backend (choose it with JAX_PLATFORMS)",
    "--swap-space": "a preempted request is recomputed, never swapped to host memory",
    "--cpu-offload-gb": "weights are never offloaded to host memory",
    "--enable-lora": "LoRA adapters are not supported",
    "--lora-modules": "LoRA adapters are not supported",
    "--trust-remote-code": "jprefix runs no checkpoint code (Baichuan2: pass --tokenizer)",
    "--enable-auto-tool-choice": "tool calls are not supported",
    "--tool-call-parser": "tool calls are not supported",
    "--reasoning-parser": "reasoning parsers are not implemented",
    "--distributed-executor-backend": "one process per host, through jax.distributed "
                                      "(--num-processes, --process-id)",
    "--kv-transfer-config": "disaggregated prefill is not implemented",
    "--enable-sleep-mode": "sleep mode is not implemented",
    "--tokenizer-mode": "the tokenizer is always transformers' fast tokenizer",
    "--num-scheduler-steps": "steps overlap through --async-scheduling instead",
}
logger = logging.getLogger("jprefix.serve")


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported by jprefix: "
                     f"{REFUSED[option_string]}")


def add_serve_parser(sub: Any, version: str) -> argparse.ArgumentParser:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                         description=__doc__.split("\n\n")[0])
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help=f"path, GGUF, hub id or preset (default: {DEFAULT_MODEL})")
    srv.add_argument("--model", default=None, help="the model, as the positional MODEL")
    srv.add_argument("--version", action="version", version=f"jprefix {version}")
    srv.add_argument("--served-model-name", default=None,
                     help="the name requests' `model` must carry (default: the model)")
    http = srv.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--uds", default=None, help="a Unix domain socket instead of host:port")
    http.add_argument("--ssl-keyfile", default=None)
    http.add_argument("--ssl-certfile", default=None)
    http.add_argument("--root-path", default="", help="the path prefix behind a proxy")
    http.add_argument("--allowed-origins", default=None,
                      help='CORS origins, a JSON list (\'["https://a.example"]\') or comma-'
                           "separated (default: CORS off)")
    http.add_argument("--api-key", default=None,
                      help="require Authorization: Bearer <key> (default: $JPREFIX_API_KEY)")
    http.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                      help="larger request bodies get HTTP 413")
    http.add_argument("--shutdown-timeout", type=float, default=5.0,
                      help="seconds running requests get to finish after SIGTERM/SIGINT "
                           "before they are aborted (a second signal exits at once)")
    http.add_argument("--disable-fastapi-docs", action="store_true",
                      help="no /docs and /redoc pages (they load their assets from a CDN)")
    logs = srv.add_argument_group("logging")
    logs.add_argument("--uvicorn-log-level", default="info", choices=LOG_LEVELS)
    logs.add_argument("--disable-uvicorn-access-log", action="store_true")
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                      help="log each request's id and sampling parameters (never its text)")
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                      help="the default")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no engine stats line every 10 s while requests run")
    logs.add_argument("--access-log-health", action="store_true",
                      help="access-log /health, /ping and /metrics polls too")
    api = srv.add_argument_group("API")
    api.add_argument("--chat-template", default=None,
                     help="a Jinja chat template: a file, or the template itself")
    api.add_argument("--response-role", default="assistant",
                     help="the role of chat replies (default: assistant)")
    api.add_argument("--max-logprobs", type=int, default=None,
                     help="the most logprobs a request may ask for (default and at most: 20)")
    api.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help='logprobs name tokens "token_id:<id>" (for tokens that are not '
                          "whole UTF-8)")
    api.add_argument("--generation-config", default="auto",
                     help="auto: the checkpoint's generation_config.json gives the default "
                          "sampling parameters (as vLLM); vllm: none; or a folder holding one")
    load = srv.add_argument_group("loading")
    load.add_argument("--revision", default=None, help="the hub revision (branch, tag, commit)")
    load.add_argument("--download-dir", default=None,
                      help="where hub and embedded models are downloaded")
    load.add_argument("--enforce-eager", action="store_true",
                      help="XLA's CUDA-graph command buffers off even with "
                           "JPREFIX_XLA_COMMAND_BUFFERS=1 (off by default already); every "
                           "step still runs as a compiled XLA program: there is no eager mode")
    add_engine_args(srv)
    for flag in REFUSED:  # (not listed: each refuses itself, saying why)
        srv.add_argument(flag, action=_Refused, nargs="?", help=argparse.SUPPRESS)
    srv.set_defaults(log_requests=False)
    return srv


def model_of(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> str:
    """The positional model or --model (they must agree when both are given)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        message = f"the model is given twice: {args.model_tag!r} and --model {args.model!r}"
        if parser is not None:
            parser.error(message)
        raise SystemExit(f"jprefix serve: {message}")
    return args.model_tag or args.model or DEFAULT_MODEL


def _origins(value: str | None) -> list[str] | None:
    if not value:
        return None
    if value.lstrip().startswith("["):
        origins = json.loads(value)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise SystemExit("jprefix serve: --allowed-origins must be a JSON list of strings")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


def chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template given inline."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(f"jprefix serve: --chat-template {value!r:.80} is neither a file nor a "
                     "Jinja template")


def generation_defaults(setting: str, model: str) -> dict[str, Any]:
    """--generation-config: the default sampling parameters (vLLM's fields) from a
    generation_config.json: the checkpoint's ("auto"; none for a GGUF or a preset), none
    ("vllm"), or the one in a folder."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        found = _checkpoint_file(model, "generation_config.json")
        if found is None:
            return {}
    else:
        found = Path(setting).expanduser() / "generation_config.json"
        if not found.is_file():
            raise SystemExit(f"jprefix serve: --generation-config {setting}: no "
                             "generation_config.json there")
    config = json.loads(Path(found).read_text())
    return {ours: config[theirs] for theirs, ours in GENERATION_FIELDS.items()
            if config.get(theirs) is not None}


def _checkpoint_file(model: str, name: str) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir():
        return path / name if (path / name).is_file() else None
    if path.exists() or "/" not in model:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, name)
    return Path(cached) if isinstance(cached, str) else None


def _prepare_loading(args: argparse.Namespace, model: str) -> str:
    """--download-dir, --revision and --enforce-eager, before jax starts; the model to
    load (a hub revision's local snapshot)."""
    if args.download_dir:
        os.environ["JPREFIX_CACHE"] = args.download_dir
        import huggingface_hub.constants as hub

        hub.HF_HUB_CACHE = args.download_dir
    if args.enforce_eager:  # (the last occurrence of an XLA flag wins)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAG}"
    if args.revision is None:
        return model
    if Path(model).expanduser().exists() or "/" not in model:
        raise SystemExit(f"jprefix serve: --revision names a Hugging Face hub revision, and "
                         f"{model!r} is not a hub id")
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=args.revision, allow_patterns=HUB_PATTERNS)


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-8s %(name)s: %(message)s"))
    root = logging.getLogger("jprefix")
    root.addHandler(handler)
    root.setLevel("DEBUG" if level == "trace" else level.upper())
    root.propagate = False


def run_serve(args: argparse.Namespace) -> int:
    import jprefix
    from jprefix.entrypoints import openai_server
    from jprefix.entrypoints.cli_args import engine_kwargs
    from jprefix.entrypoints.cli_progress import (
        CompileWatch,
        describe,
        load_error,
        quiet_third_parties,
    )

    quiet_third_parties(None)
    _setup_logging(args.uvicorn_log_level)
    model = model_of(args)
    path = _prepare_loading(args, model)
    max_logprobs = _max_logprobs(args.max_logprobs)
    logger.info("loading %s (dtype %s) ...", model, args.dtype)
    t0 = time.perf_counter()
    try:
        llm = jprefix.LLM(path, **engine_kwargs(args))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise SystemExit(f"jprefix serve: {load_error(exc, model)}") from None
    logger.info("loaded in %.1f s: %s", time.perf_counter() - t0, describe(llm))
    if args.chat_template is not None:
        if llm.tokenizer is None:
            raise SystemExit("jprefix serve: --chat-template needs a tokenizer (--tokenizer)")
        llm.tokenizer.chat_template = chat_template(args.chat_template)
    defaults = generation_defaults(args.generation_config, path)
    if defaults:
        logger.info("default sampling parameters from the checkpoint's generation config "
                    "(--generation-config vllm: none): %s", defaults)
    watch = CompileWatch(_compile_logger())
    logger.info("ready: the engine compiles each step shape on first use (the first "
                "requests are slower)")
    openai_server.serve(
        llm, args.host, args.port, model_name=args.served_model_name or model,
        api_key=args.api_key, max_request_bytes=args.max_request_bytes,
        **_server_kwargs(args, defaults, max_logprobs))
    watch.close()
    return 0


def _max_logprobs(value: int | None) -> int:
    from jprefix.core.sampling_params import MAX_LOGPROBS

    if value is None:
        return MAX_LOGPROBS
    if not 0 <= value <= MAX_LOGPROBS:
        raise SystemExit(f"jprefix serve: --max-logprobs must be in [0, {MAX_LOGPROBS}] (the "
                         f"engine computes at most {MAX_LOGPROBS}), got {value}")
    return value


def _server_kwargs(args: argparse.Namespace, defaults: dict[str, Any], max_logprobs: int
                   ) -> dict[str, Any]:
    """The server flags as `serve`'s keyword arguments (besides the model and the key)."""
    return dict(
        allowed_origins=_origins(args.allowed_origins), docs=not args.disable_fastapi_docs,
        root_path=args.root_path, response_role=args.response_role,
        max_logprobs=max_logprobs, defaults=defaults,
        tokens_as_ids=args.return_tokens_as_token_ids, log_requests=args.log_requests,
        shutdown_timeout=args.shutdown_timeout, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        access_log_health=args.access_log_health, log_stats=not args.disable_log_stats,
        uds=args.uds, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)


def _compile_logger() -> Any:
    """Logs the programs compiled: the first, then at most one line every 10 s."""
    last = [0.0]

    def log(count: int, seconds: float) -> None:
        now = time.monotonic()
        if count == 1 or now - last[0] >= 10:
            last[0] = now
            logger.info("compiled %d XLA program(s) so far (%.1f s)", count, seconds)
    return log
