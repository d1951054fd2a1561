"""Pause/resume (S13) and streaming-input sessions (S15, S6) end to end: two engine
processes on the tiny model (``max_num_seqs=2``, ``max_num_active_seqs=1`` each), two
frontends with gRPC servers, and a gateway on each: gateway 0 (frontend 0, behind an API
key) for the pause routes and gRPC sessions, gateway 1 (frontend 1, with
``session_idle_timeout``) for the WebSocket sessions.

Serving tests are slow here, so each test checks a whole scenario in one served stack.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
websockets = pytest.importorskip("websockets", reason="websockets is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port, wait_for  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

from fastsched.admin import AdminSettings  # noqa: E402
from fastsched.engine.engine_proc import start_engine_process, stop_engine_processes  # noqa: E402
from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.limits import RequestLimits  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402
from fastsched.proto_gen import import_stubs  # noqa: E402
from fastsched.rpc import AUTHORIZATION_KEY  # noqa: E402
from fastsched.sampling_params import SamplingParams  # noqa: E402

pb, pb_grpc = import_stubs()

MODEL = "tiny"
API_KEY = "sk-pause"
KEY = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_KEY = "sk-pause-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # pause, resume, reload and /debug are admin routes
GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = 1500  # tokens: a request that runs until the test ends it
# Tokens of the request paused mid-way: enough that it cannot finish before the pause lands,
# however fast the steps and however slow the pause request on a loaded machine.
PAUSED_TOKENS = 1000
IDLE_TIMEOUT_S = 3.0
MAX_QUEUED = 4  # frontend 0's max_num_queued_reqs
MAX_SESSIONS = 4  # frontend 0's; frontend 1 has the default, a quarter of the engines' 2 x 2 slots


@dataclass
class Stack:
    loop: LoopThread
    llms: list[AsyncLLM]
    grpc_addrs: list[str]
    urls: list[str]  # gateway k over frontend k


@pytest.fixture(scope="module")
def stack(
    engine_config: dict, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("pause")
    assert len(str(directory)) < 80, f"ipc directory path too long for unix sockets: {directory}"
    inputs = [f"ipc://{directory}/engine{i}.in" for i in range(2)]
    outputs = [f"ipc://{directory}/frontend{k}.out" for k in range(2)]
    config = {**engine_config, "max_num_seqs": 2, "max_num_active_seqs": 1}
    procs = [
        start_engine_process(config, i, inputs[i], outputs, torch_num_threads=1, heartbeat_interval=0.25)
        for i in range(2)
    ]
    loop = LoopThread()
    llms: list[AsyncLLM] = []
    servers: list[Any] = []
    try:
        llms.append(
            loop.call(
                AsyncLLM.start(
                    inputs,
                    outputs[0],
                    frontend_index=0,
                    settings=FrontendSettings(
                        max_num_queued_reqs=MAX_QUEUED, ready_timeout=60, max_sessions=MAX_SESSIONS
                    ),
                )
            )
        )
        llms.append(
            loop.call(
                AsyncLLM.start(
                    inputs,
                    outputs[1],
                    frontend_index=1,
                    settings=FrontendSettings(ready_timeout=60, session_idle_timeout=IDLE_TIMEOUT_S),
                )
            )
        )  # the default --max-sessions
        # Reloads may name the fixtures' checkpoints and the tests' temporary directories only.
        allowed = (str(tmp_path_factory.getbasetemp()), str(tiny_model_dir.parent))
        keyed_admin = AdminSettings(
            enable_admin_api=True, admin_api_key=ADMIN_KEY, allowed_local_paths=allowed
        )
        open_admin = AdminSettings(enable_admin_api=True, allowed_local_paths=allowed)
        grpc_addrs = [f"127.0.0.1:{free_port()}" for _ in llms]
        for k, (llm, addr) in enumerate(zip(llms, grpc_addrs)):
            servers.append(
                loop.call(
                    serve_frontend(
                        llm,
                        "127.0.0.1",
                        int(addr.rsplit(":", 1)[1]),
                        api_key=API_KEY if k == 0 else None,
                        admin=keyed_admin if k == 0 else open_admin,
                    )
                )
            )
        tokenizer = load_tokenizer(str(tiny_model_dir))
        # Gateway 0 reports usage.prompt_tokens_details.cached_tokens (the prefix-cache test reads it).
        urls = [
            loop.start_gateway(
                create_app(
                    [grpc_addrs[0]],
                    MODEL,
                    tokenizer,
                    api_key=API_KEY,
                    admin=keyed_admin,
                    enable_prompt_tokens_details=True,
                )
            ),
            loop.start_gateway(create_app([grpc_addrs[1]], MODEL, tokenizer, admin=open_admin)),
        ]
        yield Stack(loop, llms, grpc_addrs, urls)
    finally:
        loop.stop_stack(servers, llms)
        stop_engine_processes(procs, timeout=10.0)
        assert not any(p.is_alive() for p in procs)


@pytest.fixture(autouse=True)
def resume_after(stack: Stack) -> Iterator[None]:
    """Each test starts unpaused, even after one that failed while its engines were paused."""
    yield
    with httpx.Client(base_url=stack.urls[0], timeout=60) as http:
        assert http.post("/resume", headers=ADMIN).status_code == 200


def debug(http: httpx.Client, request_id: str) -> dict:
    r = http.get(f"/debug/requests/{request_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["prompts"][0]


def sequence(http: httpx.Client, request_id: str) -> dict:
    return debug(http, request_id)["sequences"][0]


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """The value of one series of gateway 0's /metrics."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"fastsched:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no series fastsched:{name} with {labels}")


