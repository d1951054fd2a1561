"""Issue 22 (hardening), items 2, 3 and 5 (part): admin operations are off unless enabled and take their
own key, the files they name must lie under ``--allowed-local-paths`` (``fastsched.admin``), and a
``/v1/sessions`` WebSocket cannot hold the server: it must send ``open`` in time and, from a web
page, come from an allowed origin. A fake AsyncLLM behind the real gRPC server and the real
gateway; the session cap, which needs engines, is tested in test_pause_sessions.py."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
websockets = pytest.importorskip("websockets", reason="websockets is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

from fastsched.admin import AdminSettings  # noqa: E402
from fastsched.entrypoints.cli import add_serve_args, admin_settings  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.gateway.sessions import SessionSettings  # noqa: E402
from fastsched.launcher.serve_config import ServeConfig  # noqa: E402
from fastsched.proto_gen import import_stubs  # noqa: E402
from fastsched.request_gate import RequestGate  # noqa: E402

pb, pb_grpc = import_stubs()

MODEL = "fake-model"
API_KEY, ADMIN_KEY = "sk-api", "sk-admin"
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class _WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text.split())


class FakeLLM:
    """Just enough of AsyncLLM for the admin calls; it records what reached it."""

    loras = None
    session_open_timeout = 0.5
    gate = RequestGate(_WordTokenizer(), 64, 1000)  # AsyncLLM's checks, over a word-per-token tokenizer

    def __init__(self) -> None:
        self.calls: list[str] = []

    def model_info(self) -> dict[str, Any]:
        return {"model": MODEL, "max_model_len": 64, "vocab_size": 1000}

    def is_healthy(self) -> bool:
        return True

    async def pause(self, mode: str = "all") -> None:
        self.calls.append(f"pause {mode}")

    async def resume(self) -> None:
        self.calls.append("resume")

    async def reload_weights(self, model: str) -> None:
        self.calls.append(f"reload {model}")

    def is_paused(self) -> bool:
        return False

    def pause_states(self) -> dict[int, str]:
        return {0: "unpaused"}

    def open_session(self, valid: Any) -> Any:
        raise ValueError("this fake opens no session")


class Stack:
    def __init__(self, allowed: Path) -> None:
        self.loop = LoopThread()
        self.fake = FakeLLM()
        self.allowed = allowed
        admin = AdminSettings(
            enable_admin_api=True,
            enable_runtime_lora_updating=True,
            admin_api_key=ADMIN_KEY,
            allowed_local_paths=(str(allowed),),
        )
        self.ports = [free_port(), free_port()]
        self.servers = [
            self.loop.call(
                serve_frontend(self.fake, "127.0.0.1", self.ports[0], api_key=API_KEY, admin=admin)
            ),
            self.loop.call(serve_frontend(self.fake, "127.0.0.1", self.ports[1])),
        ]  # admin off
        addr = f"127.0.0.1:{self.ports[0]}"
        self.default_url = self.loop.start_gateway(
            create_app([f"127.0.0.1:{self.ports[1]}"], MODEL, tokenizer=None)
        )
        self.admin_url = self.loop.start_gateway(
            create_app(
                [addr],
                MODEL,
                tokenizer=None,
                api_key=API_KEY,
                admin=admin,
                sessions=SessionSettings(open_timeout=0.5, allowed_origins=("https://app.example",)),
            )
        )

    def stop(self) -> None:
        self.loop.stop_gateways()
        for server in self.servers:
            self.loop.call(server.stop(0))
        self.loop.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("allowed"))
    try:
        yield s
    finally:
        s.stop()


ADMIN_ROUTES = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/reload_weights"),
    ("GET", "/debug/requests/some-id"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_do_not_exist_unless_enabled(stack: Stack, method: str, path: str) -> None:
    r = httpx.request(
        method, stack.default_url + path, json={"path": "/x", "lora_name": "a", "lora_path": "/x"}, timeout=30
    )
    assert r.status_code == 404, r.text
    assert stack.fake.calls == []


@pytest.mark.parametrize(
    "rpc",
    [
        "Pause",
        "Resume",
        "IsPaused",
        "ReloadWeights",
        "GetRequestStatus",
        "LoadLoRAAdapter",
        "UnloadLoRAAdapter",
    ],
)
def test_grpc_admin_methods_are_unimplemented_unless_enabled(stack: Stack, rpc: str) -> None:
    requests = {
        "Pause": pb.PauseRequest(mode="all"),
        "Resume": pb.ResumeRequest(),
        "IsPaused": pb.IsPausedRequest(),
        "ReloadWeights": pb.ReloadWeightsRequest(model="/x"),
        "GetRequestStatus": pb.RequestStatusRequest(request_id="r"),
        "LoadLoRAAdapter": pb.LoadLoRAAdapterRequest(lora_name="a", lora_path="/x"),
        "UnloadLoRAAdapter": pb.UnloadLoRAAdapterRequest(lora_name="a"),
    }
    with grpc.insecure_channel(
        f"127.0.0.1:{stack.ports[1]}", options=[("grpc.enable_http_proxy", 0)]
    ) as channel:
        with pytest.raises(grpc.RpcError) as info:
            getattr(pb_grpc.FrontendStub(channel), rpc)(requests[rpc], timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--enable-" in info.value.details()
    assert stack.fake.calls == []


def test_admin_routes_take_the_admin_key_and_the_api_key_is_not_it(stack: Stack) -> None:
    for headers in ({}, API, {"Authorization": "Bearer wrong"}):
        assert httpx.post(stack.admin_url + "/pause", headers=headers, timeout=30).status_code == 401
    assert stack.fake.calls == []
    r = httpx.post(stack.admin_url + "/pause?mode=new", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and stack.fake.calls == ["pause new"]
    assert httpx.post(stack.admin_url + "/resume", headers=ADMIN, timeout=30).status_code == 200
    # Inference routes take the API key, not the admin key.
    assert httpx.get(stack.admin_url + "/v1/models", headers=API, timeout=30).status_code == 200
    assert httpx.get(stack.admin_url + "/v1/models", headers=ADMIN, timeout=30).status_code == 401
    stack.fake.calls.clear()


def test_grpc_admin_methods_take_the_admin_key(stack: Stack) -> None:
    with grpc.insecure_channel(
        f"127.0.0.1:{stack.ports[0]}", options=[("grpc.enable_http_proxy", 0)]
    ) as channel:
        stub = pb_grpc.FrontendStub(channel)
        for metadata in ((), (("authorization", f"Bearer {API_KEY}"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Pause(pb.PauseRequest(mode="all"), timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stack.fake.calls == []
        stub.Pause(
            pb.PauseRequest(mode="all"), timeout=10, metadata=(("authorization", f"Bearer {ADMIN_KEY}"),)
        )
    assert stack.fake.calls == ["pause all"]
    stack.fake.calls.clear()


def test_grpc_both_key_checks_read_the_first_authorization_entry_only(stack: Stack) -> None:
    """Issue 37: the admin check accepted any ``authorization`` entry, the API-key check only
    the first; a wrong key then the right one passed one and failed the other. Both read the
    first entry now, as an HTTP server reads the header."""

    def auth(*keys: str) -> tuple[tuple[str, str], ...]:
        return tuple(("authorization", f"Bearer {k}") for k in keys)

    address, options = f"127.0.0.1:{stack.ports[0]}", [("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.FrontendStub(channel)
        calls = {
            "admin": lambda metadata: stub.IsPaused(pb.IsPausedRequest(), timeout=10, metadata=metadata),
            "api": lambda metadata: stub.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=metadata),
        }
        for scope, key in (("admin", ADMIN_KEY), ("api", API_KEY)):
            with pytest.raises(grpc.RpcError) as info:
                calls[scope](auth("wrong", key))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, scope
            calls[scope](auth(key, "wrong"))
    stack.fake.calls.clear()


def test_admin_routes_guarded_only_by_the_api_key_refuse_to_start() -> None:
    with pytest.raises(ValueError, match="--admin-api-key"):
        create_app(
            ["127.0.0.1:1"],
            MODEL,
            tokenizer=None,
            api_key=API_KEY,
            admin=AdminSettings(enable_admin_api=True),
        )
    with pytest.raises(ValueError, match="--admin-api-key"):
        ServeConfig(api_key=API_KEY, admin=AdminSettings(enable_runtime_lora_updating=True))


def test_a_path_outside_the_allowed_ones_is_403_and_says_nothing_of_whether_it_exists(
    stack: Stack, tmp_path: Path
) -> None:
    existing = tmp_path / "adapter"
    existing.mkdir()
    (existing / "adapter_config.json").write_text("{}")
    escape = stack.allowed / "escape"  # inside by name, outside once resolved
    if not escape.exists():
        os.symlink(existing, escape)
    answers = []
    for path in (existing, tmp_path / "missing", escape, Path("/etc/passwd")):
        r = httpx.post(
            stack.admin_url + "/v1/load_lora_adapter",
            headers=ADMIN,
            timeout=30,
            json={"lora_name": "a", "lora_path": str(path)},
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", r.text
        answers.append(r.json())
        r = httpx.post(
            stack.admin_url + "/reload_weights", headers=ADMIN, timeout=30, json={"path": str(path)}
        )
        assert r.status_code == 403 and r.json()["error"]["param"] == "path", r.text
        answers.append(r.json())
    assert (
        len({json.dumps(a) for a in answers[::2]}) == 1 and len({json.dumps(a) for a in answers[1::2]}) == 1
    )
    assert stack.fake.calls == [], "nothing outside reached a frontend"
    # Inside, the frontend is asked.
    r = httpx.post(
        stack.admin_url + "/reload_weights",
        headers=ADMIN,
        timeout=30,
        json={"path": str(stack.allowed / "ckpt")},
    )
    assert r.status_code == 200 and stack.fake.calls == [f"reload {stack.allowed / 'ckpt'}"]
    stack.fake.calls.clear()


def test_a_file_link_inside_an_allowed_directory_that_leaves_it_is_403(stack: Stack, tmp_path: Path) -> None:
    """Issue 37: only the directory was resolved, so ``adapter_model.safetensors`` linked to a
    file elsewhere was opened, and the error told its size and its first 8 bytes as a number."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOPSECRET-bytes-of-another-file" * 3)
    adapter = stack.allowed / "linked-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    os.symlink(secret, adapter / "adapter_model.safetensors")
    checkpoint = stack.allowed / "linked-checkpoint"
    checkpoint.mkdir()
    os.symlink(secret, checkpoint / "model.safetensors")
    for route, body in (
        ("/v1/load_lora_adapter", {"lora_name": "linked", "lora_path": str(adapter)}),
        ("/reload_weights", {"path": str(checkpoint)}),
    ):
        r = httpx.post(stack.admin_url + route, headers=ADMIN, timeout=30, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", r.text
        assert "a link that leaves" in r.text and str(secret.stat().st_size) not in r.text
        leaked = str(int.from_bytes(secret.read_bytes()[:8], "little"))
        assert leaked not in r.text
    assert stack.fake.calls == []


def test_grpc_load_of_a_path_outside_is_permission_denied(stack: Stack) -> None:
    with grpc.insecure_channel(
        f"127.0.0.1:{stack.ports[0]}", options=[("grpc.enable_http_proxy", 0)]
    ) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.FrontendStub(channel).ReloadWeights(
                pb.ReloadWeightsRequest(model="/etc"),
                timeout=10,
                metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
            )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert dict(info.value.trailing_metadata())["error-code"] == "path_not_allowed"
    assert stack.fake.calls == []


# ------------------------------------------------------------------ sessions (issue 22 item 2, 5)


def ws_url(stack: Stack) -> str:
    return stack.admin_url.replace("http://", "ws://") + "/v1/sessions"


def test_a_websocket_that_never_sends_open_is_closed_after_the_open_timeout(stack: Stack) -> None:
    with ws_connect(ws_url(stack), additional_headers=API) as ws:
        message = json.loads(ws.recv(timeout=30))  # nothing sent
        assert message["type"] == "error" and message["status"] == 408, message
        assert message["error"]["code"] == "session_open_timeout"
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=30)


