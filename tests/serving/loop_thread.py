"""An asyncio event loop in a background thread, for serving tests: the gRPC frontends
and uvicorn gateways run there while the test thread talks to them over sockets with
sync clients (the official ``openai`` client, httpx, gRPC stubs)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="serving-test-loop", daemon=True)
        self.thread.start()
        self._uvicorns: list[tuple[Any, Future]] = []

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Runs ``coro`` on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_gateway(self, app: Any) -> str:
        """Serves ``app`` with uvicorn on a free 127.0.0.1 port; returns its base URL."""
        from fastsched.gateway.app import gateway_server

        port = free_port()
        server = gateway_server(app, "127.0.0.1", port, log_level="warning")
        self._uvicorns.append((server, asyncio.run_coroutine_threadsafe(server.serve(), self.loop)))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def stop_gateways(self) -> None:
        for server, _ in self._uvicorns:
            server.should_exit = True
        for _, done in self._uvicorns:
            done.result(10)
        self._uvicorns.clear()

    def stop_stack(self, servers: Iterable[Any] = (), llms: Iterable[Any] = ()) -> None:
        """Stops what a test started on this loop, the last started first: the gateways, the
        frontends' gRPC servers, their AsyncLLMs; then the loop itself."""
        self.stop_gateways()
        for server in servers:
            self.call(server.stop(0))
        for llm in llms:
            self.call(llm.shutdown())
        self.close()

    def close(self) -> None:
        self.stop_gateways()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def wait_for(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