def settled_output_tokens(http: httpx.Client, request_id: str) -> int:
    """A paused request's output count once the step in flight at the pause has landed."""
    previous = -1
    for _ in range(50):
        current = sequence(http, request_id)["num_output_tokens"]
        if current == previous:
            return current
        previous = current
        time.sleep(0.3)
    raise AssertionError(f"{request_id} kept generating while paused")


class Streams:
    """Requests sent on frontend 0 from the test thread; their outputs collected on the loop."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self._tasks: dict[str, Any] = {}

    def start(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        async def run() -> None:
            stream = self.stack.llms[0].generate(
                request_id, prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)
            )
            self.tokens[request_id] = []
            async with stream:
                async for out in stream:
                    self.tokens[request_id] = list(out.outputs[0].token_ids)
                    self.finish[request_id] = out.outputs[0].finish_reason

        async def launch() -> Any:
            return asyncio.ensure_future(run())

        self._tasks[request_id] = self.stack.loop.call(launch())
        assert wait_for(lambda: request_id in self.tokens, timeout=10)

    def wait(self, request_id: str) -> list[int]:
        assert wait_for(lambda: self._tasks[request_id].done(), timeout=120), f"{request_id} never finished"
        self._tasks[request_id].result()
        return self.tokens[request_id]

    def cancel(self, request_id: str) -> None:
        self.stack.loop.loop.call_soon_threadsafe(self._tasks[request_id].cancel)


PROMPT_A = [17, 230, 4, 88, 91, 300, 12, 5]
PROMPT_B = [40, 41, 42, 43]
PROMPT_C = [99, 98, 97]


def test_s13_pause_all_then_new_over_http_with_requests_in_flight(stack: Stack) -> None:
    streams = Streams(stack)
    with httpx.Client(base_url=stack.urls[0], timeout=60) as http:
        streams.start("ref", PROMPT_A, PAUSED_TOKENS)
        reference = streams.wait("ref")
        streams.start("A", PROMPT_A, PAUSED_TOKENS)  # engine 0
        streams.start("B", PROMPT_B, LONG)  # engine 1 (the least loaded)
        assert wait_for(lambda: len(streams.tokens["A"]) > 0 and len(streams.tokens["B"]) > 0, timeout=30)

        assert http.post("/pause?mode=all").status_code == 401  # behind --admin-api-key
        assert http.post("/pause?mode=all", headers=KEY).status_code == 401  # which the API key is not
        r = http.post("/pause?mode=all", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json() == {"is_paused": True, "engines": {"0": "paused_all", "1": "paused_all"}}
        assert http.get("/is_paused", headers=ADMIN).json()["is_paused"] is True
        assert http.get("/health").status_code == 200
        for engine in ("0", "1"):
            assert metric(http, "engine_paused", engine=engine, mode="all") == 1.0
            assert metric(http, "engine_paused", engine=engine, mode="new") == 0.0
        # all: nothing runs, running requests keep their place and KV.
        held = settled_output_tokens(http, "A")
        assert held < PAUSED_TOKENS
        a = sequence(http, "A")
        assert a["state"] == "running" and a["num_blocks"] > 0
        b_held = settled_output_tokens(http, "B")

        # Admission keeps its valves while paused: queued requests count toward max_num_queued_reqs.
        streams.start("C", PROMPT_C, 4)
        streams.start("D", PROMPT_C, 4)
        assert sequence(http, "C")["state"] == "waiting" and sequence(http, "D")["state"] == "waiting"
        over = http.post(
            "/v1/completions", headers=KEY, json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2}
        )
        assert over.status_code == 503 and "max_num_queued_reqs" in over.text

        # new: running requests go on and finish; waiting ones stay queued.
        r = http.post("/pause?mode=new", headers=ADMIN)
        assert r.json()["engines"] == {"0": "paused_new", "1": "paused_new"}
        assert metric(http, "engine_paused", engine="0", mode="new") == 1.0
        assert streams.wait("A") == reference  # the pause lost no KV: the same greedy tokens
        assert wait_for(lambda: sequence(http, "B")["num_output_tokens"] > b_held, timeout=30)
        assert sequence(http, "C")["state"] == "waiting" and sequence(http, "D")["state"] == "waiting"

        streams.cancel("B")
        r = http.post("/resume", headers=ADMIN)
        assert r.json() == {"is_paused": False, "engines": {"0": "unpaused", "1": "unpaused"}}
        assert len(streams.wait("C")) == 4 and len(streams.wait("D")) == 4
        assert metric(http, "engine_paused", engine="0", mode="new") == 0.0

        bad = http.post("/pause?mode=everything", headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"


# ------------------------------------------------------------------ sessions over gRPC


class GrpcSession:
    """A GenerateSession call on frontend 0, driven from the test thread."""

    def __init__(self, stack: Stack, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.loop = stack.loop
        self.requests: asyncio.Queue[Any] = asyncio.Queue()

        async def open_call() -> Any:
            channel = grpc.aio.insecure_channel(stack.grpc_addrs[0])
            self.channel = channel

            async def requests() -> Any:
                while (msg := await self.requests.get()) is not None:
                    yield msg

            return pb_grpc.FrontendStub(channel).GenerateSession(
                requests(), metadata=((AUTHORIZATION_KEY, f"Bearer {API_KEY}"),)
            )

        self.call = self.loop.call(open_call())
        params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.send(
            pb.SessionRequest(
                open=pb.GenerateRequest(
                    request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling_params=params
                )
            )
        )

    def send(self, msg: Any) -> None:
        self.loop.loop.call_soon_threadsafe(self.requests.put_nowait, msg)

    def chunk(self, token_ids: list[int], max_tokens: int, last: bool = False) -> None:
        self.send(
            pb.SessionRequest(
                chunk=pb.SessionChunk(token_ids=pb.TokenIds(ids=token_ids), max_tokens=max_tokens, last=last)
            )
        )

    def segment(self) -> tuple[list[int], Any]:
        """Reads responses up to the end of a segment (or of the session): its tokens and the last response."""
        tokens: list[int] = []
        while True:
            response = self.loop.call(self.call.read())
            assert response is not grpc.aio.EOF, "the call ended before the segment did"
            tokens += response.token_ids
            if response.segment_ended or response.finish_reason:
                return tokens, response

    def close(self) -> None:
        self.send(None)  # ends the request stream
        self.loop.call(self.channel.close())


def reference(stack: Stack, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a plain request (from scratch) on the same server."""
    streams = Streams(stack)
    streams.start(request_id, prompt, max_tokens)
    return streams.wait(request_id)


