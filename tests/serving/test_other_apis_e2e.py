"""OpenAI's Responses and embeddings APIs and Anthropic's Messages API, with their official
Python clients, against the real stack on the tiny model: gateway → gRPC → frontend → engine.

Gateway 0 is open and keeps no responses; gateway 1 keeps up to ``STORE_SIZE`` and wants an
API key. The frontend's ``max_num_queued_reqs`` is ``MAX_QUEUED``, which the burst test
fills while the engine is paused, so that its 503s are certain (A2).
"""

from __future__ import annotations

import base64
import json
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
anthropic = pytest.importorskip("anthropic", reason="anthropic is not installed (requirements-test.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (requirements-serve.txt)")

from engine_stack import ipc_dir, launch, teardown  # noqa: E402
from loop_thread import LoopThread, free_port, wait_for  # noqa: E402

from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402

MODEL = "tiny"
API_KEY = "sk-other-apis"
STORE_SIZE = 2
MAX_QUEUED = 4
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@dataclass
class Stack:
    url: str  # open, no store
    keyed_url: str  # --api-key, --responses-store-size STORE_SIZE
    loop: LoopThread
    llm: Any


@pytest.fixture(scope="module")
def stack(
    engine_config: dict, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    engines = launch(engine_config, ipc_dir(tmp_path_factory, "ipc"), num_engines=1, num_frontends=1)
    loop = LoopThread()
    settings = FrontendSettings(ready_timeout=60, max_num_queued_reqs=MAX_QUEUED)
    llm = loop.call(
        AsyncLLM.start(engines.input_addrs, engines.output_addrs[0], frontend_index=0, settings=settings)
    )
    port = free_port()
    server = loop.call(serve_frontend(llm, "127.0.0.1", port))
    addrs = [f"127.0.0.1:{port}"]
    try:
        yield Stack(
            loop.start_gateway(create_app(addrs, MODEL, load_tokenizer(str(tiny_model_dir)))),
            loop.start_gateway(
                create_app(
                    addrs,
                    MODEL,
                    load_tokenizer(str(tiny_model_dir)),
                    api_key=API_KEY,
                    responses_store_size=STORE_SIZE,
                )
            ),
            loop,
            llm,
        )
    finally:
        loop.stop_stack([server], [llm])
        teardown(engines)


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)


# ------------------------------------------------------------------ /v1/responses


def test_responses_answer_text_and_usage_plain_and_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL, input="Say something.", instructions="Be brief.", max_output_tokens=6, temperature=0.0
    )
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.usage.output_tokens == 6 and response.usage.input_tokens > 5
    assert response.id.startswith("resp") and response.store is False  # this gateway keeps no responses

    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]  # vLLM's: completed, even if cut
    assert events[-1].response.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text  # greedy: the same text
    assert events[-1].response.usage.input_tokens == response.usage.input_tokens


def test_the_clients_stream_helpers_accumulate_the_events(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """The SDKs' own accumulators (``responses.stream``, ``messages.stream``) rebuild the answer
    from the events: ids, indexes and deltas must fit together."""
    kwargs = dict(
        model=MODEL,
        input="Weather?",
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        temperature=1.0,
    )
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and all(json.loads(c.arguments) is not None for c in calls)
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=5, temperature=0.0) as stream:
        text = stream.get_final_response().output_text
    assert (
        text
        == client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, temperature=0.0).output_text
    )
    with claude.messages.stream(
        model=MODEL,
        max_tokens=120,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        message = stream.get_final_message()
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses
    jsonschema.validate(uses[0].input, WEATHER)
    with claude.messages.stream(
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"temperature": 0.0},
    ) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed and stream.get_final_message().content[0].text == streamed


def test_responses_input_items_and_text_format_json_schema(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        max_output_tokens=80,
        temperature=1.0,
        extra_body={"seed": 3},
        input=[
            {"role": "developer", "content": "Answer in JSON."},
            {"role": "user", "content": [{"type": "input_text", "text": "The weather?"}]},
        ],
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)


