"""A client that drops while uploading a request body (issue 37): the gateway once let
Starlette's ``ClientDisconnect`` escape the app, and uvicorn logged ~40 lines of ERROR
traceback per request, a log flood anyone could cause for free. Now the request ends as a
400 nobody reads, with nothing raised and nothing logged above INFO. The app is driven
directly through ASGI: a body chunk, then the disconnect."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")

from fastsched.gateway.app import create_app


async def _drop_during_upload(app: Any, path: str) -> list[dict]:
    events = iter(
        [
            {"type": "http.request", "body": b'{"model": "model", "prompt": "', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict] = []

    async def receive() -> dict:
        try:
            return next(events)
        except StopIteration:
            await asyncio.Event().wait()  # nothing more comes
            raise AssertionError("unreachable") from None

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", b"100000"),
            (b"host", b"127.0.0.1"),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_drops_during_the_upload_raises_and_logs_nothing(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(["127.0.0.1:1"], "model", tokenizer=None)
    with caplog.at_level(logging.INFO):
        sent = asyncio.run(_drop_during_upload(app, path))
    assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
