"""Where is my request? ``AsyncLLM.request_status``, gRPC ``GetRequestStatus`` and the
gateway's ``GET /debug/requests/{id}`` on real processes: one engine process on the
tiny model with room for one running sequence (``max_num_seqs=1``), so that a second
request waits, behind three frontend addresses. Frontends 0 and 1 serve gRPC behind the
gateway and admit one request each (``max_num_queued_reqs=1``); the AsyncLLM tests
connect their own frontend 2.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port, wait_for  # noqa: E402

from fastsched.admin import AdminSettings  # noqa: E402
from fastsched.engine.engine_proc import start_engine_process, stop_engine_processes  # noqa: E402
from fastsched.frontend.admission import QueueOverflowError  # noqa: E402
from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402
from fastsched.proto_gen import import_stubs  # noqa: E402
from fastsched.sampling_params import SamplingParams  # noqa: E402

pb, pb_grpc = import_stubs()

MODEL = "tiny"
API_KEY = "sk-status"
ADMIN_KEY = "sk-status-admin"
ADMIN = AdminSettings(enable_admin_api=True)  # /debug/requests and GetRequestStatus are admin operations
KEYED_ADMIN = AdminSettings(enable_admin_api=True, admin_api_key=ADMIN_KEY)
GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = 2000  # tokens: a request that runs until the test aborts it


@dataclass
class Stack:
    loop: LoopThread
    input_addrs: list[str]
    direct_output_addr: str  # frontend 2, for the AsyncLLM tests
    llms: list[AsyncLLM]  # frontends 0 and 1, behind gRPC and the gateway
    grpc_addrs: list[str]
    url: str
    keyed_url: str


@pytest.fixture(scope="module")
def stack(
    engine_config: dict, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("status")
    assert len(str(directory)) < 80, f"ipc directory path too long for unix sockets: {directory}"
    inputs = [f"ipc://{directory}/engine0.in"]
    outputs = [f"ipc://{directory}/frontend{i}.out" for i in range(3)]
    procs = [
        start_engine_process(
            {**engine_config, "max_num_seqs": 1},
            0,
            inputs[0],
            outputs,
            torch_num_threads=1,
            heartbeat_interval=0.5,
        )
    ]
    loop = LoopThread()
    llms: list[AsyncLLM] = []
    servers: list[Any] = []
    try:
        for i in range(2):
            llms.append(
                loop.call(
                    AsyncLLM.start(
                        inputs,
                        outputs[i],
                        frontend_index=i,
                        settings=FrontendSettings(max_num_queued_reqs=1, ready_timeout=60),
                    )
                )
            )
        grpc_addrs = [f"127.0.0.1:{free_port()}" for _ in llms]
        for llm, addr in zip(llms, grpc_addrs):
            servers.append(
                loop.call(serve_frontend(llm, "127.0.0.1", int(addr.rsplit(":", 1)[1]), admin=ADMIN))
            )
        tokenizer = load_tokenizer(str(tiny_model_dir))
        url = loop.start_gateway(create_app(grpc_addrs, MODEL, tokenizer, admin=ADMIN))
        keyed_url = loop.start_gateway(
            create_app(grpc_addrs, MODEL, tokenizer, api_key=API_KEY, admin=KEYED_ADMIN)
        )
        yield Stack(loop, inputs, outputs[2], llms, grpc_addrs, url, keyed_url)
    finally:
        loop.stop_stack(servers, llms)
        stop_engine_processes(procs, timeout=10.0)
        assert not any(p.is_alive() for p in procs)


# ------------------------------------------------------------------ AsyncLLM


@asynccontextmanager
async def connect(stack: Stack, **kwargs: Any) -> AsyncIterator[AsyncLLM]:
    llm = await AsyncLLM.start(
        stack.input_addrs,
        stack.direct_output_addr,
        frontend_index=2,
        settings=FrontendSettings(ready_timeout=60, **kwargs),
    )
    try:
        yield llm
    finally:
        await llm.shutdown()


async def status_when(llm: AsyncLLM, request_id: str, predicate: Callable[[dict], bool]) -> dict:
    """Polls until the status satisfies ``predicate`` (e.g. a step has seen the request)."""
    deadline = time.monotonic() + 30
    while not predicate(status := await llm.request_status(request_id)):
        assert time.monotonic() < deadline, f"status never reached the expected state: {status}"
        await asyncio.sleep(0.02)
    return status


def gated(status: dict | None) -> bool:
    return status is not None and status["sequences"][0].get("blocked_by") is not None


def test_request_waiting_behind_a_full_engine_reports_its_queue_position_and_gate(stack: Stack) -> None:
    async def go() -> None:
        async with connect(stack) as llm:
            running = llm.generate("long", "def main():", SamplingParams(max_tokens=LONG, **GREEDY))
            await running.__anext__()  # its first token: it runs
            waiting = llm.generate("next", "import os", SamplingParams(max_tokens=4, **GREEDY))
            status = await status_when(llm, "next", gated)
            assert (status["request_id"], status["state"], status["frontend"], status["engine"]) == (
                "next",
                "waiting",
                2,
                0,
            )
            (sequence,) = status["sequences"]
            assert (
                sequence["state"],
                sequence["queue_position"],
                sequence["num_waiting"],
                sequence["blocked_by"],
            ) == ("waiting", 0, 1, "active_seqs")
            assert (
                sequence["num_computed_tokens"],
                sequence["num_blocks"],
                sequence["num_output_tokens"],
            ) == (0, 0, 0)
            assert status["metrics"]["num_generation_tokens"] == 0 and "ttft" not in status["metrics"]
            await running.aclose()
            async for _ in waiting:
                pass

    stack.loop.call(go())


def test_running_request_reports_computed_tokens_and_blocks(stack: Stack) -> None:
    async def go() -> None:
        async with connect(stack) as llm:
            running = llm.generate("long", "def main():", SamplingParams(max_tokens=LONG, **GREEDY))
            await running.__anext__()
            status = await llm.request_status("long")
            assert status is not None and (status["state"], status["engine"]) == ("running", 0)
            (sequence,) = status["sequences"]
            assert sequence["num_computed_tokens"] >= sequence["num_prompt_tokens"] > 0
            assert sequence["num_blocks"] > 0 and sequence["num_preemptions"] == 0
            assert "queue_position" not in sequence and "blocked_by" not in sequence
            assert status["metrics"]["ttft"] >= 0 and "e2e" not in status["metrics"]
            await running.aclose()

    stack.loop.call(go())


def test_n2_request_reports_each_sequence_where_it_is(stack: Stack) -> None:
    async def go() -> None:
        async with connect(stack) as llm:
            stream = llm.generate("pair", "class Queue:", SamplingParams(n=2, max_tokens=LONG, **GREEDY))
            await stream.__anext__()
            status = await status_when(
                llm, "pair", lambda s: any(q.get("blocked_by") for q in s["sequences"])
            )
            assert status["state"] == "mixed"
            assert sorted(q["state"] for q in status["sequences"]) == ["running", "waiting"]
            assert sorted(q["index"] for q in status["sequences"]) == [0, 1]
            await stream.aclose()

    stack.loop.call(go())


def test_finished_and_aborted_requests_are_remembered_with_their_finish_reasons(stack: Stack) -> None:
    async def go() -> None:
        async with connect(stack) as llm:
            async for out in llm.generate("done", "import os", SamplingParams(max_tokens=4, **GREEDY)):
                pass
            status = await llm.request_status("done")
            assert status is not None and (status["state"], status["engine"]) == ("finished", 0)
            assert status["sequences"] == [
                {"index": 0, "state": "finished", "num_output_tokens": 4, "finish_reason": "length"}
            ]
            metrics = status["metrics"]
            assert metrics["num_generation_tokens"] == 4 and metrics["num_prompt_tokens"] == len(
                out.prompt_token_ids
            )
            assert metrics["e2e"] >= metrics["ttft"] >= 0 and metrics["queue_time"] >= 0
            stream = llm.generate("gone", "import os", SamplingParams(max_tokens=LONG, **GREEDY))
            await stream.__anext__()
            await stream.aclose()  # the client went away: aborted in the engine
            gone = await llm.request_status("gone")
            assert gone is not None and gone["state"] == "finished"
            assert gone["sequences"][0]["finish_reason"] == "abort"

    stack.loop.call(go())


def test_rejected_request_is_remembered_with_its_reason_and_message(stack: Stack) -> None:
    async def go() -> None:
        async with connect(stack, max_num_queued_reqs=1) as llm:
            stream = llm.generate("first", "import os", SamplingParams(max_tokens=LONG, **GREEDY))
            with pytest.raises(QueueOverflowError) as rejected:
                llm.generate("second", "import sys", SamplingParams(max_tokens=4))
            status = await llm.request_status("second")
            assert status is not None
            assert {k: status[k] for k in ("request_id", "state", "frontend", "reason", "message")} == {
                "request_id": "second",
                "state": "rejected",
                "frontend": 2,
                "reason": "max_num_queued_reqs",
                "message": str(rejected.value),
            }
            assert "engine" not in status and "sequences" not in status
            assert status["metrics"]["num_prompt_tokens"] > 0
            await stream.aclose()

    stack.loop.call(go())


def test_request_this_frontend_never_saw_is_none(stack: Stack) -> None:
    async def go() -> None:
        async with connect(stack) as llm:
            assert await llm.request_status("never-sent") is None

    stack.loop.call(go())


# ------------------------------------------------------------------ gateway and gRPC


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


def debug(http: httpx.Client, request_id: str) -> dict:
    r = http.get(f"/debug/requests/{request_id}")
    assert r.status_code == 200, r.text
    return r.json()


@dataclass
class InFlight:
    running_id: str
    waiting_id: str
    waiting_response: list[httpx.Response]


@pytest.fixture
def in_flight(stack: Stack, http: httpx.Client) -> Iterator[InFlight]:
    """One request running (streamed, on one frontend) and one waiting behind it (on the
    other); both frontends are then full. Ends them by disconnecting the first."""
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": LONG, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "mine-run"}) as running:
        assert running.status_code == 200 and running.headers["x-request-id"] == "mine-run"
        lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
        next(line for line in lines if line.startswith("data: "))
        responses: list[httpx.Response] = []

        def wait_in_line() -> None:
            with httpx.Client(base_url=stack.url, timeout=60) as own:
                responses.append(
                    own.post(
                        "/v1/completions",
                        headers={"X-Request-Id": "mine-wait"},
                        json={"model": MODEL, "prompt": "import os", "max_tokens": 4, **GREEDY},
                    )
                )

        waiter = threading.Thread(target=wait_in_line)
        waiter.start()
        assert wait_for(
            lambda: (
                http.get("/debug/requests/mine-wait").status_code == 200
                and gated(debug(http, "mine-wait")["prompts"][0])
            ),
            timeout=30,
        )
        yield InFlight("mine-run", "mine-wait", responses)
    waiter.join(60)
    assert responses and responses[0].status_code == 200


def test_gateway_finds_a_running_request_by_its_response_id_and_by_its_prompt_id(
    http: httpx.Client, in_flight: InFlight
) -> None:
    status = debug(http, in_flight.running_id)
    assert (status["request_id"], status["state"]) == ("mine-run", "running")
    (prompt,) = status["prompts"]
    assert (prompt["request_id"], prompt["state"], prompt["engine"]) == ("mine-run-0", "running", 0)
    assert prompt["sequences"][0]["num_computed_tokens"] > 0 and prompt["sequences"][0]["num_blocks"] > 0
    by_prompt = debug(http, "mine-run-0")
    assert by_prompt["request_id"] == "mine-run-0" and by_prompt["prompts"][0]["request_id"] == "mine-run-0"


def test_gateway_reports_the_waiting_request_with_its_gate(http: httpx.Client, in_flight: InFlight) -> None:
    status = debug(http, in_flight.waiting_id)
    assert status["state"] == "waiting"
    sequence = status["prompts"][0]["sequences"][0]
    assert (sequence["queue_position"], sequence["num_waiting"], sequence["blocked_by"]) == (
        0,
        1,
        "active_seqs",
    )
    assert status["prompts"][0]["frontend"] != debug(http, in_flight.running_id)["prompts"][0]["frontend"]


def test_gateway_503_carries_x_request_id_and_the_rejection_can_be_looked_up(
    http: httpx.Client, in_flight: InFlight
) -> None:
    body = {"model": MODEL, "prompt": "import sys", "max_tokens": 4}
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "mine-rejected"})
    assert (
        r.status_code == 503 and r.headers["x-request-id"] == "mine-rejected" and "retry-after" in r.headers
    )
    status = debug(http, "mine-rejected")
    assert status["state"] == "rejected"
    (prompt,) = status["prompts"]
    assert (prompt["request_id"], prompt["reason"]) == ("mine-rejected-0", "max_num_queued_reqs")
    assert "max_num_queued_reqs" in prompt["message"]
    generated = http.post("/v1/completions", json=body)  # no X-Request-Id: the gateway's own id comes back
    assert generated.status_code == 503 and generated.headers["x-request-id"].startswith("cmpl-")
    assert debug(http, generated.headers["x-request-id"])["state"] == "rejected"


def test_gateway_finished_request_is_found_by_the_id_of_its_response(
    http: httpx.Client, stack: Stack
) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["import os", "import sys"], "max_tokens": 3, **GREEDY},
    )
    assert r.status_code == 200
    response_id = r.json()["id"]
    assert r.headers["x-request-id"] == response_id and response_id.startswith("cmpl-")
    status = debug(http, response_id)
    assert status["state"] == "finished"
    assert [p["request_id"] for p in status["prompts"]] == [f"{response_id}-0", f"{response_id}-1"]
    for prompt in status["prompts"]:
        assert prompt["sequences"] == [
            {"index": 0, "state": "finished", "num_output_tokens": 3, "finish_reason": "length"}
        ]
        # The gateway prints what the frontend's AsyncLLM says, field for field.
        frontend = stack.llms[prompt["frontend"]]
        assert prompt == stack.loop.call(frontend.request_status(prompt["request_id"]))


def test_gateway_chat_response_id_is_found_too(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 2, **GREEDY, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
    assert r.json()["id"].startswith("chatcmpl-") and debug(http, r.json()["id"])["state"] == "finished"


def test_gateway_unknown_request_is_404_in_the_openai_error_shape(http: httpx.Client) -> None:
    r = http.get("/debug/requests/no-such-request")
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("not_found_error", "request_not_found")
    assert "no-such-request" in error["message"]


def test_gateway_invalid_x_request_id_is_400(http: httpx.Client) -> None:
    for bad in ("has space", "x" * 129, "a/b"):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": bad})
        assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
        assert "x-request-id" not in r.headers


def test_gateway_errors_carry_x_request_id(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={"model": "other-model", "prompt": "x"}, headers={"X-Request-Id": "mine-404"}
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == "mine-404"
    r = http.post("/v1/chat/completions", content=b"{", headers={"X-Request-Id": "mine-400"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "mine-400"


def test_gateway_debug_route_needs_the_api_key_when_one_is_set(stack: Stack) -> None:
    with httpx.Client(base_url=stack.keyed_url, timeout=30) as keyed:
        assert keyed.get("/debug/requests/anything").status_code == 401
        # /debug/* is an admin route: the API key does not open it, the admin key does.
        assert (
            keyed.get("/debug/requests/anything", headers={"Authorization": f"Bearer {API_KEY}"}).status_code
            == 401
        )
        authorized = keyed.get("/debug/requests/anything", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert authorized.status_code == 404


def test_grpc_get_request_status_of_an_unknown_id_is_not_found(stack: Stack) -> None:
    with grpc.insecure_channel(stack.grpc_addrs[0], options=[("grpc.enable_http_proxy", 0)]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.FrontendStub(channel).GetRequestStatus(pb.RequestStatusRequest(request_id="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()


def test_gateway_answers_503_not_404_when_a_frontend_cannot_be_asked(stack: Stack) -> None:
    app = create_app([f"127.0.0.1:{free_port()}", stack.grpc_addrs[0]], MODEL, tokenizer=None, admin=ADMIN)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        ) as http:
            response = await http.get("/debug/requests/nobody-knows")
        await app.state.gateway.pool.close()
        return response

    r = stack.loop.call(go())
    assert r.status_code == 503 and r.json()["error"]["code"] == "frontend_unavailable"