async def unauthenticated_session(address: str) -> Any:
    """The status of a GenerateSession call without the API key (its request stream stays open)."""

    async def nothing() -> Any:
        await asyncio.Event().wait()
        yield pb.SessionRequest()

    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.FrontendStub(channel).GenerateSession(nothing())
        try:
            await call.read()
        except grpc.aio.AioRpcError as e:
            return e.code()
        return None


def test_s15_s6_grpc_session_of_three_chunks_holds_its_slot_and_kv_between_them(stack: Stack) -> None:
    assert stack.loop.call(unauthenticated_session(stack.grpc_addrs[0])) == grpc.StatusCode.UNAUTHENTICATED
    chunks = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35]]
    with httpx.Client(base_url=stack.urls[0], timeout=60) as http:
        s1 = GrpcSession(stack, "sess-1", chunks[0], 4)  # engine 0
        history = list(chunks[0])
        tokens, last = s1.segment()
        assert (last.segment, last.segment_ended, last.finish_reason) == (0, True, "")
        assert tokens == reference(stack, "ref-0", history, 4)
        history += tokens

        # Between chunks: the session holds its blocks and slot but does not run.
        waiting = sequence(http, "sess-1")
        assert waiting["state"] == "waiting_for_streaming_req"
        assert waiting["num_blocks"] > 0 and waiting["num_computed_tokens"] == len(history) - 1
        assert debug(http, "sess-1")["engine"] == 0
        assert wait_for(lambda: metric(http, "num_requests_waiting_for_streaming_input", engine="0") == 1.0)

        # S6 (docs/scheduler.md Difference 8): a session waiting for input keeps its active slot. With
        # a waiting session on each engine (max_num_active_seqs=1, max_num_seqs=2), a new request waits
        # behind the active-seqs gate although nothing runs, until the session on its engine ends.
        s2 = GrpcSession(stack, "sess-2", [50, 51, 52], 2)  # engine 1
        s2.segment()
        assert debug(http, "sess-2")["engine"] == 1
        assert wait_for(lambda: metric(http, "num_requests_waiting_for_streaming_input", engine="1") == 1.0)
        blocked = Streams(stack)
        blocked.start("blocked", [60, 61, 62], 3)  # engine 0, behind sess-1
        assert wait_for(lambda: sequence(http, "blocked").get("blocked_by") == "active_seqs", timeout=30)
        assert wait_for(lambda: metric(http, "num_requests_running", engine="0") == 0.0)
        s2.send(pb.SessionRequest(close=True))
        _, closed = s2.segment()
        assert closed.finish_reason == "stop" and closed.usage.prompt_tokens == 3
        s2.close()

        for k, chunk in enumerate(chunks[1:], start=1):
            s1.chunk(chunk, 4, last=k == len(chunks) - 1)
            history += chunk
            tokens, last = s1.segment()
            assert tokens == reference(stack, f"ref-{k}", history, 4), (
                f"segment {k}: the session's KV was lost"
            )
            assert last.segment == k
            history += tokens
        assert last.finish_reason == "length" and not last.segment_ended
        assert last.usage.prompt_tokens == sum(map(len, chunks)) and last.usage.completion_tokens == 12
        assert debug(http, "sess-1")["state"] == "finished"
        assert len(blocked.wait("blocked")) == 3  # sess-1 ended: its slot went to the waiting request
        assert wait_for(lambda: metric(http, "num_requests_waiting_for_streaming_input", engine="0") == 0.0)
        s1.close()


