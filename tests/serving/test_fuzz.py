"""Fuzzing and a soak (issue 11): the HTTP API, the gRPC messages, the ``/v1/sessions``
WebSocket's messages and the admin routes (issue 22) with random shapes, types and sizes
must get 2xx or a 4xx JSON error — never a 5xx, never INTERNAL, never a WebSocket closed
as an internal error — and leave the server healthy and idle; a bounded soak of mixed traffic must end with nothing
running or waiting, an empty KV cache and flat memory.

One engine process (tiny model, max_model_len 128) and, on one event loop in a thread,
a real AsyncLLM frontend behind the gRPC server and the gateway, with small limits so
that random requests stay cheap. Hypothesis's examples are bounded (FUZZ_EXAMPLES each).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (requirements.txt)")
websockets = pytest.importorskip("websockets", reason="websockets is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from engine_stack import ipc_dir, launch, teardown  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from loop_thread import LoopThread, free_port, wait_for  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

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
LIMITS = RequestLimits(max_n=4, max_prompts_per_request=4, max_stop_sequences=4, max_concurrent_streams=64)
FUZZ_EXAMPLES = 120
SOAK_S = 30.0
RSS_GROWTH_MB = 64.0  # after warm-up; a leak of a request's state per request would be far more
GRPC_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
}
SEEN: Counter[str] = Counter()  # statuses seen, reported at the end


ADMIN_KEY = "sk-fuzz-admin"


@dataclass
class Stack:
    loop: LoopThread
    url: str
    grpc_addr: str
    llm: AsyncLLM
    engine_pid: int
    admin_url: str  # a second gateway and frontend over the same AsyncLLM, with every admin route on


@pytest.fixture(scope="module")
def stack(
    engine_config: dict, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    engines = launch({**engine_config, "max_model_len": 128}, ipc_dir(tmp_path_factory, "ipc"), 1, 1)
    loop = LoopThread()
    try:
        llm = loop.call(
            AsyncLLM.start(
                engines.input_addrs,
                engines.output_addrs[0],
                settings=FrontendSettings(ready_timeout=60, limits=LIMITS, max_num_queued_reqs=32),
            )
        )
        port = free_port()
        server = loop.call(serve_frontend(llm, "127.0.0.1", port, limits=LIMITS))
        tokenizer = load_tokenizer(str(tiny_model_dir))
        url = loop.start_gateway(create_app([f"127.0.0.1:{port}"], MODEL, tokenizer, limits=LIMITS))
        admin = AdminSettings(
            enable_admin_api=True,
            enable_runtime_lora_updating=True,
            admin_api_key=ADMIN_KEY,
            allowed_local_paths=(str(tmp_path_factory.mktemp("allowed")),),
        )
        admin_port = free_port()
        admin_server = loop.call(serve_frontend(llm, "127.0.0.1", admin_port, limits=LIMITS, admin=admin))
        admin_url = loop.start_gateway(
            create_app([f"127.0.0.1:{admin_port}"], MODEL, tokenizer, limits=LIMITS, admin=admin)
        )
        try:
            yield Stack(loop, url, f"127.0.0.1:{port}", llm, engines.procs[0].pid, admin_url)
        finally:
            loop.stop_gateways()
            loop.call(server.stop(0))
            loop.call(admin_server.stop(0))
            loop.call(llm.shutdown())
    finally:
        loop.close()
        teardown(engines)


def idle(stack: Stack) -> bool:
    s = stack.llm.stats()
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["kv_cache_usage"] == 0
        and s["num_requests_in_flight"] == 0
    )


# ------------------------------------------------------------------ strategies

# Every character, lone surrogates included (sent as JSON \\u escapes).
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 1e300, 0.5]),
)
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXT, inner, max_size=5)),
    max_leaves=20,
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "priority",
    "model",
    "suffix",
    "logit_bias",
    "tools",
    "tool_choice",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_choice",
]
PLAUSIBLE = {  # values of the right shape, so that fuzzing reaches past the type checks
    "prompt": st.one_of(TEXT, st.lists(st.integers(-5, 2000), max_size=8), st.lists(TEXT, max_size=6)),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.one_of(TEXT, st.none())}
        ),
        max_size=3,
    ),
    "max_tokens": st.integers(-2, 200),
    "n": st.integers(-1, 6),
    "temperature": NUMBER,
    "top_k": st.integers(-3, 50),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6)),
    "stream": st.booleans(),
    "model": st.just(MODEL),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "min_tokens": st.integers(-1, 10),
}
BODY = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=2).flatmap(
    lambda junk: st.fixed_dictionaries({}, optional={k: v for k, v in PLAUSIBLE.items()}).map(
        lambda good: {**junk, **good}
    )
)


def _check_http(response: httpx.Response) -> None:
    SEEN[f"http {response.status_code}"] += 1
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_http_bodies_get_2xx_or_a_4xx_json_error(stack: Stack, body: dict, path: str) -> None:
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True)  # NaN/Infinity literals are sent as such
    with httpx.Client(base_url=stack.url, timeout=60, trust_env=False) as http:
        if body.get("stream") is True:
            with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
                SEEN[f"http {r.status_code}"] += 1
                assert r.status_code < 500
                text = "".join(r.iter_text())
                if r.status_code == 200:
                    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        else:
            _check_http(http.post(path, content=raw, headers={"content-type": "application/json"}))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
    content_type=st.sampled_from(["application/json", "text/plain", ""]),
)
def test_fuzz_http_raw_bytes_get_a_4xx(stack: Stack, raw: bytes, content_type: str) -> None:
    with httpx.Client(base_url=stack.url, timeout=60, trust_env=False) as http:
        _check_http(http.post("/v1/completions", content=raw, headers={"content-type": content_type}))


INT32 = st.integers(-(2**31), 2**31 - 1)
PB_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)  # protobuf strings are UTF-8 by construction
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(-3, 8),
        "temperature": st.floats(),
        "top_p": st.floats(),
        "top_k": INT32,
        "min_p": st.floats(),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "max_tokens": st.integers(-3, 300),
        "min_tokens": st.integers(-3, 300),
        "stop": st.lists(PB_TEXT, max_size=6),
        "stop_token_ids": st.lists(INT32, max_size=4),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.floats(),
        "frequency_penalty": st.floats(),
        "repetition_penalty": st.floats(),
        "logprobs": st.integers(-2, 30),
    },
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    sampling=SAMPLING,
    request_id=st.one_of(PB_TEXT, st.text(max_size=400).filter(lambda s: s.isascii())),
    prompt=st.one_of(PB_TEXT, st.lists(INT32, max_size=10), st.none()),
    priority=INT32,
    model=st.sampled_from(["", MODEL, "other"]),
)
def test_fuzz_grpc_generate_never_fails_internally(
    stack: Stack, sampling: dict, request_id: str, prompt: Any, priority: int, model: str
) -> None:
    request = pb.GenerateRequest(
        request_id=request_id, sampling_params=pb.SamplingParams(**sampling), priority=priority, model=model
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(stack.grpc_addr, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            list(pb_grpc.FrontendStub(channel).Generate(request, timeout=60))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
    SEEN[f"grpc {code.name}"] += 1
    assert code in GRPC_OK, code


SESSION_FIELDS = [
    "type",
    "prompt",
    "max_tokens",
    "last",
    "request_id",
    "priority",
    "model",
    "temperature",
    "seed",
    "stop",
    "n",
    "logprobs",
    "structured_outputs",
]
SESSION_MESSAGE = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(SESSION_FIELDS), JSON, max_size=3).flatmap(
        lambda junk: st.fixed_dictionaries(
            {"type": st.sampled_from(["open", "chunk", "close", "nope"])},
            optional={
                "prompt": PLAUSIBLE["prompt"],
                "max_tokens": st.integers(-2, 40),
                "last": st.booleans(),
                "model": st.just(MODEL),
            },
        ).map(lambda good: {**junk, **good})
    ),
)


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    messages=st.lists(
        st.one_of(SESSION_MESSAGE.map(json.dumps), st.binary(max_size=40).map(repr)), min_size=1, max_size=4
    )
)
def test_fuzz_session_messages_get_outputs_or_a_4xx_error_never_an_internal_close(
    stack: Stack, messages: list[str]
) -> None:
    """Issue 22: any sequence of WebSocket messages ends in outputs, a 4xx error message (or a
    503 with retry_after) and a policy close, never a 5xx nor close code 1011."""
    url = stack.url.replace("http://", "ws://") + "/v1/sessions"
    with ws_connect(url, open_timeout=10, close_timeout=5) as ws:
        try:
            for message in messages:
                ws.send(message)
            ws.send(json.dumps({"type": "close"}))
            while True:
                reply = json.loads(ws.recv(timeout=30))
                if reply["type"] == "error":
                    SEEN[f"ws {reply['status']}"] += 1
                    assert reply["status"] < 500 or reply["status"] == 503, reply
                    assert reply["error"]["message"] and reply["error"]["type"], reply
                elif reply.get("finish_reason") is not None and reply.get("usage") is not None:
                    break
        except websockets.exceptions.ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd is not None else None
            SEEN[f"ws close {code}"] += 1
            assert code != 1011, closed


ADMIN_ROUTES = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/reload_weights"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/debug/requests/x"),
]
ADMIN_BODY = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.one_of(TEXT, st.sampled_from(["/etc/passwd", "/nope", "../../etc", "/tmp"])),
            "lora_name": TEXT,
            "lora_path": st.one_of(TEXT, st.sampled_from(["/etc", "/nonexistent/adapter"])),
        },
    ),
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(ADMIN_ROUTES),
    body=ADMIN_BODY,
    key=st.sampled_from([None, "wrong", ADMIN_KEY]),
    mode=st.one_of(st.none(), st.sampled_from(["all", "new", "keep", ""]), TEXT),
)
def test_fuzz_admin_routes_get_2xx_or_a_4xx_json_error(
    stack: Stack, route: tuple[str, str], body: Any, key: str | None, mode: str | None
) -> None:
    """Issue 22: the admin routes, with no key, a wrong key or the admin key, with any body
    and query; the server is resumed after each example so that the next one can run."""
    method, path = route
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    params = {} if mode is None else {"mode": mode}
    try:
        with httpx.Client(base_url=stack.admin_url, timeout=30, trust_env=False) as http:
            response = http.request(
                method,
                path,
                headers=headers,
                params=params,
                content=json.dumps(body) if method == "POST" else None,
            )
            _check_http(response)
            if key is None or key == "wrong":
                assert response.status_code in (401, 403), (path, response.status_code, response.text)
    finally:
        httpx.post(
            stack.admin_url + "/resume",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
            trust_env=False,
        )


def test_fuzz_leaves_the_server_healthy_and_idle(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    assert httpx.get(stack.url + "/health", timeout=10, trust_env=False).status_code == 200
    assert wait_for(lambda: idle(stack), timeout=30), stack.llm.stats()
    with capsys.disabled():
        print(f"\nfuzz: {sum(SEEN.values())} requests; statuses {dict(sorted(SEEN.items()))}")
    assert not [k for k in SEEN if k.startswith("http 5") or k in ("grpc INTERNAL", "grpc UNKNOWN")]


# ------------------------------------------------------------------ soak


def _rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


async def _soak_client(url: str, seed: int, until: float, counts: Counter[str]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        while time.monotonic() < until:
            kind = rng.choice(["complete", "stream", "abort", "chat", "bad", "n"])
            body: dict[str, Any] = {
                "model": MODEL,
                "prompt": "def f(x):" * rng.randint(1, 8),
                "max_tokens": rng.randint(1, 60),
                "temperature": rng.choice([0.0, 0.8]),
            }
            if kind == "bad":
                body[rng.choice(["temperature", "n", "stop", "max_tokens"])] = rng.choice(
                    [float("inf"), 10**6, ["x"] * 100, -1, "nope"]
                )
                counts[
                    f"bad {(await http.post('/v1/completions', content=json.dumps(body))).status_code}"
                ] += 1
            elif kind in ("stream", "abort"):
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for i, _ in _enumerate(r.aiter_lines()):
                        if kind == "abort" and i >= 2:
                            break  # the client goes away mid-stream
                    counts[f"{kind} {r.status_code}"] += 1
            elif kind == "chat":
                chat = {
                    "model": MODEL,
                    "max_tokens": body["max_tokens"],
                    "messages": [{"role": "user", "content": body["prompt"]}],
                }
                counts[f"chat {(await http.post('/v1/chat/completions', json=chat)).status_code}"] += 1
            else:
                body["n"] = 2 if kind == "n" else 1
                counts[f"{kind} {(await http.post('/v1/completions', json=body)).status_code}"] += 1


async def _enumerate(lines: Any) -> Any:
    i = 0
    async for line in lines:
        yield i, line
        i += 1


def test_soak_mixed_traffic_ends_idle_with_flat_memory(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    async def phase(seconds: float, seed: int) -> Counter[str]:
        counts: Counter[str] = Counter()
        until = time.monotonic() + seconds
        await asyncio.gather(*(_soak_client(stack.url, seed + i, until, counts) for i in range(8)))
        return counts

    warm = asyncio.run(phase(SOAK_S / 3, 0))  # allocator pools, caches and histograms fill up
    assert wait_for(lambda: idle(stack), timeout=30)
    rss_before = (_rss_mb(), _rss_mb(stack.engine_pid))
    counts = asyncio.run(phase(SOAK_S * 2 / 3, 100))
    assert wait_for(lambda: idle(stack), timeout=30), stack.llm.stats()
    rss_after = (_rss_mb(), _rss_mb(stack.engine_pid))
    stats = stack.llm.stats()
    with capsys.disabled():
        print(
            f"\nsoak: {sum((warm + counts).values())} requests {dict(sorted((warm + counts).items()))}; "
            f"end: running {stats['num_running']} waiting {stats['num_waiting']} kv {stats['kv_cache_usage']} "
            f"in flight {stats['num_requests_in_flight']}; RSS MB gateway+frontend {rss_before[0]:.0f} -> "
            f"{rss_after[0]:.0f}, engine {rss_before[1]:.0f} -> {rss_after[1]:.0f}"
        )
    assert not [k for k in counts if k.split()[1].startswith("5") and not k.endswith(" 503")], counts
    assert all(k in ("bad 400", "bad 200") for k in counts if k.startswith("bad ")), (
        counts
    )  # 1e6: a valid temperature
    assert rss_after[0] - rss_before[0] < RSS_GROWTH_MB and rss_after[1] - rss_before[1] < RSS_GROWTH_MB
    assert httpx.get(stack.url + "/health", timeout=10, trust_env=False).status_code == 200