RESPONSES_TOOLS = [{"type": "function", "name": "weather", "description": "Forecast", "parameters": WEATHER}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_forced_tool_call_is_a_parsed_function_call(client: openai.OpenAI, stream: bool) -> None:
    kwargs = dict(
        model=MODEL,
        input="Weather in Paris?",
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        temperature=1.0,
        extra_body={"seed": 5},
    )
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done and done[0].arguments == arguments and done[0].name == "weather"
        response = events[-1].response
        assert events[-1].type == "response.completed"
    else:
        response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and calls and all(c.name == "weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert call.call_id.startswith("call_")


def test_responses_store_previous_response_id_and_its_bound(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.keyed_url + "/v1", api_key=API_KEY, max_retries=0)
    first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=3, temperature=0.0)
    assert first.store is True
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=3, temperature=0.0
    )
    # The conversation so far is the prompt: the first turn, its answer, the new turn.
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.create(model=MODEL, input="Third.", max_output_tokens=1, store=False)  # not kept
    client.responses.create(model=MODEL, input="Fourth.", max_output_tokens=1)  # STORE_SIZE kept: first goes
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(follow.id).id == follow.id


def test_responses_without_a_store_say_so(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(
            model=MODEL, input="Hi", previous_response_id="resp-nope", max_output_tokens=2
        )
    assert error.value.body["param"] == "previous_response_id"
    assert "--responses-store-size" in error.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp-nope")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "schema": WEATHER, "colour": "red"}}}, "text"),
    ],
)
def test_responses_fields_that_cannot_be_honoured_are_400s_naming_them(
    stack: Stack, body: dict, param: str
) -> None:
    r = httpx.post(stack.url + "/v1/responses", json={"model": MODEL, "input": "Hi", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ /v1/messages


def test_messages_answer_and_count_tokens_plain_and_streamed(claude: anthropic.Anthropic) -> None:
    kwargs = dict(
        model=MODEL,
        max_tokens=6,
        system="Be brief.",
        extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": "Say something."}],
    )
    message = claude.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.stop_reason == "max_tokens"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 6
    count = claude.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Say something."}]
    )
    assert count.input_tokens == message.usage.input_tokens > 5

    events = list(claude.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == message.content[0].text
    assert events[0].message.usage.input_tokens == count.input_tokens
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6


def test_messages_stop_sequences_end_turn_with_the_one_matched(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Go on."}]
    greedy = {"temperature": 0.0}  # the client's own fields no longer include the sampling ones
    first = claude.messages.create(model=MODEL, max_tokens=12, messages=messages, extra_body=greedy)
    text = first.content[0].text
    stop = text[4:6]
    message = claude.messages.create(
        model=MODEL, max_tokens=12, messages=messages, extra_body=greedy, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and text.startswith(message.content[0].text)


ANTHROPIC_TOOLS = [{"name": "weather", "description": "Forecast", "input_schema": WEATHER}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_forced_tool_use_is_parsed_and_its_result_goes_back(
    claude: anthropic.Anthropic, stream: bool
) -> None:
    kwargs = dict(
        model=MODEL,
        max_tokens=120,
        extra_body={"temperature": 1.0, "top_k": 50, "top_p": 0.95},
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    if stream:
        events = list(claude.messages.create(**kwargs, stream=True))
        starts = [e for e in events if e.type == "content_block_start"]
        assert starts and starts[0].content_block.type == "tool_use"
        assert starts[0].content_block.name == "weather"
        partial = "".join(
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.index == starts[0].index
        )
        jsonschema.validate(json.loads(partial), WEATHER)
        assert events[-2].delta.stop_reason == "tool_use"
        call_id, arguments = starts[0].content_block.id, json.loads(partial)
    else:
        message = claude.messages.create(**kwargs)
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses and uses[0].name == "weather"
        jsonschema.validate(uses[0].input, WEATHER)
        call_id, arguments = uses[0].id, uses[0].input
    assert call_id.startswith("toolu_")
    followed = claude.messages.create(
        model=MODEL,
        max_tokens=3,
        tools=ANTHROPIC_TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call_id, "name": "weather", "input": arguments}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "Sunny."}],
            },
        ],
        tool_choice={"type": "none"},
    )
    assert followed.stop_reason == "max_tokens" and followed.content[0].type == "text"


def test_messages_output_config_format_is_a_json_schema(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=[{"role": "user", "content": "JSON?"}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), WEATHER)


def test_messages_errors_are_in_anthropics_shape(stack: Stack, claude: anthropic.Anthropic) -> None:
    r = httpx.post(
        stack.url + "/v1/messages",
        timeout=30,
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    with pytest.raises(anthropic.NotFoundError) as error:
        claude.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert error.value.body["error"]["type"] == "not_found_error"


def test_messages_take_the_key_as_x_api_key_or_bearer(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    claude = anthropic.Anthropic(base_url=stack.keyed_url, api_key=API_KEY, max_retries=0)  # sends x-api-key
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=messages).usage.output_tokens == 2
    bearer = anthropic.Anthropic(base_url=stack.keyed_url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=messages).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=stack.keyed_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=messages
        )
    assert error.value.body["error"]["type"] == "authentication_error"


# ------------------------------------------------------------------ burst: the same 503s as chat


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    want = "".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()) and want:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a2_a_burst_gets_the_same_503s_and_metrics_on_every_api(stack: Stack) -> None:
    """A2: with the engine paused, MAX_QUEUED requests fill max_num_queued_reqs; then chat,
    /v1/messages, /v1/responses and /v1/embeddings are each refused with the same 503 and
    Retry-After, counted per endpoint in /metrics, and admission counts the rejections."""
    held: list[int] = []

    def hold() -> None:
        r = httpx.post(
            stack.url + "/v1/messages",
            timeout=60,
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Wait."}]},
        )
        held.append(r.status_code)

    rejected_before = _metric(stack.url, "fastsched:admission_rejections_total", reason="max_num_queued_reqs")
    stack.loop.call(stack.llm.pause("all"))
    threads = [threading.Thread(target=hold) for _ in range(MAX_QUEUED)]
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: stack.llm.admission.num_requests == MAX_QUEUED, timeout=30)
        bodies = {
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            "/v1/messages": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            "/v1/responses": {"input": "x", "max_output_tokens": 2},
            "/v1/embeddings": {"input": "x"},
        }
        for path, body in bodies.items():
            r = httpx.post(stack.url + path, json={"model": MODEL, **body}, timeout=30)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", (path, r.text)
            error = r.json()["error"]
            assert (
                error["type"] == "overloaded_error"
                if path == "/v1/messages"
                else error["code"] == "max_num_queued_reqs"
            ), r.text
            assert "max_num_queued_reqs" in error["message"]
            assert _metric(stack.url, "fastsched:http_requests_total", endpoint=path, status="503") >= 1
    finally:
        stack.loop.call(stack.llm.resume())
        for t in threads:
            t.join(60)
    assert held == [200] * MAX_QUEUED
    rejected = _metric(stack.url, "fastsched:admission_rejections_total", reason="max_num_queued_reqs")
    assert rejected - rejected_before == 4
    answered = _metric(stack.url, "fastsched:http_requests_total", endpoint="/v1/messages", status="200")
    assert answered >= MAX_QUEUED