def test_a_grpc_session_that_never_sends_open_is_ended_after_the_open_timeout(stack: Stack) -> None:
    import threading

    never = threading.Event()

    def nothing() -> Iterator[Any]:
        never.wait(30)
        yield from ()

    with grpc.insecure_channel(
        f"127.0.0.1:{stack.ports[1]}", options=[("grpc.enable_http_proxy", 0)]
    ) as channel:
        call = pb_grpc.FrontendStub(channel).GenerateSession(nothing(), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            next(call)
    never.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "open" in info.value.details()


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("https://evil.example", False),
        ("https://app.example", True),  # --allowed-origins
        (None, True),  # not a browser
        ("same", True),  # the gateway's own origin
    ],
)
def test_a_websocket_from_another_origin_is_refused(stack: Stack, origin: str | None, allowed: bool) -> None:
    headers = dict(API)
    if origin == "same":
        origin = stack.admin_url
    if origin is not None:
        headers["Origin"] = origin
    if not allowed:
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            with ws_connect(ws_url(stack), additional_headers=headers):
                pass
        assert info.value.response.status_code == 403
        return
    with ws_connect(ws_url(stack), additional_headers=headers) as ws:
        ws.send(json.dumps({"type": "open", "prompt": [1], "max_tokens": 1}))
        message = json.loads(
            ws.recv(timeout=30)
        )  # the fake refuses the session itself: the socket was let in
        assert message["type"] == "error" and "fake" in message["error"]["message"]


def test_serve_has_a_session_idle_timeout_and_admin_off_by_default() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([])
    assert args.session_idle_timeout == ServeConfig().frontend.session_idle_timeout == 60.0
    assert (
        ServeConfig().frontend.max_sessions is None
    )  # a quarter of the engines' slots (frontend.session.session_cap)
    assert admin_settings(args) == AdminSettings() == ServeConfig().admin
    assert not AdminSettings().enable_admin_api and not AdminSettings().enable_runtime_lora_updating
