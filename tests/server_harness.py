"""A real jprefix server for tests: build_app under uvicorn in a thread, on 127.0.0.1 and a
free port (imported by the server test modules)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from jprefix.entrypoints.openai_server import build_app


class Server:
    def __init__(self, llm, **kwargs):
        self.llm = llm
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        config = uvicorn.Config(build_app(llm, **kwargs), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def openai_client(self, api_key: str, **kwargs):
        """An `openai.OpenAI` client of this server that never retries (a test sees the
        server's first answer); kwargs as the client takes them (timeout ...)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def wait_idle(self, seconds: float = 30) -> None:
        """Until the engine has no request and its driver thread has exited."""
        deadline = time.monotonic() + seconds
        while self.llm.engine.has_unfinished_requests() or self.llm._driver.thread is not None:
            assert time.monotonic() < deadline, "the engine kept running"
            time.sleep(0.02)
