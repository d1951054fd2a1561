"""Issue 11's limits and errors (docs/serving.md "Limits", docs/design.md A4, §8): every size
a client controls is bounded, and a request over a bound gets a 4xx naming the field,
the value and the limit — never a 5xx, never a 503, and never seconds of work first.

One engine process on the tiny model (max_model_len 512) and, on one event loop in a
background thread, two real AsyncLLM frontends behind the real gRPC server and a gateway
each: frontend 0 with small connection limits, frontend 1 with A2/A3 limits (for A4).
Everything shares that one event loop, so anything that blocks it shows up as a
``/health`` that does not answer.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from engine_stack import ipc_dir, launch, teardown  # noqa: E402
from loop_thread import LoopThread, free_port  # noqa: E402

from fastsched.admin import AdminSettings  # noqa: E402
from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.limits import RequestLimits  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402
from fastsched.proto_gen import import_stubs  # noqa: E402

pb, pb_grpc = import_stubs()

MODEL = "tiny"
MAX_MODEL_LEN = 512
QUEUED_REQS = 4
QUEUED_TOKENS = 64
LIMITS = RequestLimits(max_concurrent_streams=8, header_timeout=1.0, body_timeout=1.0)
API_KEY = "sk-limits"
QUICK_S = 10.0  # "at once": far below what tokenizing a huge prompt took before (~29 s)


@dataclass
class Stack:
    loop: LoopThread
    urls: list[str]  # gateway 0 (limits), gateway 1 (A2/A3 limits)
    grpc_addrs: list[str]
    keyed_grpc_addr: str
    llms: list[AsyncLLM]
    max_prompt_chars: int


@pytest.fixture(scope="module")
def stack(
    engine_config: dict, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    engines = launch(
        {**engine_config, "max_model_len": MAX_MODEL_LEN}, ipc_dir(tmp_path_factory, "ipc"), 1, 3
    )
    loop = LoopThread()
    try:
        admission = [{}, {"max_num_queued_reqs": QUEUED_REQS, "max_num_queued_tokens": QUEUED_TOKENS}, {}]
        llms = [
            loop.call(
                AsyncLLM.start(
                    engines.input_addrs,
                    engines.output_addrs[i],
                    frontend_index=i,
                    settings=FrontendSettings(ready_timeout=60, limits=LIMITS, **admission[i]),
                )
            )
            for i in range(3)
        ]
        ports = [free_port() for _ in llms]
        # Frontends 0 and 1 serve the admin methods (GetRequestStatus), frontend 2 requires its key.
        servers = [
            loop.call(
                serve_frontend(
                    llm,
                    "127.0.0.1",
                    port,
                    limits=LIMITS,
                    api_key=API_KEY if i == 2 else None,
                    admin=AdminSettings(enable_admin_api=i != 2),
                )
            )
            for i, (llm, port) in enumerate(zip(llms, ports))
        ]
        addrs = [f"127.0.0.1:{port}" for port in ports]
        tokenizer = load_tokenizer(str(tiny_model_dir))
        urls = [loop.start_gateway(create_app([addrs[i]], MODEL, tokenizer, limits=LIMITS)) for i in range(2)]
        keyed_url = loop.start_gateway(
            create_app([addrs[2]], MODEL, tokenizer, api_key=API_KEY, limits=LIMITS)
        )
        try:
            yield Stack(
                loop, urls + [keyed_url], addrs[:2], addrs[2], llms, MAX_MODEL_LEN * tokenizer.max_token_chars
            )
        finally:
            loop.stop_gateways()
            for server in servers:
                loop.call(server.stop(0))
            for llm in llms:
                loop.call(llm.shutdown())
    finally:
        loop.close()
        teardown(engines)


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.urls[0], timeout=30, trust_env=False) as client:
        yield client


@pytest.fixture
def stub(stack: Stack) -> Iterator[Any]:
    channel = grpc.insecure_channel(
        stack.grpc_addrs[0],
        options=[("grpc.enable_http_proxy", 0), ("grpc.max_send_message_length", 64 << 20)],
    )
    yield pb_grpc.FrontendStub(channel)
    channel.close()


def error_of(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def grpc_error(stub: Any, request: Any, metadata: Any = ()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=QUICK_S, metadata=metadata))
    return info.value


def completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


def health_while(stack: Stack, work: Any) -> tuple[Any, list[float]]:
    """Runs ``work`` in a thread and polls gateway 0's /health meanwhile; returns the
    work's result and each /health's latency (the event loop must stay responsive)."""
    latencies = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(trust_env=False) as probe:
        future = pool.submit(work)
        while not future.done():
            start = time.monotonic()
            assert probe.get(stack.urls[0] + "/health", timeout=QUICK_S).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
        return future.result(timeout=QUICK_S), latencies


# ------------------------------------------------------------------ defect 1: n, A4


def test_n_above_max_n_is_400_at_once_naming_the_limit(http: httpx.Client, stub: Any) -> None:
    """Issue 11 defect 1: n 2147483647 grew a frontend by gigabytes; now 400 before any work."""
    error_of(
        http.post("/v1/completions", json=completion(n=2147483647)), 400, "n", "2147483647", "128", "--max-n"
    )
    error_of(http.post("/v1/completions", json=completion(n=20000, best_of=20000)), 400, "best_of", "--max-n")
    error = grpc_error(
        stub, pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(n=20000, max_tokens=1))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-n" in error.details()
    assert dict(error.trailing_metadata())["invalid-param"] == "n"


def test_a4_n_above_max_num_queued_reqs_is_400_not_503(stack: Stack) -> None:
    """A4: a request that can never be admitted is a client error naming the limit."""
    response = httpx.post(
        stack.urls[1] + "/v1/completions", json=completion(n=QUEUED_REQS + 1), timeout=30, trust_env=False
    )
    error_of(response, 400, "n", str(QUEUED_REQS + 1), f"max_num_queued_reqs ({QUEUED_REQS})")
    ok = httpx.post(
        stack.urls[1] + "/v1/completions", json=completion(n=QUEUED_REQS), timeout=30, trust_env=False
    )
    assert ok.status_code == 200, ok.text


def test_a4_prompt_longer_than_max_num_queued_tokens_is_400_not_admitted(stack: Stack) -> None:
    response = httpx.post(
        stack.urls[1] + "/v1/completions",
        json=completion(prompt=list(range(3, 3 + 100))),
        timeout=30,
        trust_env=False,
    )
    error_of(response, 400, "prompt", "100 tokens", f"max_num_queued_tokens ({QUEUED_TOKENS})")
    assert stack.llms[1].admission.num_requests == 0


# ------------------------------------------------------------------ defect 2: huge prompts


def test_huge_completion_prompt_is_refused_before_tokenizing_while_health_answers(
    stack: Stack, http: httpx.Client
) -> None:
    """Issue 11 defect 2: a 15 MB prompt was tokenized on the event loop (~29 s) first."""
    body = completion(prompt="word " * 3_000_000)
    response, latencies = health_while(
        stack, lambda: http.post("/v1/completions", json=body, timeout=QUICK_S)
    )
    error_of(response, 400, "prompt", "15000000 characters", f"{MAX_MODEL_LEN}")
    assert max(latencies, default=0) < QUICK_S


def test_huge_chat_message_is_refused_before_rendering_while_health_answers(
    stack: Stack, http: httpx.Client
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3_000_000}]}
    response, _ = health_while(stack, lambda: http.post("/v1/chat/completions", json=body, timeout=QUICK_S))
    error_of(response, 400, "messages", "15000000 characters")


def test_huge_grpc_text_is_refused_at_once(stub: Any) -> None:
    """Issue 11 defect 2: a 60 MB text over gRPC took ~97 s and left the frontend at 8 GB."""
    error = grpc_error(
        stub, pb.GenerateRequest(text="x" * 60_000_000, sampling_params=pb.SamplingParams(max_tokens=1))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "60000000 characters" in error.details()


def test_long_prompt_within_the_bound_is_tokenized_off_the_event_loop(
    stack: Stack, http: httpx.Client
) -> None:
    """Just under the character bound: tokenized (in a worker thread), then judged on tokens."""
    text = "a" * (stack.max_prompt_chars - 10)
    response, _ = health_while(stack, lambda: http.post("/v1/completions", json=completion(prompt=text)))
    error_of(response, 400, "prompt", "max_model_len (512)")
    short = http.post("/v1/completions", json=completion(prompt="x " * 3000, max_tokens=2))
    assert short.status_code in (200, 400), short.text  # 6000 characters: the threaded path either way


# ------------------------------------------------------------------ defect 4: stop strings


def test_too_many_or_too_long_stop_strings_are_400(http: httpx.Client, stub: Any) -> None:
    """Issue 11 defect 4: 10,000 stop strings of 1,000 characters stalled a frontend ~20 s."""
    error_of(
        http.post("/v1/completions", json=completion(stop=["x" * 1000] * 10_000)),
        400,
        "stop",
        "10000",
        "32",
        "--max-stop-sequences",
    )
    error_of(http.post("/v1/completions", json=completion(stop=["y" * 1000])), 400, "stop", "1000", "256")
    error = grpc_error(
        stub, pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(stop=["z" * 300], max_tokens=1))
    )
    assert (
        error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-stop-sequence-length" in error.details()
    )


# ------------------------------------------------------------------ defect 5: gRPC auth, request id


def test_grpc_port_requires_the_api_key_but_health(stack: Stack) -> None:
    """Issue 11 defect 5: the gRPC port ignored --api-key."""
    with grpc.insecure_channel(stack.keyed_grpc_addr, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = pb_grpc.FrontendStub(channel)
        request = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=1))
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            assert grpc_error(stub, request, metadata).code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                stub.GetStats(pb.GetStatsRequest(), timeout=QUICK_S, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Health(pb.HealthRequest(), timeout=QUICK_S).status == pb.SERVING
        good = (("authorization", f"Bearer {API_KEY}"),)
        assert list(stub.Generate(request, timeout=QUICK_S, metadata=good))[-1].usage.completion_tokens == 1
    # The gateway sends its key on: the whole path works with it.
    response = httpx.post(
        stack.urls[2] + "/v1/completions",
        json=completion(),
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    assert httpx.get(stack.urls[2] + "/metrics", timeout=30, trust_env=False).status_code == 200


def test_grpc_request_id_longer_than_the_limit_is_refused_and_not_remembered(stack: Stack, stub: Any) -> None:
    """Issue 11 defect 5: 1 MB request ids were remembered in the 10,000-entry history."""
    request_id = "r" * 1_000_000
    error = grpc_error(
        stub,
        pb.GenerateRequest(request_id=request_id, text="Hi", sampling_params=pb.SamplingParams(max_tokens=1)),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-request-id-length" in error.details()
    assert dict(error.trailing_metadata())["invalid-param"] == "request_id"
    assert stack.loop.call(stack.llms[0].request_status(request_id)) is None
    with pytest.raises(grpc.RpcError) as info:
        stub.GetRequestStatus(pb.RequestStatusRequest(request_id=request_id), timeout=QUICK_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------ defect 6: 500s that were 400s


def test_deeply_nested_json_is_400(http: httpx.Client) -> None:
    """Issue 11 defect 6: a RecursionError used to be a 500."""
    for depth in (100, 100_000):
        raw = '{"model": "tiny", "prompt": "Hi", "extra": ' + "[" * depth + "]" * depth + "}"
        error_of(
            http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
            400,
            None,
            "--max-json-depth",
        )


@pytest.mark.parametrize("where", ["prompt", "stop", "messages"])
def test_lone_surrogate_is_400_naming_the_field(http: httpx.Client, where: str) -> None:
    """Issue 11 defect 6: "abc\\ud800def" failed to encode (UnicodeEncodeError, 500)."""
    if where == "messages":
        raw = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "abc\\ud800def"}]}'
        path = "/v1/chat/completions"
    else:
        raw = json.dumps(completion(**{where: "PLACEHOLDER"})).replace("PLACEHOLDER", "abc\\ud800def")
        path = "/v1/completions"
    error_of(
        http.post(path, content=raw, headers={"content-type": "application/json"}),
        400,
        where,
        "lone surrogate",
    )


def test_too_many_prompts_in_one_request_is_400(http: httpx.Client) -> None:
    """Issue 11 defect 6: ~2,000 prompts in one request ended in 500 CANCELLED."""
    error_of(
        http.post("/v1/completions", json=completion(prompt=["Hi"] * 2000)),
        400,
        "prompt",
        "2000",
        "128",
        "--max-prompts-per-request",
    )


def test_streams_over_a_frontends_limit_get_a_retryable_answer_never_5xx(stack: Stack, stub: Any) -> None:
    """Issue 11 defect 6: ~2,000 concurrent gRPC streams gave 500 CANCELLED. Over
    max_concurrent_streams (8 here) a call gets RESOURCE_EXHAUSTED, the gateway a 503."""
    request = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=64, ignore_eos=True))

    def call(_: int) -> grpc.StatusCode:
        try:
            list(stub.Generate(request, timeout=60))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    def post(_: int) -> int:
        return httpx.post(
            stack.urls[0] + "/v1/completions",
            json=completion(max_tokens=64, ignore_eos=True),
            timeout=60,
            trust_env=False,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(call, range(40)))
        statuses = list(pool.map(post, range(40)))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert grpc.StatusCode.OK in codes
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses


# ------------------------------------------------------------------ defect 7: non-finite floats


@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN", "1e300", "1e400"])
def test_non_finite_temperature_is_400(http: httpx.Client, raw: str) -> None:
    """Issue 11 defect 7: temperature Infinity (or 1e300) was accepted."""
    body = f'{{"model": "tiny", "prompt": "Hi", "max_tokens": 1, "min_tokens": 1, "top_k": 1, "temperature": {raw}}}'
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("temperature", None)


def test_non_finite_temperature_over_grpc_is_invalid_argument(stub: Any) -> None:
    error = grpc_error(
        stub,
        pb.GenerateRequest(
            text="Hi", sampling_params=pb.SamplingParams(temperature=float("inf"), max_tokens=1)
        ),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "finite" in error.details()


# ------------------------------------------------------------------ defect 8: slow and large headers


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_half_open_connections_are_closed_after_the_header_timeout(stack: Stack) -> None:
    """Issue 11 defect 8: 500 half-open connections stayed open for good."""
    host, port = stack.urls[0].removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(50)]
    try:
        for i, sock in enumerate(socks):
            if i % 2:  # half a request line; the others send nothing at all
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answers = [_read_all(sock, LIMITS.header_timeout + 5) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers[1::2]), answers[1]
    assert all(a == b"" for a in answers[0::2])  # closed without a word (as an idle keep-alive)


def test_a_body_that_never_arrives_is_408(stack: Stack) -> None:
    host, port = stack.urls[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt":'
        )
        answer = _read_all(sock, LIMITS.body_timeout + 5)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--body-timeout" in answer


def test_oversized_headers_are_431_which_the_client_reads(http: httpx.Client) -> None:
    """Issue 11 defect 8: a 100 KB header reset the connection instead of a 431."""
    response = http.get("/health", headers={"X-Big": "b" * 100_000})
    assert response.status_code == 431, response.text
    assert "--max-header-bytes" in response.text
    assert http.get("/health").status_code == 200  # a fresh connection is fine


def test_headers_arriving_in_pieces_are_431_once_their_sum_outgrows_the_limit(stack: Stack) -> None:
    """Each piece is below --max-header-bytes; the parser alone would take them all."""
    host, port = stack.urls[0].removeprefix("http://").split(":")
    piece = b"X-Piece: " + b"p" * (LIMITS.max_header_bytes // 4) + b"\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(6):
            try:
                sock.sendall(piece)
            except OSError:  # already answered and half-closed
                break
            time.sleep(0.05)
        answer = _read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"--max-header-bytes" in answer


def test_a_malformed_request_is_400_which_the_client_reads(stack: Stack) -> None:
    host, port = stack.urls[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"NOT A REQUEST LINE\r\n\r\n" + b"x" * 10_000)
        answer = _read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


def _read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body, however the server split its writes."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":", 1)[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_kept_alive_connection_serves_a_second_request_and_its_head_is_bounded(stack: Stack) -> None:
    host, port = stack.urls[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        first = _read_response(sock)
        assert first.startswith(b"HTTP/1.1 200"), first
        sock.sendall(
            b"GET /version HTTP/1.1\r\nHost: x\r\nX-Big: "
            + b"b" * (LIMITS.max_header_bytes + 1)
            + b"\r\n\r\n"
        )
        answer = _read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


# ------------------------------------------------------------------ issue 22: sizes a client sets


def test_a_huge_choice_list_is_400_before_it_is_compiled(http: httpx.Client, stub: Any) -> None:
    """Issue 22: one request with a very large `choice` list was compiled on the frontend's
    event loop, which then missed the launcher's liveness deadline: the server died."""
    choices = [f"option {i}" for i in range(100_000)]
    error_of(
        http.post("/v1/completions", json=completion(structured_outputs={"choice": choices})),
        400,
        "structured_outputs",
        "100000 strings",
        "--max-structured-outputs-choices",
    )
    error = grpc_error(
        stub,
        pb.GenerateRequest(
            text="Hi",
            sampling_params=pb.SamplingParams(
                max_tokens=1, structured_outputs=pb.StructuredOutputs(choice=pb.Choices(values=choices))
            ),
        ),
    )
    assert (
        error.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "--max-structured-outputs-choices" in error.details()
    )
    assert dict(error.trailing_metadata())["invalid-param"] == "structured_outputs"


