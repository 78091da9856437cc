"""The server under uvicorn: a bounded shutdown, quiet health polls, TLS or a Unix socket.

Shutdown: the first SIGTERM or SIGINT stops accepting connections and drains: new
requests on open connections get 503, running ones get up to `shutdown_timeout` seconds
to finish; then the rest are aborted (a stream's last chunk has finish reason "abort", a
plain request gets a 503 error) and the process exits. A second signal exits at once
(status 128 + the signal), with one line and no traceback. /health, /ping and /metrics
polls are not access-logged (`access_log_health`), so a load balancer's probes do not
bury the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import uvicorn

from jprefix.entrypoints.driver import EXIT_WAIT_S
from jprefix.entrypoints.llm import LLM

DEFAULT_SHUTDOWN_TIMEOUT = 5.0
_POLLS = ("/health", "/ping", "/metrics")
logger = logging.getLogger("jprefix.server")


class _NoPolls(logging.Filter):
    """Drops uvicorn's access-log lines of health and metrics polls."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?", 1)[0] if len(args) > 2 else ""
        return path not in _POLLS


class _Server(uvicorn.Server):
    """uvicorn's server with jprefix's signal handling (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, shutdown: Any, timeout: float,
                 log_stats: Any = None):
        super().__init__(config)
        self.shutdown_state, self.timeout, self.log_stats = shutdown, timeout, log_stats
        self._loop: asyncio.AbstractEventLoop | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.log_stats is not None and counter % 100 == 0:  # (a tick: 0.1 s)
            self.log_stats()
        return await super().on_tick(counter)

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:  # the second signal: at once, quietly
            sys.stderr.write(f"jprefix: signal {sig} again: exiting now\n")
            sys.stderr.flush()
            os._exit(128 + sig)
        self.should_exit = True
        self.shutdown_state.draining = True
        sys.stderr.write(f"jprefix: shutting down: running requests have {self.timeout:g} s "
                         "to finish (--shutdown-timeout), then are aborted; signal again to "
                         "exit at once\n")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.timeout,
                                            self.shutdown_state.abort)


def run(app: Any, llm: LLM, host: str = "127.0.0.1", port: int = 8000, *,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "info",
        access_log: bool = True, access_log_health: bool = False, log_stats: bool = True,
        uds: str | None = None, ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None) -> None:
    """Serves `app` (openai_server.build_app's, serving `llm`) until stopped. `uds`: a
    Unix socket path instead of host and port; `log_stats`: an engine stats line every
    10 s while it has work."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
    config = uvicorn.Config(app, host=host, port=port, uds=uds, log_level=log_level,
                            access_log=access_log, ssl_keyfile=ssl_keyfile,
                            ssl_certfile=ssl_certfile,
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5)
    server = _Server(config, app.state.serving.shutdown, shutdown_timeout,
                     _stats_logger(llm) if log_stats else None)
    config.load()  # (configures uvicorn's loggers: the filter goes on after)
    if not access_log_health:
        logging.getLogger("uvicorn.access").addFilter(_NoPolls())
    try:
        server.run()
    finally:  # the drain's leftovers, before the interpreter's teardown (the driver's exit
        # hook comes after the worker pools have closed, where a step would fail instead)
        if not llm.shutdown(EXIT_WAIT_S):
            logger.warning("the engine's step did not end within %g s of the shutdown",
                           EXIT_WAIT_S)


def _stats_logger(llm: LLM) -> Any:
    """Logs the engine's counters when it has requests or finished some since the last
    line (an idle server writes nothing)."""
    seen = [0]

    def log() -> None:
        s = llm.stats()
        replicas = s.get("replicas", [])
        requests = sum(r.get("requests", 0) for r in replicas)
        running = sum(r.get("running", 0) for r in replicas)
        waiting = sum(r.get("waiting", 0) for r in replicas)
        if requests == seen[0] and not running and not waiting:
            return
        seen[0] = requests
        used = sum(r.get("kv_used_blocks", 0) for r in replicas)
        total = max(1, sum(r.get("kv_total_blocks", 0) for r in replicas))
        logger.info("engine: %d requests so far, %d running, %d waiting; KV cache %.1f%% "
                    "used; prefix cache hit rate %.1f%%", requests, running, waiting,
                    100 * used / total, 100 * s.get("hit_rate", 0.0))
    return log
