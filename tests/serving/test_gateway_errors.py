"""The gateway's one gRPC → HTTP error mapping (``gateway.errors``), over a fake AsyncLLM behind
the real gRPC server: every route and the ``/v1/sessions`` WebSocket answer a frontend's status
alike, and the mapping reads the structured details the frontend attaches (trailing metadata),
never the error's text (docs/design.md §8)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
websockets = pytest.importorskip("websockets", reason="websockets is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

from fastsched.admin import AdminSettings  # noqa: E402
from fastsched.frontend.admission import QueueOverflowError  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.inputs import ContextLengthError  # noqa: E402
from fastsched.request_gate import RequestGate  # noqa: E402

MODEL = "fake-model"


class _WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text.split())


class FakeLLM:
    """AsyncLLM's contract where the gateway's error paths need it: the request gate's checks
    (over a word-per-token tokenizer), then ``refuse`` is what ``submit()`` and
    ``open_session()`` raise (an admission rejection, a ValueError)."""

    loras = None
    session_open_timeout = 0.5
    gate = RequestGate(_WordTokenizer(), 64, 1000)

    def __init__(self) -> None:
        self.refuse: Exception | None = None

    def model_info(self) -> dict[str, Any]:
        return {"model": MODEL, "max_model_len": 64, "vocab_size": 1000}

    def is_healthy(self) -> bool:
        return True

    def submit(self, valid: Any) -> Any:
        assert self.refuse is not None, "these tests only exercise refusals"
        raise self.refuse

    def open_session(self, valid: Any) -> Any:
        return self.submit(valid)


class Stack:
    def __init__(self) -> None:
        self.loop = LoopThread()
        self.fake = FakeLLM()
        port = free_port()
        self.grpc_addr = f"127.0.0.1:{port}"
        self.server = self.loop.call(serve_frontend(self.fake, "127.0.0.1", port))
        self.url = self.loop.start_gateway(create_app([self.grpc_addr], MODEL, tokenizer=None))
        # A gateway whose only frontend cannot be reached.
        self.dead_url = self.loop.start_gateway(
            create_app(
                [f"127.0.0.1:{free_port()}"],
                MODEL,
                tokenizer=None,
                admin=AdminSettings(enable_admin_api=True),
            )
        )

    def stop(self) -> None:
        self.loop.stop_gateways()
        self.loop.call(self.server.stop(0))
        self.loop.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def reset(stack: Stack) -> None:
    stack.fake.refuse = None


def ws_error(stack: Stack, opening: dict[str, Any]) -> dict[str, Any]:
    url = stack.url.replace("http://", "ws://") + "/v1/sessions"
    with ws_connect(url) as ws:
        ws.send(json.dumps({"type": "open", "prompt": [7, 8], "max_tokens": 2, **opening}))
        message = json.loads(ws.recv(timeout=30))
    assert message["type"] == "error", message
    return message["error"]


def test_a_session_naming_a_model_no_frontend_serves_is_a_404_not_a_500(stack: Stack) -> None:
    error = ws_error(stack, {"model": "no-such-adapter"})
    assert (error["code"], error["param"]) == ("model_not_found", "model"), error
    assert "no-such-adapter" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/sessions"])
def test_a_rejection_is_the_same_service_unavailable_error_over_http_and_the_websocket(
    stack: Stack, path: str
) -> None:
    stack.fake.refuse = QueueOverflowError("queue full: 8 requests in flight")
    if path == "/v1/sessions":
        error = ws_error(stack, {})
    else:
        r = httpx.post(stack.url + path, json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", QueueOverflowError.reason), error


def test_an_admin_call_no_frontend_answers_is_the_same_service_unavailable_error(stack: Stack) -> None:
    r = httpx.post(stack.dead_url + "/pause", timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == (
        "service_unavailable_error",
        "frontend_unavailable",
    )


def test_the_context_length_code_comes_from_the_frontends_structured_details_not_the_text(
    stack: Stack,
) -> None:
    body = {"prompt": [1, 2], "max_tokens": 2}
    # A ValueError whose text happens to name max_model_len is not a context-length error...
    stack.fake.refuse = ValueError("seed: 'max_model_len' is not a seed")
    error = httpx.post(stack.url + "/v1/completions", json=body, timeout=30).json()["error"]
    assert error["code"] is None, error
    # ... and one whose text does not is, when the frontend says so.
    stack.fake.refuse = ContextLengthError("62 + 8 tokens do not fit in 64")
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