# ------------------------------------------------------------------ sessions over WebSocket


def ws_url(stack: Stack, k: int) -> str:
    return stack.urls[k].replace("http://", "ws://") + "/v1/sessions"


def ws_segment(ws: Any) -> tuple[str, list[dict]]:
    """Messages up to the end of a segment or of the session: the segment's text and the messages."""
    messages = []
    while True:
        message = json.loads(ws.recv(timeout=60))
        assert message["type"] == "output", message
        messages.append(message)
        if message["segment_ended"] or message["finish_reason"]:
            return "".join(m["text"] for m in messages), messages


def test_s15_websocket_session_three_chunks_idle_timeout_and_disconnect(stack: Stack) -> None:
    with httpx.Client(base_url=stack.urls[1], timeout=60) as http:
        with ws_connect(ws_url(stack, 1)) as ws:
            ws.send(
                json.dumps(
                    {
                        "type": "open",
                        "request_id": "ws-1",
                        "prompt": "Once upon a time",
                        "max_tokens": 3,
                        **GREEDY,
                    }
                )
            )
            for k, chunk in enumerate([None, " there was", " a dragon"]):
                if chunk is not None:
                    ws.send(json.dumps({"type": "chunk", "prompt": chunk, "max_tokens": 3, "last": k == 2}))
                _, messages = ws_segment(ws)
                assert {m["segment"] for m in messages} == {k}
                assert sum(len(m["token_ids"]) for m in messages) == 3
                if k < 2:
                    assert (
                        messages[-1]["segment_ended"]
                        and sequence(http, "ws-1")["state"] == "waiting_for_streaming_req"
                    )
            assert (
                messages[-1]["finish_reason"] == "length" and messages[-1]["usage"]["completion_tokens"] == 9
            )

        # --session-idle-timeout: a session left waiting for input is aborted, its slot and KV freed.
        with ws_connect(ws_url(stack, 1)) as ws:
            ws.send(
                json.dumps({"type": "open", "request_id": "ws-idle", "prompt": [7, 8, 9], "max_tokens": 2})
            )
            ws_segment(ws)
            _, messages = ws_segment(ws)  # nothing sent: the timeout ends it
            assert messages[-1]["finish_reason"] == "abort" and messages[-1]["token_ids"] == []
        assert debug(http, "ws-idle")["state"] == "finished"

        # A chunk the session could never take ends it with a 400-style error naming the value.
        with ws_connect(ws_url(stack, 1)) as ws:
            ws.send(json.dumps({"type": "open", "prompt": [7], "max_tokens": 1}))
            ws_segment(ws)
            ws.send(json.dumps({"type": "chunk", "prompt": [7], "max_tokens": 0}))
            error = json.loads(ws.recv(timeout=30))
            assert error["type"] == "error" and "max_tokens" in error["error"]["message"]

    # Gateway 0 (no idle timeout) requires its API key of a WebSocket too.
    with pytest.raises(websockets.exceptions.InvalidStatus):
        with ws_connect(ws_url(stack, 0)) as ws:
            ws.recv(timeout=10)
    with httpx.Client(base_url=stack.urls[0], timeout=60) as http:
        # A client that disconnects ends its session at once.
        with ws_connect(ws_url(stack, 0), additional_headers=KEY) as ws:
            ws.send(json.dumps({"type": "open", "request_id": "ws-gone", "prompt": [7, 8], "max_tokens": 2}))
            ws_segment(ws)
            assert sequence(http, "ws-gone")["state"] == "waiting_for_streaming_req"
        assert wait_for(lambda: debug(http, "ws-gone")["state"] == "finished", timeout=30)
        assert sequence(http, "ws-gone")["finish_reason"] == "abort"
        with ws_connect(ws_url(stack, 0), additional_headers=KEY) as ws:
            ws.send(json.dumps({"type": "open", "prompt": [7, 8], "max_tokens": 1, "last": 1}))
            error = json.loads(ws.recv(timeout=30))
            assert error["type"] == "error" and "last" in error["error"]["message"]