# ------------------------------------------------------------------ /v1/embeddings


def test_embeddings_are_unit_norm_one_length_and_the_same_for_the_same_input(client: openai.OpenAI) -> None:
    inputs = ["The quick brown fox.", "Jumps over", "The quick brown fox."]
    response = client.embeddings.create(model=MODEL, input=inputs)  # the client asks for base64
    vectors = [d.embedding for d in response.data]
    assert [d.index for d in response.data] == [0, 1, 2]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) == 64  # the tiny model's hidden size
    for v in vectors:
        assert sum(x * x for x in v) == pytest.approx(1.0, abs=1e-5)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-6)
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    assert response.usage.prompt_tokens == response.usage.total_tokens > 6
    alone = (
        client.embeddings.create(model=MODEL, input="Jumps over", encoding_format="float").data[0].embedding
    )
    assert alone == pytest.approx(vectors[1], abs=1e-5)  # batch-invariant
    ids = client.embeddings.create(model=MODEL, input=[[5, 6, 7]], encoding_format="float").data[0].embedding
    assert len(ids) == 64


def test_embeddings_encodings_and_dimensions(stack: Stack) -> None:
    body = {"model": MODEL, "input": "Hello there."}
    url = stack.url + "/v1/embeddings"
    floats = httpx.post(url, json={**body, "encoding_format": "float"}, timeout=30).json()
    b64 = httpx.post(url, json={**body, "encoding_format": "base64"}, timeout=30).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert list(decoded) == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)
    same = httpx.post(stack.url + "/v1/embeddings", json={**body, "dimensions": 64}, timeout=30)
    assert same.status_code == 200
    for dimensions in (32, 1000):
        r = httpx.post(stack.url + "/v1/embeddings", json={**body, "dimensions": dimensions}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
    r = httpx.post(stack.url + "/v1/embeddings", json={**body, "encoding_format": "int8"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
