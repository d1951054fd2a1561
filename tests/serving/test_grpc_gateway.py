"""The serving path gateway → gRPC → frontend, against a fake AsyncLLM (docs/design.md §1, §6 A5, §7, §8).

Two fake AsyncLLMs, each behind the real ``grpc_server`` on its own 127.0.0.1 port,
and the real gateway app on real uvicorn servers (one open, one with an API key), all
on one event loop in a background thread. The official ``openai`` client and httpx
talk to them over HTTP. The fakes keep AsyncLLM's contract: ``generate()`` checks and
admits when called (raising at once), and returns a stream of snapshots with per-completion
deltas that aborts the request when its ``async with`` block is left early.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port, wait_for  # noqa: E402

from fastsched.frontend.admission import (  # noqa: E402
    AdmissionError,
    EngineFaultedError,
    MaxQueuedTokensError,
    QueueOverflowError,
)
from fastsched.frontend.async_llm import CompletionDelta, StreamOutput  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.limits import RequestLimits  # noqa: E402
from fastsched.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from fastsched.proto_gen import import_stubs  # noqa: E402
from fastsched.request_gate import RequestGate, ValidRequest  # noqa: E402
from fastsched.sampling_params import SamplingParams  # noqa: E402

pb, pb_grpc = import_stubs()

MODEL = "fake-model"
MAX_MODEL_LEN = 64
VOCAB_SIZE = 1000
API_KEY = "sk-test-key"
WORDS = ["Hello", " world", ",", " this", " is", " a", " fake", " model", " talking", "."]
REJECTIONS = {
    "max_num_queued_reqs": QueueOverflowError(
        "queue full: 8 requests in flight would exceed max_num_queued_reqs (8)"
    ),
    "max_num_queued_tokens": MaxQueuedTokensError("prefill backlog full: 512 prompt tokens queued"),
    "engine_faulted": EngineFaultedError("the engine is not healthy"),
}


# ------------------------------------------------------------------ fakes


class FakeTokenizer:
    """One token per character; a chat template that writes each message as <role>content."""

    eos_token_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB_SIZE for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


class FakeStream:
    """AsyncLLM's ``RequestStream`` over the fake's snapshots: each one gets the deltas
    since the previous one, and leaving ``async with`` early closes the generator (which
    records an abort)."""

    def __init__(self, snapshots: AsyncIterator[RequestOutput]) -> None:
        self._snapshots = snapshots
        self._previous: list[CompletionOutput] | None = None

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._snapshots.aclose()

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> StreamOutput:
        snapshot = await self._snapshots.__anext__()
        deltas = [_delta(c, self._previous[c.index] if self._previous else None) for c in snapshot.outputs]
        self._previous = copy.deepcopy(snapshot.outputs)
        return StreamOutput(
            snapshot.request_id,
            snapshot.prompt,
            snapshot.prompt_token_ids,
            snapshot.outputs,
            snapshot.num_cached_tokens,
            deltas=[d for d in deltas if d is not None],
        )


def _delta(now: CompletionOutput, before: CompletionOutput | None) -> CompletionDelta | None:
    text, tokens, logprobs = (
        (before.text, before.token_ids, before.logprobs or []) if before else ("", [], [])
    )
    if before is not None and (now.text, now.token_ids, now.finished) == (text, tokens, before.finished):
        return None
    return CompletionDelta(
        now.index,
        now.text[len(text) :],
        now.token_ids[len(tokens) :],
        None if now.logprobs is None else now.logprobs[len(logprobs) :],
        now.finish_reason,
        now.stop_reason,
    )


class _WordTokenizer:
    """One token per word (ids from 100), as the fake generates them."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [100 + i for i, _ in enumerate(text.split())]