def test_s15_sessions_over_max_sessions_are_refused_with_503_and_retry_after_and_requests_still_run(
    stack: Stack,
) -> None:
    """Issue 22: with every slot held by sessions, an ordinary request never finished."""
    llm = stack.llms[1]
    assert llm.max_sessions == 1  # the default: 2 engines x max_num_seqs 2, a quarter of it
    assert wait_for(lambda: llm.num_sessions == 0, timeout=30)
    refused_before = llm.admission.rejections["max_sessions"]
    with ws_connect(ws_url(stack, 1)) as held:
        held.send(
            json.dumps(
                {"type": "open", "request_id": "ws-held", "prompt": [7, 8, 9], "max_tokens": LONG, **GREEDY}
            )
        )
        assert json.loads(held.recv(timeout=60))["type"] == "output"  # it runs, holding its slot
        with ws_connect(ws_url(stack, 1)) as ws:
            ws.send(json.dumps({"type": "open", "request_id": "ws-over", "prompt": [7], "max_tokens": 1}))
            error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["status"] == 503 and error["retry_after"] == 1, error
        assert (
            error["error"]["code"] == "max_sessions" and error["error"]["type"] == "service_unavailable_error"
        )
        # A5: counted in admission_rejections_total{reason="max_sessions"} like every 503 of admission.
        assert llm.admission.rejections["max_sessions"] == refused_before + 1
        r = httpx.post(
            stack.urls[1] + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2, **GREEDY},
        )
        assert r.status_code == 200, r.text
    assert wait_for(lambda: llm.num_sessions == 0, timeout=30), "a closed session is no longer counted"