def test_a_huge_regex_is_400_before_it_is_compiled(http: httpx.Client) -> None:
    regex = "(" + "|".join(f"w{i}" for i in range(50_000)) + ")"
    error_of(
        http.post("/v1/completions", json=completion(guided_regex=regex)),
        400,
        "structured_outputs",
        f"{len(regex)} characters",
        "--max-structured-outputs-chars",
    )


def test_an_output_constraint_is_compiled_off_the_event_loop(
    stack: Stack, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: within the bounds, a constraint still compiles in the request gate's worker
    threads, never on the loop that serves every other request."""
    import threading

    import fastsched.sampling_params as sampling_params

    threads = []
    compiles = sampling_params.check_compiles

    def recording(params: Any) -> None:
        threads.append(threading.current_thread())
        compiles(params)

    monkeypatch.setattr(sampling_params, "check_compiles", recording)
    response = http.post(
        "/v1/completions", json=completion(structured_outputs={"choice": ["yes", "no", "maybe"]})
    )
    assert response.status_code == 200, response.text
    assert threads and stack.loop.thread not in threads


def test_too_many_stop_token_ids_are_400(http: httpx.Client, stub: Any) -> None:
    """Issue 22: a very long stop_token_ids list was copied per completion on the event loop
    and scanned for every generated token in the scheduler."""
    error_of(
        http.post("/v1/completions", json=completion(stop_token_ids=list(range(100)) * 100)),
        400,
        "stop_token_ids",
        "10000 ids",
        "--max-stop-token-ids",
    )
    error = grpc_error(
        stub,
        pb.GenerateRequest(
            text="Hi", sampling_params=pb.SamplingParams(max_tokens=1, stop_token_ids=[1] * 1000)
        ),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-stop-token-ids" in error.details()


def test_too_many_messages_or_tools_are_400(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}] * 2000
    error_of(
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}),
        400,
        "messages",
        "2000 messages",
        "--max-messages",
    )
    error_of(
        http.post("/tokenize", json={"model": MODEL, "messages": messages}), 400, "messages", "--max-messages"
    )
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(200)
    ]
    error_of(
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages[:1], "tools": tools}),
        400,
        "tools",
        "200 tools",
        "--max-tools",
    )


def test_a_huge_session_chunk_is_refused_before_it_is_tokenized(
    stack: Stack, stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: one ~14 MB session chunk was tokenized on the frontend's event loop before any
    size check (WebSocket sessions reach the frontend as this gRPC GenerateSession)."""
    import threading

    tokenizer = stack.llms[0].tokenizer
    encoded = []
    encode = tokenizer.encode

    def recording(text: str, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append((len(text), threading.current_thread()))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)

    def messages() -> Iterator[Any]:
        yield pb.SessionRequest(
            open=pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=1))
        )
        yield pb.SessionRequest(chunk=pb.SessionChunk(text="word " * 2_800_000, max_tokens=1))

    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateSession(messages(), timeout=QUICK_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "chunk has 14000000 characters" in info.value.details()
    assert all(n < 1000 for n, _ in encoded), [n for n, _ in encoded]

    # A long chunk within the bound is tokenized, off the event loop.
    def long_chunk() -> Iterator[Any]:
        yield pb.SessionRequest(
            open=pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=1))
        )
        yield pb.SessionRequest(chunk=pb.SessionChunk(text="a" * 5000, max_tokens=1))

    encoded.clear()
    with pytest.raises(grpc.RpcError) as info:  # 1250 tokens: more than the session has room for
        list(stub.GenerateSession(long_chunk(), timeout=QUICK_S))
    assert "max_model_len (512)" in info.value.details()
    assert any(n == 5000 and thread is not stack.loop.thread for n, thread in encoded), encoded


def test_a_json_body_sent_as_text_plain_is_415(http: httpx.Client) -> None:
    """Issue 22: any web page may POST text/plain to a local server without asking it first."""
    body = json.dumps(completion())
    error = error_of(
        http.post("/v1/completions", content=body, headers={"content-type": "text/plain"}),
        415,
        None,
        "application/json",
    )
    assert error["code"] == "unsupported_media_type"
    ok = http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200, ok.text


def test_a_grpc_request_id_with_a_newline_is_refused(stub: Any) -> None:
    """Issue 22: session and gRPC ids went into the logs as sent, newlines included."""
    error = grpc_error(
        stub,
        pb.GenerateRequest(
            request_id="r1\nFAKE LOG LINE", text="Hi", sampling_params=pb.SamplingParams(max_tokens=1)
        ),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(error.trailing_metadata())["invalid-param"] == "request_id"