class FakeAsyncLLM:
    """AsyncLLM's contract with a deterministic generator: completion i emits
    WORDS[(step + i) % len(WORDS)] as token 100 + that word's index. Honors n,
    max_tokens, stop (cut before the match), logprobs; text prompts are one token per
    word. ``reject`` / ``fail`` / ``healthy`` / ``token_delay`` steer it; it records
    requests, aborts and rejections."""

    def __init__(self, stats_names: str, journal: list) -> None:
        self.journal = journal  # admitted requests of every fake, in order
        self.stats_names = (
            stats_names  # "design" (docs/design.md §7 names) or "engine" (AsyncLLM's current names)
        )
        self.reject: AdmissionError | None = None
        self.fail: Exception | None = None
        self.healthy = True
        self.token_delay = 0.0
        self.requests: list[tuple[str, str | list[int], SamplingParams, int]] = []
        self.aborts: list[str] = []
        self.rejections: Counter[str] = Counter()
        self.finished = 0
        self.loras = None  # serves no LoRA adapters
        self.gate = RequestGate(_WordTokenizer(), MAX_MODEL_LEN, VOCAB_SIZE)

    def reset(self) -> None:
        self.reject, self.fail, self.healthy, self.token_delay = None, None, True, 0.0

    def submit(self, valid: ValidRequest) -> FakeStream:
        """A request the gate (``self.gate``, AsyncLLM's own, over the fake's one-token-per-word
        tokenizer) let through."""
        prompt = valid.prompt if valid.prompt is not None else valid.prompt_token_ids
        self._admit(valid.request_id, prompt, valid.params, valid.priority)
        return FakeStream(self._stream(valid.request_id, prompt, valid.prompt_token_ids, valid.params))

    def _admit(self, request_id: str, prompt: Any, params: SamplingParams, priority: int) -> None:
        if self.reject is not None:
            self.rejections[self.reject.reason] += 1
            raise self.reject
        if self.fail is not None:
            raise self.fail
        self.requests.append((request_id, prompt, params, priority))
        self.journal.append((request_id, prompt, params, priority))

    async def _stream(
        self, request_id: str, prompt: Any, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        outputs = [
            CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.token_delay)
                for c in outputs:
                    if c.finished:
                        continue
                    w = (step + c.index) % len(WORDS)
                    c.token_ids.append(100 + w)
                    c.text += WORDS[w]
                    if c.logprobs is not None:
                        alternative = 100 + (w + 1) % len(WORDS)
                        c.logprobs.append(
                            {
                                100 + w: Logprob(-0.25, 1, WORDS[w]),
                                alternative: Logprob(-2.0, 2, WORDS[(w + 1) % len(WORDS)]),
                            }
                        )
                    hit = next((s for s in params.stop if s in c.text), None)
                    if hit is not None:
                        c.text = c.text[: c.text.index(hit)]
                        c.finish_reason, c.stop_reason = "stop", hit
                    elif len(c.token_ids) == params.max_tokens:
                        c.finish_reason = "length"
                snapshot = RequestOutput(
                    request_id,
                    prompt if isinstance(prompt, str) else None,
                    prompt_ids,
                    copy.deepcopy(outputs),
                    num_cached_tokens=0,
                )
                yield snapshot
                if snapshot.finished:
                    self.finished += 1
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self._record_abort(request_id)
            raise

    def _record_abort(self, request_id: str) -> None:
        if request_id not in self.aborts:
            self.aborts.append(request_id)

    async def abort(self, request_id: str) -> None:
        self._record_abort(request_id)

    def is_healthy(self) -> bool:
        return self.healthy

    def model_info(self) -> dict:
        return {"model": MODEL, "max_model_len": MAX_MODEL_LEN, "vocab_size": VOCAB_SIZE}

    def stats(self) -> dict:
        """Frontend 0 names things as the current AsyncLLM does, frontend 1 as docs/design.md §7;
        both report engine 1 alike, and frontend 1 holds an older report of engine 0."""
        if self.stats_names == "engine":
            top = {
                "num_running": 3,
                "num_waiting": 3,
                "kv_cache_usage": 0.5,
                "num_preemptions_total": 1,
                "prompt_tokens_total": 15,
                "generation_tokens_total": 25,
                "prefix_cache_queries": 36,
                "prefix_cache_hits": 18,
            }
            engines = [ENGINE_0, ENGINE_1]
        else:
            top = {
                "num_requests_running": 11,
                "num_requests_waiting": 11,
                "kv_cache_usage_perc": 0.8,
                "num_preemptions_total": 0,
                "prompt_tokens_total": 9,
                "generation_tokens_total": 9,
                "prefix_cache_queries_total": 10,
                "prefix_cache_hits_total": 3,
            }
            engines = [STALE_ENGINE_0, ENGINE_1_DESIGN_NAMES]
        return {**top, "engines": engines, "admission_rejections_total": dict(self.rejections)}


ENGINE_0 = {
    "index": 0,
    "num_running": 1,
    "num_waiting": 1,
    "kv_cache_usage": 0.25,
    "num_preemptions_total": 1,
    "prompt_tokens_total": 10,
    "generation_tokens_total": 20,
    "prefix_cache_queries": 30,
    "prefix_cache_hits": 15,
}
ENGINE_1 = {
    "index": 1,
    "num_running": 2,
    "num_waiting": 2,
    "kv_cache_usage": 0.75,
    "num_preemptions_total": 0,
    "prompt_tokens_total": 5,
    "generation_tokens_total": 5,
    "prefix_cache_queries": 6,
    "prefix_cache_hits": 3,
}
ENGINE_1_DESIGN_NAMES = {
    "engine_index": 1,
    "num_requests_running": 2,
    "num_requests_waiting": 2,
    "kv_cache_usage_perc": 0.75,
    "num_preemptions_total": 0,
    "prompt_tokens_total": 5,
    "generation_tokens_total": 5,
    "prefix_cache_queries_total": 6,
    "prefix_cache_hits_total": 3,
}
STALE_ENGINE_0 = {
    **ENGINE_1_DESIGN_NAMES,
    "engine_index": 0,
    "num_requests_running": 9,
    "num_requests_waiting": 9,
    "kv_cache_usage_perc": 0.9,
    "prompt_tokens_total": 4,
    "generation_tokens_total": 4,
}


# ------------------------------------------------------------------ servers


class Servers:
    """Two fake frontends behind real gRPC servers, and two gateways (open, keyed)."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        journal: list = []
        self.fakes = [
            FakeAsyncLLM(stats_names="engine", journal=journal),
            FakeAsyncLLM(stats_names="design", journal=journal),
        ]
        self.grpc_addrs = [f"127.0.0.1:{free_port()}" for _ in self.fakes]
        self.grpc_servers = [
            self.call(serve_frontend(f, "127.0.0.1", int(a.rsplit(":", 1)[1])))
            for f, a in zip(self.fakes, self.grpc_addrs)
        ]
        self.tokenizer = FakeTokenizer()
        self.url = self.loop.start_gateway(
            create_app(self.grpc_addrs, MODEL, self.tokenizer, limits=RequestLimits(max_body_bytes=64 * 1024))
        )
        self.keyed_url = self.loop.start_gateway(
            create_app(self.grpc_addrs, MODEL, self.tokenizer, api_key=API_KEY)
        )

    def call(self, coro: Any) -> Any:
        return self.loop.call(coro)

    def stop(self) -> None:
        self.loop.stop_gateways()
        for server in self.grpc_servers:
            self.call(server.stop(0))
        self.loop.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def fakes(servers: Servers) -> Iterator[list[FakeAsyncLLM]]:
    for f in servers.fakes:
        f.reset()
    yield servers.fakes
    for f in servers.fakes:
        f.reset()


@pytest.fixture
def client(servers: Servers, fakes: list[FakeAsyncLLM]) -> openai.OpenAI:
    # max_retries=0: the client would otherwise retry a 503 on its own, after Retry-After.
    return openai.OpenAI(base_url=servers.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(servers: Servers, fakes: list[FakeAsyncLLM]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=servers.url, timeout=10) as c:
        yield c


def all_requests(fakes: list[FakeAsyncLLM]) -> list[tuple[str, Any, SamplingParams, int]]:
    """Every admitted request (id, prompt, params, priority), oldest first."""
    return list(fakes[0].journal)


def expected_text(max_tokens: int, index: int = 0) -> str:
    return "".join(WORDS[(step + index) % len(WORDS)] for step in range(max_tokens))


def assert_error(response: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


# ------------------------------------------------------------------ the OpenAI API


def test_completion_returns_text_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="one two three", max_tokens=5)
    assert out.choices[0].text == expected_text(5)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 5, 8)
    assert out.model == MODEL and out.object == "text_completion"


def test_chat_applies_the_template_in_the_gateway_and_sends_token_ids(
    client: openai.OpenAI, servers: Servers, fakes: list[FakeAsyncLLM]
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(4)
    prompt_ids = servers.tokenizer.apply_chat_template(messages, tokenize=True)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 4
    assert all_requests(fakes)[-1][1] == prompt_ids


def test_chat_without_max_tokens_may_use_all_the_room_left(
    client: openai.OpenAI, fakes: list[FakeAsyncLLM]
) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    prompt_len = len("<user>hi<assistant>")
    assert all_requests(fakes)[-1][2].max_tokens == MAX_MODEL_LEN - prompt_len


def test_completion_stream_with_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="a b", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_with_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected_text(3)
    assert chunks[-1].usage.completion_tokens == 3


def test_stream_without_include_usage_has_no_usage_chunk(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["choices"] and "usage" not in p for p in payloads)


def test_n2_returns_two_completions_counted_in_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="p", max_tokens=3, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert {c.index: c.text for c in out.choices} == {0: expected_text(3, 0), 1: expected_text(3, 1)}
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 1


def test_n2_streams_both_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, n=2, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: expected_text(3, 0), 1: expected_text(3, 1)}


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="p", max_tokens=10, stop=[" fake", " never"])
    assert out.choices[0].text == "Hello world, this is a"
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == " fake"


def test_batched_prompts_number_choices_per_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=["a", "b c"], max_tokens=2, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 8


def test_openai_and_vllm_sampling_fields_reach_the_engine(
    client: openai.OpenAI, fakes: list[FakeAsyncLLM]
) -> None:
    client.completions.create(
        model=MODEL,
        prompt="p",
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop="zz",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [3, 4],
            "priority": -2,
        },
    )
    _, _, params, priority = all_requests(fakes)[-1]
    assert params == SamplingParams(
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["zz"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[3, 4],
    )
    assert priority == -2


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="p", max_tokens=3, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["Hello", " world", ","]
    assert lp.token_logprobs == [-0.25, -0.25, -0.25]
    assert lp.top_logprobs[0] == {"Hello": -0.25}
    assert lp.text_offset == [0, 5, 11]


def test_chat_logprobs_with_top_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hello", " world"]
    assert [t.token for t in content[0].top_logprobs] == ["Hello", " world"]
    assert content[0].top_logprobs[1].logprob == -2.0


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_requests_are_spread_over_the_frontends(client: openai.OpenAI, fakes: list[FakeAsyncLLM]) -> None:
    before = [len(f.requests) for f in fakes]
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="p", max_tokens=1)
    assert all(len(f.requests) - b == 2 for f, b in zip(fakes, before))


# ------------------------------------------------------------------ §8 errors


def test_errors_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, 400, None, "JSON")


def test_errors_body_that_is_not_an_object_is_400(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json=["x"]), 400, None, "object")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "hot"),
        ("max_tokens", 1.5),
        ("n", True),
        ("stop", 3),
        ("stream", "yes"),
        ("seed", "7"),
        ("stop_token_ids", ["a"]),
        ("prompt", {"text": "x"}),
        ("logprobs", "1"),
    ],
)
def test_errors_wrong_field_type_is_400_naming_the_field(http: httpx.Client, field: str, value: Any) -> None:
    body = {"model": MODEL, "prompt": "x", field: value}
    assert_error(http.post("/v1/completions", json=body), 400, field, field)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 1.5),
        ("top_k", -5),
        ("min_p", 2.0),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", 99),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 50),
        ("max_tokens", 2**40),
    ],
)
def test_errors_bad_sampling_value_is_400_naming_the_field(
    http: httpx.Client, field: str, value: Any, fakes: list[FakeAsyncLLM]
) -> None:
    before = len(all_requests(fakes))
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, field: value})
    assert_error(r, 400, field, field)
    assert len(all_requests(fakes)) == before  # never reached the engine


def test_errors_bad_chat_messages_is_400(http: httpx.Client) -> None:
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages", "messages")
    bad_role = {"messages": [{"role": 3, "content": "x"}]}
    assert_error(http.post("/v1/chat/completions", json=bad_role), 400, "messages", "role")


def test_errors_completion_prompt_plus_max_tokens_over_max_model_len_is_400_with_both_numbers(
    http: httpx.Client,
) -> None:
    r = http.post("/v1/completions", json={"prompt": "a b c d", "max_tokens": 61})
    error = assert_error(r, 400, None, "4", "61", str(MAX_MODEL_LEN))
    assert error["code"] == "context_length_exceeded"


def test_errors_token_prompt_over_max_model_len_is_400_with_both_numbers(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10})
    assert_error(r, 400, None, "60", "10", str(MAX_MODEL_LEN))


def test_errors_chat_prompt_plus_max_tokens_over_max_model_len_is_400_with_both_numbers(
    http: httpx.Client,
) -> None:
    r = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 30}
    )
    prompt_len = len("<user>" + "x" * 40 + "<assistant>")
    error = assert_error(r, 400, "max_tokens", str(prompt_len), "30", str(MAX_MODEL_LEN))
    assert error["code"] == "context_length_exceeded"


def test_errors_unknown_model_is_404(http: httpx.Client, client: openai.OpenAI) -> None:
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model", "gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_errors_missing_or_wrong_api_key_is_401(servers: Servers) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with httpx.Client(base_url=servers.keyed_url, timeout=10) as http:
        assert_error(http.post("/v1/completions", json=body), 401)
        assert_error(http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(http.get("/v1/models"), 401)
        assert http.get("/health").status_code == 200  # probes stay open
    keyed = openai.OpenAI(base_url=servers.keyed_url + "/v1", api_key=API_KEY, max_retries=0)
    assert keyed.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text == expected_text(2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=servers.keyed_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_errors_body_over_the_size_limit_is_413(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x" * 100_000})
    assert_error(r, 413)


@pytest.mark.parametrize("reason", sorted(REJECTIONS))
def test_a5_rejection_is_503_with_retry_after_and_the_reason(
    http: httpx.Client, fakes: list[FakeAsyncLLM], reason: str
) -> None:
    for f in fakes:
        f.reject = REJECTIONS[reason]
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        for stream in (False, True):
            r = http.post(path, json={**body, "stream": stream})
            error = assert_error(r, 503, None, reason)
            assert error["code"] == reason
            assert int(r.headers["retry-after"]) >= 1
            assert r.headers["content-type"].startswith("application/json")  # not a 200 event stream


def test_a5_openai_client_sees_503_with_the_reason(client: openai.OpenAI, fakes: list[FakeAsyncLLM]) -> None:
    for f in fakes:
        f.reject = REJECTIONS["max_num_queued_reqs"]
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.body["code"] == "max_num_queued_reqs"


def test_a5_rejection_leaves_no_request_in_the_engine(http: httpx.Client, fakes: list[FakeAsyncLLM]) -> None:
    for f in fakes:
        f.reject = REJECTIONS["max_num_queued_tokens"]
    before_requests, before_aborts = len(all_requests(fakes)), sum(len(f.aborts) for f in fakes)
    http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert len(all_requests(fakes)) == before_requests
    assert sum(len(f.aborts) for f in fakes) == before_aborts


def test_a1_engine_dying_mid_request_is_503_engine_faulted(
    http: httpx.Client, fakes: list[FakeAsyncLLM]
) -> None:
    for f in fakes:
        f.fail, f.healthy = RuntimeError("engine 0 died: process exited"), False
    error = assert_error(http.post("/v1/completions", json={"prompt": "x"}), 503)
    assert error["code"] == "engine_faulted"


def test_a5_metrics_count_rejections_by_reason(
    servers: Servers, http: httpx.Client, fakes: list[FakeAsyncLLM]
) -> None:
    for f in fakes:
        f.reject = REJECTIONS["max_num_queued_reqs"]
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    text = http.get("/metrics").text
    expected = sum(f.rejections["max_num_queued_reqs"] for f in fakes)
    assert expected >= 3
    assert (
        metrics(text).value(
            "fastsched:admission_rejections_total", reason="max_num_queued_reqs", model_name=MODEL
        )
        == expected
    )


def metric_samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def metrics(text: str) -> Any:
    """The page as a ``Snapshot``: ``value(name, **labels)`` sums the series that have ``labels``."""
    from fastsched.tools.metrics_snapshot import parse_metrics

    return parse_metrics(text, 0.0)


def test_metrics_metrics_count_each_engine_once_under_design_names(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    text = http.get("/metrics").text
    m = metrics(text)
    # Both frontends report engines 0 and 1; engine 0's freshest report is frontend 0's.
    expected = {
        "num_requests_running": (1, 2),
        "num_requests_waiting": (1, 2),
        "kv_cache_usage_perc": (0.25, 0.75),
        "num_preemptions_total": (1, 0),
        "prompt_tokens_total": (10, 5),
        "generation_tokens_total": (20, 5),
        "prefix_cache_queries_total": (30, 6),
        "prefix_cache_hits_total": (15, 3),
    }
    for name, per_engine in expected.items():
        got = tuple(m.value(f"fastsched:{name}", engine=str(i), model_name=MODEL) for i in (0, 1))
        assert got == per_engine, name
    assert m.value("fastsched:num_requests_running") == 3 and m.mean("fastsched:kv_cache_usage_perc") == 0.5
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens", "engine_faulted"):
        assert m.value("fastsched:admission_rejections_total", reason=reason, model_name=MODEL) is not None
    for name in (
        "request_queue_time_seconds",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert f"# TYPE fastsched:{name} histogram" in text
        # The fakes do not say which engine served a request: the frontends' totals, under no engine.
        assert f'fastsched:{name}_bucket{{engine="",le="+Inf",model_name="{MODEL}"}}' in text
        assert m.histograms[f"fastsched:{name}"].upper_bounds[-1] == float("inf")
    assert m.histograms["fastsched:time_to_first_token_seconds"].count >= 1
    assert m.histograms["fastsched:inter_token_latency_seconds"].count >= 2
    assert m.histograms["fastsched:e2e_request_latency_seconds"].count >= 1


def test_metrics_frontends_without_an_engine_breakdown_are_summed() -> None:
    from fastsched.gateway.metrics import render

    def frontend(running: int, usage: float, ttft: list[int]) -> Any:
        return pb.GetStatsResponse(
            num_requests_running=running,
            kv_cache_usage_perc=usage,
            generation_tokens_total=running * 10,
            admission_rejections_total={"max_num_queued_reqs": 2},
            time_to_first_token_seconds=pb.Histogram(
                upper_bounds=[0.1, 1.0], bucket_counts=ttft, sum=1.5, count=sum(ttft)
            ),
        )

    page = render([frontend(2, 0.2, [1, 0, 1]), frontend(3, 0.4, [0, 2, 0])], "m", own_process=False).decode()
    samples = metric_samples(page)
    # One series under no engine (engine=""), which Prometheus reads as no engine label.
    assert samples['fastsched:num_requests_running{engine="",model_name="m"}'] == 5
    assert samples['fastsched:generation_tokens_total{engine="",model_name="m"}'] == 50
    assert samples['fastsched:kv_cache_usage_perc{engine="",model_name="m"}'] == pytest.approx(0.3)
    assert samples['fastsched:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"}'] == 4
    assert samples['fastsched:admission_rejections_total{model_name="m",reason="engine_faulted"}'] == 0
    assert [
        samples[f'fastsched:time_to_first_token_seconds_bucket{{engine="",le="{le}",model_name="m"}}']
        for le in ("0.1", "1.0", "+Inf")
    ] == [1, 3, 4]
    assert samples['fastsched:time_to_first_token_seconds_sum{engine="",model_name="m"}'] == 3.0
    assert "process_cpu_seconds_total{" not in page  # no process stats sent, none of its own asked for


def test_metrics_get_stats_maps_both_namings_and_keeps_the_engine_breakdown(stub: Any) -> None:
    engine_style, design_style = (
        stub(0).GetStats(pb.GetStatsRequest()),
        stub(1).GetStats(pb.GetStatsRequest()),
    )
    assert (
        engine_style.num_requests_running,
        engine_style.kv_cache_usage_perc,
        engine_style.prefix_cache_queries_total,
    ) == (3, 0.5, 36)
    assert (
        design_style.num_requests_running,
        design_style.kv_cache_usage_perc,
        design_style.prefix_cache_hits_total,
    ) == (11, 0.8, 3)
    assert [
        (e.engine_index, e.num_requests_running, e.prefix_cache_hits_total) for e in engine_style.engines
    ] == [(0, 1, 15), (1, 2, 3)]
    assert [(e.engine_index, e.num_requests_running) for e in design_style.engines] == [(0, 9), (1, 2)]
    bounds = engine_style.time_to_first_token_seconds.upper_bounds
    assert len(engine_style.time_to_first_token_seconds.bucket_counts) == len(bounds) + 1


def test_health_is_200_when_every_frontend_serves_and_503_otherwise(
    http: httpx.Client, fakes: list[FakeAsyncLLM]
) -> None:
    assert http.get("/health").status_code == 200
    fakes[1].healthy = False
    r = http.get("/health")
    assert r.status_code == 503
    assert sorted(r.json()["frontends"].values()) == ["not_serving", "serving"]


def test_errors_client_disconnect_mid_stream_aborts_in_the_engine(
    servers: Servers, fakes: list[FakeAsyncLLM]
) -> None:
    for f in fakes:
        f.token_delay = 0.05
    before = len(all_requests(fakes))
    with httpx.Client(base_url=servers.url, timeout=10) as http:
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 60, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    assert wait_for(lambda: len(all_requests(fakes)) == before + 1)
    request_id = all_requests(fakes)[-1][0]
    assert wait_for(lambda: any(request_id in f.aborts for f in fakes)), "the engine never saw the abort"


def test_errors_client_disconnect_while_waiting_for_a_full_response_aborts(
    servers: Servers, fakes: list[FakeAsyncLLM]
) -> None:
    for f in fakes:
        f.token_delay = 0.05
    before = len(all_requests(fakes))
    with httpx.Client(base_url=servers.url, timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 60})
    assert wait_for(lambda: len(all_requests(fakes)) == before + 1)
    request_id = all_requests(fakes)[-1][0]
    assert wait_for(lambda: any(request_id in f.aborts for f in fakes)), "the engine never saw the abort"


def test_unreachable_frontend_is_skipped(servers: Servers, fakes: list[FakeAsyncLLM]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    app = create_app([dead, servers.grpc_addrs[0]], MODEL, servers.tokenizer)

    async def go() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            codes = [
                (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code
                for _ in range(3)
            ]
            codes.append((await http.get("/health")).status_code)
        await app.state.gateway.pool.close()
        return codes

    assert servers.call(go()) == [200, 200, 200, 503]


# ------------------------------------------------------------------ gRPC status codes


@pytest.fixture
def stub(servers: Servers) -> Iterator[Any]:
    channels: list[Any] = []

    def make(index: int) -> Any:
        channel = grpc.insecure_channel(servers.grpc_addrs[index], options=[("grpc.enable_http_proxy", 0)])
        channels.append(channel)
        return pb_grpc.FrontendStub(channel)

    yield make
    for channel in channels:
        channel.close()


@pytest.mark.parametrize("index", [0, 1], ids=["frontend-0", "frontend-1"])
def test_a5_grpc_rejection_is_unavailable_with_the_reason(
    stub: Any, fakes: list[FakeAsyncLLM], index: int
) -> None:
    fakes[index].reject = REJECTIONS["max_num_queued_reqs"]
    with pytest.raises(grpc.RpcError) as info:
        list(stub(index).Generate(pb.GenerateRequest(text="x")))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "max_num_queued_reqs"
    assert ("rejection-reason", "max_num_queued_reqs") in info.value.trailing_metadata()


@pytest.mark.parametrize("index", [0, 1], ids=["frontend-0", "frontend-1"])
def test_errors_grpc_invalid_argument_names_the_field(stub: Any, index: int) -> None:
    request = pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(top_p=0.0))
    with pytest.raises(grpc.RpcError) as info:
        list(stub(index).Generate(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in info.value.details()
    assert ("invalid-param", "top_p") in info.value.trailing_metadata()
    too_long = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1] * 60), sampling_params=pb.SamplingParams(max_tokens=5)
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub(index).Generate(too_long))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "60" in info.value.details()


def test_errors_grpc_unknown_model_is_not_found(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub(0).Generate(pb.GenerateRequest(text="x", model="gpt-9")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_stream_carries_deltas_and_final_usage(stub: Any) -> None:
    request = pb.GenerateRequest(
        request_id="r1", text="a b", sampling_params=pb.SamplingParams(n=2, max_tokens=3)
    )
    responses = list(stub(0).Generate(request))
    assert all(r.request_id == "r1" for r in responses)
    tokens = {0: [], 1: []}
    for r in responses:
        for c in r.completions:
            tokens[c.index] += list(c.token_ids)
    assert tokens == {0: [100, 101, 102], 1: [101, 102, 103]}
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    assert (responses[-1].usage.prompt_tokens, responses[-1].usage.completion_tokens) == (2, 6)


def test_grpc_cancel_aborts_in_the_engine(stub: Any, fakes: list[FakeAsyncLLM]) -> None:
    fakes[0].token_delay = 0.05
    call = stub(0).Generate(
        pb.GenerateRequest(request_id="cancel-me", text="x", sampling_params=pb.SamplingParams(max_tokens=60))
    )
    next(call)
    call.cancel()
    assert wait_for(lambda: "cancel-me" in fakes[0].aborts)


def test_health_and_model_info_rpcs(stub: Any, fakes: list[FakeAsyncLLM]) -> None:
    assert stub(0).Health(pb.HealthRequest()).status == pb.SERVING
    fakes[0].healthy = False
    assert stub(0).Health(pb.HealthRequest()).status == pb.NOT_SERVING
    info = stub(0).ModelInfo(pb.ModelInfoRequest())
    assert (info.model, info.max_model_len, info.vocab_size) == (MODEL, MAX_MODEL_LEN, VOCAB_SIZE)


def test_stream_with_n_sends_one_choice_per_chunk(servers: Servers) -> None:
    """OpenAI and vLLM stream ``n > 1`` one choice per chunk; clients rely on it."""
    client = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt="a b", n=3, max_tokens=4, stream=True))
    assert chunks and all(len(c.choices) == 1 for c in chunks)
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    chat = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, stream=True
        )
    )
    assert chat and all(len(c.choices) == 1 for c in chat)
    assert {c.choices[0].index for c in chat} == {0, 1}


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "chat_template", "{{ messages }}"),
        ("/v1/completions", "guided_decoding_backend", "xgrammar"),
        ("/v1/completions", "frobnicate", 1),
    ],
)
def test_errors_a_field_the_server_does_not_implement_is_400_naming_it(
    http: httpx.Client, path: str, field: str, value: Any
) -> None:
    """No request field is silently ignored (docs/openai-fields.md)."""
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    reply = http.post(path, json={**base, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field and field in reply.json()["error"]["message"]


def test_the_user_field_is_accepted_and_ignored(http: httpx.Client) -> None:
    reply = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u-1"}
    )
    assert reply.status_code == 200, reply.text


def test_every_field_the_parsers_know_is_in_the_field_table() -> None:
    from pathlib import Path

    from fastsched.gateway.openai_protocol import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS

    table = (Path(__file__).resolve().parents[2] / "docs" / "openai-fields.md").read_text()
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name for cell in first_cells for name in cell.split("`")[1::2]}
    assert documented == set(CHAT_FIELDS) | set(COMPLETION_FIELDS) | set(IGNORED_FIELDS)