@pytest.mark.parametrize("when", ["open", "chunk"])
def test_s15_a_binary_frame_is_a_400_error_message_and_a_1008_close(stack: Stack, when: str) -> None:
    """Issue 37: a binary frame was an unhandled KeyError in the gateway and a 1006 close."""
    with ws_connect(ws_url(stack, 1)) as ws:
        if when == "chunk":
            ws.send(json.dumps({"type": "open", "prompt": [5, 6], "max_tokens": 1, **GREEDY}))
            ws_segment(ws)
        ws.send(b'{"type": "open"}')
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["status"] == 400, error
        assert "not a binary frame" in error["error"]["message"]
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def test_s15_a_session_takes_a_cache_salt_and_names_a_bad_or_unknown_open_field(stack: Stack) -> None:
    """Issue 37: ``cache_salt`` in an open message answered with protobuf's own error text."""
    with ws_connect(ws_url(stack, 1)) as ws:
        ws.send(
            json.dumps(
                {"type": "open", "prompt": [5, 6, 7], "max_tokens": 2, "cache_salt": "tenant-a", **GREEDY}
            )
        )
        _, messages = ws_segment(ws)
        assert len(messages[-1]["token_ids"]) + sum(len(m["token_ids"]) for m in messages[:-1]) == 2
    for extra, field in (({"cache_salt": ""}, "cache_salt"), ({"temprature": 0.5}, "temprature")):
        with ws_connect(ws_url(stack, 1)) as ws:
            ws.send(json.dumps({"type": "open", "prompt": [5], "max_tokens": 1, **extra}))
            error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["status"] == 400 and error["error"]["param"] == field, error
        assert "Message type" not in error["error"]["message"], "not protobuf's text"


def test_s15_a_websocket_message_over_max_body_bytes_closes_the_socket_with_1009(
    stack: Stack, tiny_model_dir: Path
) -> None:
    app = create_app(
        [stack.grpc_addrs[1]],
        MODEL,
        load_tokenizer(str(tiny_model_dir)),
        limits=RequestLimits(max_body_bytes=4096),
    )
    url = stack.loop.start_gateway(app).replace("http://", "ws://") + "/v1/sessions"
    with ws_connect(url) as ws:
        ws.send(json.dumps({"type": "open", "prompt": [7] * 2000, "max_tokens": 1}))  # ~6 KB
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


# ------------------------------------------------------------------ reset the prefix cache (vLLM's admin route)


