"""Issue 12's parts of the OpenAI API through the whole serving path: the official ``openai``
client → gateway → gRPC frontend → engine process on the tiny model.

- Structured outputs: the tiny random model emits garbage, so only the grammar makes its
  output valid: every shape a client can ask in (``response_format``, ``structured_outputs``,
  ``guided_*``) must come back satisfying it, greedy and sampled, streaming or not, n = 3.
- Forced tool calls validate against their function's parameters, streaming or not.
- Chat template controls: ``continue_final_message`` with ``echo``, both in a stream.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (requirements-serve.txt)")

from engine_stack import ipc_dir, launch, teardown  # noqa: E402
from loop_thread import LoopThread, free_port  # noqa: E402

from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"admin": {"type": "boolean"}},
            "required": ["admin"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "size", "tags", "owner"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "box", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a box as JSON."}]


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Stack:
    url: str  # the gateway with the tiny model's own chat template (no tools)
    hermes_url: str  # one whose template renders tools and <tool_call> blocks
    parser_url: str  # the tiny model's template, with --tool-call-parser llama3_json


@pytest.fixture(scope="module")
def stack(
    engine_config: dict, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    engines = launch(engine_config, ipc_dir(tmp_path_factory, "ipc"), num_engines=1, num_frontends=1)
    loop = LoopThread()
    llm = loop.call(
        AsyncLLM.start(
            engines.input_addrs,
            engines.output_addrs[0],
            frontend_index=0,
            settings=FrontendSettings(ready_timeout=60),
        )
    )
    port = free_port()
    server = loop.call(serve_frontend(llm, "127.0.0.1", port))
    hermes = load_tokenizer(str(tiny_model_dir))
    hermes.chat_template = HERMES_TEMPLATE
    try:
        yield Stack(
            loop.start_gateway(create_app([f"127.0.0.1:{port}"], MODEL, load_tokenizer(str(tiny_model_dir)))),
            loop.start_gateway(create_app([f"127.0.0.1:{port}"], MODEL, hermes)),
            loop.start_gateway(
                create_app(
                    [f"127.0.0.1:{port}"],
                    MODEL,
                    load_tokenizer(str(tiny_model_dir)),
                    tool_parser="llama3_json",
                )
            ),
        )
    finally:
        loop.stop_stack([server], [llm])
        teardown(engines)


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def chat_texts(client: openai.OpenAI, stream: bool, **kwargs: Any) -> list[tuple[str, str]]:
    """(content, finish_reason) of every choice, the stream's deltas joined per index."""
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        return [(c.message.content, c.finish_reason) for c in response.choices]
    texts: dict[int, list[str]] = defaultdict(list)
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [("".join(texts[i]), reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, n=3, seed=11)], ids=["greedy", "sampled-n3"]
)
def test_json_schema_response_format_validates(client: openai.OpenAI, stream: bool, sampling: dict) -> None:
    results = chat_texts(client, stream, response_format=JSON_SCHEMA_FORMAT, max_tokens=120, **sampling)
    assert len(results) == sampling.get("n", 1)
    for text, finish_reason in results:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_response_format_gives_an_object_or_a_prefix_of_one(client: openai.OpenAI) -> None:
    [(text, finish_reason)] = chat_texts(
        client, False, response_format={"type": "json_object"}, max_tokens=150, temperature=0.0
    )
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a valid prefix only
        assert finish_reason == "length" and text.startswith("{")


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_completions_regex_choice_and_grammar_match(client: openai.OpenAI, field: str) -> None:
    constraints = [
        ("regex", r"[0-9]{3}-[a-c]{2}"),
        ("choice", ["yes", "no", "maybe"]),
        ("grammar", 'start: "(" D ("+" D)* ")"\nD: /[0-9]/'),
        ("json", SCHEMA),
    ]
    for kind, value in constraints:
        body = (
            {"structured_outputs": {kind: value}}
            if field == "structured_outputs"
            else {f"guided_{kind}": value}
        )
        response = client.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=120, temperature=1.0, n=3, seed=5, extra_body=body
        )
        for choice in response.choices:
            assert choice.finish_reason == "stop", (kind, choice.text)
            if kind == "regex":
                assert re.fullmatch(value, choice.text)
            elif kind == "choice":
                assert choice.text in value
            elif kind == "grammar":
                assert re.fullmatch(r"\([0-9](\+[0-9])*\)", choice.text)
            else:
                jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": JSON_SCHEMA_FORMAT
                | {"json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
            },
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
        ({"guided_choice": "yes"}, "guided_choice"),
    ],
    ids=[
        "bad-schema",
        "bad-regex",
        "two-constraints",
        "bad-format-type",
        "unknown-kind",
        "choice-not-a-list",
    ],
)
def test_a_constraint_that_cannot_work_is_a_400_naming_it(
    client: openai.OpenAI, body: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert error.value.body["param"] == param, error.value.body


# --- forced tool calls ---------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 5}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}


def tool_call_results(
    client: openai.OpenAI, stream: bool, **kwargs: Any
) -> list[tuple[list[tuple[str, str]], str]]:
    """([(name, arguments)], finish_reason) per choice, a stream's tool-call deltas joined."""
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **kwargs)
        return [
            ([(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], c.finish_reason)
            for c in response.choices
        ]
    calls: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(lambda: ["", ""]))
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True, **kwargs
    ):
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                call = calls[c.index][t.index]
                call[0] += t.function.name or ""
                call[1] += t.function.arguments or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [([tuple(calls[i][k]) for k in sorted(calls[i])], reasons[i]) for i in sorted(reasons)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_validate_against_the_functions_parameters(
    client: openai.OpenAI, stream: bool, tool_choice: Any
) -> None:
    results = tool_call_results(
        client, stream, tool_choice=tool_choice, max_tokens=150, temperature=1.0, n=3, seed=2
    )
    assert len(results) == 3
    for calls, finish_reason in results:
        assert finish_reason == "tool_calls" and calls
        for name, arguments in calls:
            assert name in SCHEMAS if tool_choice == "required" else name == "weather"
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),  # the tiny model's template has no tools
        ({}, "tool_choice"),  # auto is the default with tools
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(client: openai.OpenAI, body: dict, param: str) -> None:
    body = {"tools": TOOLS, **body}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert error.value.body["param"] == param, error.value.body


