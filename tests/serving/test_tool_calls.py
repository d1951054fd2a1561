"""Tool calls below the gateway's HTTP layer: what ``tool_choice`` forces (the grammar's
schema), and how finished and streamed outputs become OpenAI ``tool_calls``: each
``--tool-call-parser`` on answers in its format (tool_call_outputs/, as the model families
write them: the random test model never writes one), whole and streamed as vLLM streams
them (id and name first, then pieces of the arguments)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastsched.gateway.openai_protocol import parse_chat
from fastsched.gateway.request_fields import FieldError
from fastsched.gateway.tool_calls import (
    ToolCalling,
    ToolCallStream,
    supports_hermes_tools,
    tool_calling_from_body,
)
from fastsched.gateway.tool_parsers import PARSERS, get_parser
from fastsched.model_loader import load_tokenizer

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "noop"}},
]
HERMES = "{% for t in tools %}{{ t | tojson }}{% endfor %} <tool_call>"


def test_a_named_function_forces_its_parameters_schema() -> None:
    calling = tool_calling_from_body(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, None
    )
    assert json.loads(calling.constraint().json) == PARAMS
    content, [call] = calling.parse('{"city": "Oslo"}')
    assert content is None and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def test_required_forces_an_array_of_calls_of_the_given_functions() -> None:
    calling = tool_calling_from_body({"tools": TOOLS, "tool_choice": "required"}, None)
    schema = json.loads(calling.constraint().json)
    assert schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["weather"], ["noop"]]
    _, calls = calling.parse(
        '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {}}]'
    )
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Paris"}),
        ("noop", {}),
    ]


def test_a_forced_call_cut_short_stays_content() -> None:
    calling = ToolCalling("named", TOOLS, "weather")
    assert calling.parse('{"city": "Os') == ('{"city": "Os', [])
    stream = ToolCallStream(calling)
    content, [head] = stream.feed('{"city": ')
    assert content == "" and head["function"] == {"name": "weather", "arguments": '{"city":'}
    assert stream.feed('"Os') == ("", [{"index": 0, "function": {"arguments": ' "Os'}}])
    assert stream.finish("length") == ("", [], "length")  # streamed calls are not taken back
    assert stream.content == '{"city": "Os' and stream.calls == []  # the response not streamed: content


def test_a_named_call_streams_its_arguments_as_they_are_written() -> None:
    stream = ToolCallStream(ToolCalling("named", TOOLS, "weather"))
    deltas = [d for piece in ['{"ci', 'ty": "Os', 'lo"}'] for d in stream.feed(piece)[1]]
    rest, last, finish_reason = stream.finish("stop")
    assert (rest, last, finish_reason) == ("", [], "tool_calls")
    assert (
        "".join(d["function"]["arguments"] for d in deltas)
        == '{"city": "Oslo"}'
        == stream.calls[0]["function"]["arguments"]
    )
    assert len(deltas) == 3 and deltas[0]["id"] == stream.calls[0]["id"]


def test_auto_needs_a_parser_or_a_template_with_tool_call_blocks() -> None:
    assert supports_hermes_tools(HERMES) and not supports_hermes_tools("{{ messages }}")
    for template in (None, "{{ messages }}"):
        with pytest.raises(FieldError, match="--enable-auto-tool-choice --tool-call-parser"):
            tool_calling_from_body({"tools": TOOLS}, template)
        calling = tool_calling_from_body({"tools": TOOLS, "tool_choice": "auto"}, template, "mistral")
        assert calling.mode == "auto" and calling.parser.name == "mistral"
    assert tool_calling_from_body({"tools": TOOLS}, HERMES).mode == "auto"
    assert tool_calling_from_body({"tools": TOOLS, "tool_choice": "none"}, None) is None


def test_hermes_blocks_become_calls_and_the_text_before_them_content() -> None:
    calling = ToolCalling("auto", TOOLS)
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, [call] = calling.parse(text)
    assert content == "Let me look." and call["function"] == {
        "name": "weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert calling.parse("no call here") == ("no call here", [])
    assert calling.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_a_stream_holds_back_what_may_be_a_tool_call_tag() -> None:
    stream = ToolCallStream(ToolCalling("auto", TOOLS))
    sent = [
        stream.feed(d)
        for d in ["Hi <", "tool", "_call>", '{"name": "noop", "arguments": {}}', "</tool_call>"]
    ]
    assert [content for content, _ in sent] == ["Hi ", "", "", "", ""]
    [head] = sent[3][1]
    assert head["function"] == {"name": "noop", "arguments": "{}"} and not sent[4][1]
    assert stream.finish("stop") == ("", [], "tool_calls")
    assert stream.content == "Hi" and [c["id"] for c in stream.calls] == [head["id"]]
    plain = ToolCallStream(ToolCalling("auto", TOOLS))
    assert plain.feed("a <b") == ("a <b", []) and plain.feed(" <tool") == (" ", [])
    assert plain.finish("stop") == ("<tool", [], "stop")


OUTPUTS = Path(__file__).parent / "tool_call_outputs"
EXPECTED_CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("get_weather", {"city": 'Tokyo, "JP" {big}', "unit": "celsius"}),
]
RECORDED = [
    ("hermes", "hermes.txt", "I'll check the weather in both cities for you."),
    ("llama3_json", "llama3_json.txt", None),
    ("mistral", "mistral.txt", None),
    ("mistral", "mistral_v11.txt", None),
    ("pythonic", "pythonic.txt", None),
]


def stream_deltas(
    calling: ToolCalling, pieces: list[str]
) -> tuple[str, list[dict[str, Any]], str, ToolCallStream]:
    """Feed ``pieces`` as a stream would: (content sent, tool-call deltas, finish reason, the stream)."""
    stream = ToolCallStream(calling)
    content, deltas = "", []
    for piece in pieces:
        text, more = stream.feed(piece)
        content, deltas = content + text, deltas + more
    rest, more, finish_reason = stream.finish("stop")
    return content + rest, deltas + more, finish_reason, stream


def joined(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, the stream's deltas put together as a client does."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function"
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("parser", "file", "content"), RECORDED)
def test_each_parser_reads_a_recorded_answer_whole(parser: str, file: str, content: str | None) -> None:
    calling = ToolCalling("auto", TOOLS, parser=get_parser(parser))
    found_content, calls = calling.parse((OUTPUTS / file).read_text())
    assert found_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED_CALLS


@pytest.mark.parametrize("piece", [1, 3, 7])
@pytest.mark.parametrize(("parser", "file", "content"), RECORDED)
def test_each_parser_streams_a_recorded_answer_as_vllm_does(
    parser: str, file: str, content: str | None, piece: int
) -> None:
    text = (OUTPUTS / file).read_text()
    calling = ToolCalling("auto", TOOLS, parser=get_parser(parser))
    sent, deltas, finish_reason, stream = stream_deltas(
        calling, [text[i : i + piece] for i in range(0, len(text), piece)]
    )
    assert finish_reason == "tool_calls" and sent.strip() == (content or "")
    calls = joined(deltas)
    assert [(name, json.loads(arguments)) for name, arguments in calls] == EXPECTED_CALLS
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls]
    if parser != "pythonic":  # JSON arguments go out in pieces as written, not whole at the end
        assert sum(1 for d in deltas if d["index"] == 0) > 2


@pytest.mark.parametrize("parser", list(PARSERS))
@pytest.mark.parametrize("answer", ["The weather in Paris is mild.", "[1] is a citation, {x} a set.", ""])
def test_an_answer_without_calls_is_content_for_every_parser(parser: str, answer: str) -> None:
    sent, deltas, finish_reason, stream = stream_deltas(
        ToolCalling("auto", TOOLS, parser=get_parser(parser)), list(answer)
    )
    assert (sent, deltas, finish_reason, stream.calls) == (answer, [], "stop", [])


def test_an_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_parser("qwen9")


@pytest.mark.parametrize(
    "body",
    [
        {"tools": "weather"},
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": ["weather"]}},
        {"tool_choice": "required"},
    ],
)
def test_malformed_tools_and_tool_choices_are_field_errors(body: dict) -> None:
    with pytest.raises(FieldError):
        tool_calling_from_body(body, HERMES)


def test_auto_keeps_special_tokens_in_the_text_for_the_parser(tiny_model_dir) -> None:
    """<tool_call> is a special token in Qwen's vocabulary: skipped, the parser would never see it."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = HERMES
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert parse_chat(body, tokenizer, 256, "r").sampling.skip_special_tokens is False
    kept = parse_chat({**body, "skip_special_tokens": True}, tokenizer, 256, "r")
    assert kept.sampling.skip_special_tokens is True