def test_reset_prefix_cache_is_an_admin_route_after_which_a_prompt_is_computed_afresh(
    stack: Stack, tiny_model_dir: Path
) -> None:
    plain = stack.loop.start_gateway(
        create_app([stack.grpc_addrs[0]], MODEL, load_tokenizer(str(tiny_model_dir)), api_key=API_KEY)
    )
    prompt = list(
        range(300, 340)
    )  # 2 full blocks and a part; sequential requests go to engine 0 (least loaded)
    with httpx.Client(base_url=plain, timeout=60) as http:
        assert (
            http.post("/reset_prefix_cache", headers=ADMIN).status_code == 404
        )  # without --enable-admin-api
    with httpx.Client(base_url=stack.urls[0], timeout=120) as http:  # gateway 0 serves the admin routes

        def cached_tokens() -> int:
            r = http.post(
                "/v1/completions",
                headers=KEY,
                json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **GREEDY},
            )
            assert r.status_code == 200, r.text
            return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

        cached_tokens()
        assert cached_tokens() == 32  # the two full blocks
        assert http.post("/reset_prefix_cache").status_code == 401  # behind --admin-api-key
        assert http.post("/reset_prefix_cache", headers=KEY).status_code == 401  # which the API key is not
        reset = http.post("/reset_prefix_cache", headers=ADMIN)
        assert reset.status_code == 200 and reset.json() == {"reset": True}
        assert cached_tokens() == 0
        assert cached_tokens() == 32


# ------------------------------------------------------------------ reload weights (last: it swaps the model)


def prefix_cache_hits(http: httpx.Client) -> float:
    return sum(metric(http, "prefix_cache_hits_total", engine=e) for e in ("0", "1"))


def test_s13_reload_weights_only_while_paused_all_and_it_drops_the_prefix_cache(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fastsched.tools.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "other", seed=1)
    prompt = list(range(100, 140))  # 2 full blocks and a part

    with httpx.Client(base_url=stack.urls[0], timeout=120) as http:

        def complete() -> str:
            r = http.post(
                "/v1/completions",
                headers=KEY,
                json={"model": MODEL, "prompt": prompt, "max_tokens": 8, **GREEDY},
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        def reload(model: Path) -> httpx.Response:
            return http.post("/reload_weights", headers=ADMIN, json={"path": str(model)})

        original = complete()
        assert complete() == original
        not_paused = reload(other)
        assert not_paused.status_code == 409 and not_paused.json()["error"]["code"] == "not_paused"
        assert http.post("/pause?mode=all", headers=ADMIN).status_code == 200
        bad = reload(tmp_path / "missing")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"
        assert reload(other).json() == {"reloaded": True, "path": str(other)}
        assert http.post("/resume", headers=ADMIN).status_code == 200
        hits = prefix_cache_hits(http)
        swapped = complete()
        assert swapped != original, "the new weights serve"
        assert prefix_cache_hits(http) == hits, "no hit on KV the old weights computed"

        http.post("/pause?mode=all", headers=ADMIN)
        assert reload(tiny_model_dir).status_code == 200
        http.post("/resume", headers=ADMIN)
        assert complete() == original


def test_a_14_mb_websocket_chunk_is_refused_before_it_is_tokenized(stack: Stack) -> None:
    """Issue 22: one ~14 MB chunk was tokenized on the frontend's event loop (no size check
    before the token budget): the frontend missed its liveness deadline and the server died.
    It is refused now, by its characters, and the server goes on serving."""
    with ws_connect(ws_url(stack, 1), max_size=None) as ws:
        ws.send(json.dumps({"type": "open", "prompt": [7], "max_tokens": 1}))
        ws_segment(ws)
        ws.send(json.dumps({"type": "chunk", "prompt": "word " * 2_800_000, "max_tokens": 1}))
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and "chunk has 14000000 characters" in error["error"]["message"], (
            error
        )
    with httpx.Client(base_url=stack.urls[1], timeout=30) as http:
        assert http.get("/health").status_code == 200