def test_tool_choice_auto_with_a_hermes_template_answers_content_when_no_call_is_made(stack: Stack) -> None:
    """The random model writes no <tool_call> block: its text is content (the parser on real
    calls is tested in tests/serving/test_tool_calls.py)."""
    client = openai.OpenAI(base_url=stack.hermes_url + "/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0.0
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"
    assert response.usage.prompt_tokens > 30  # the tools were rendered into the prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_auto_is_served_with_a_tool_call_parser(stack: Stack, stream: bool) -> None:
    """``--enable-auto-tool-choice --tool-call-parser NAME`` (here the gateway's tool_parser):
    auto is served whatever the template; the random model's text is no call, so it is content."""
    client = openai.OpenAI(base_url=stack.parser_url + "/v1", api_key="unused", max_retries=0)
    results = tool_call_results(client, stream, tool_choice="auto", max_tokens=6, temperature=0.0)
    assert results == [([], "length")]
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=6, temperature=0.0
    )
    assert response.choices[0].message.content and response.choices[0].message.tool_calls is None


# --- chat template controls ------------------------------------------------------------------

OPEN = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_echo_continues_the_open_final_message(client: openai.OpenAI, stream: bool) -> None:
    body = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=OPEN, max_tokens=4, temperature=0.0, stream=True, extra_body=body
            )
        )
        assert chunks[0].choices[0].delta.content.startswith("One, two,")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        response = client.chat.completions.create(
            model=MODEL, messages=OPEN, max_tokens=4, temperature=0.0, extra_body=body
        )
        text = response.choices[0].message.content
    plain = client.chat.completions.create(
        model=MODEL, messages=OPEN, max_tokens=4, temperature=0.0, extra_body={**body, "echo": False}
    )
    assert text == "One, two," + plain.choices[0].message.content


def test_continue_final_message_and_add_generation_prompt_together_are_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=OPEN, max_tokens=4, extra_body={"continue_final_message": True}
        )
    assert error.value.body["param"] == "continue_final_message"
