"""Tool calls below the gateway's HTTP layer: what ``tool_choice`` forces (the grammar's
schema), and how finished and streamed outputs become OpenAI ``tool_calls``, Hermes
``<tool_call>`` blocks included (the random test model never writes one)."""

from __future__ import annotations

import json

import pytest

from fastsched.gateway.openai_protocol import parse_chat
from fastsched.gateway.request_fields import FieldError
from fastsched.gateway.tool_calls import ToolCalling, ToolCallStream, supports_hermes_tools, tool_calling_from_body
from fastsched.model_loader import load_tokenizer

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "noop"}}]
HERMES = "{% for t in tools %}{{ t | tojson }}{% endfor %} <tool_call>"


def test_a_named_function_forces_its_parameters_schema() -> None:
    calling = tool_calling_from_body({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                       "function": {"name": "weather"}}}, None)
    assert json.loads(calling.constraint().json) == PARAMS
    content, [call] = calling.parse('{"city": "Oslo"}')
    assert content is None and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def test_required_forces_an_array_of_calls_of_the_given_functions() -> None:
    calling = tool_calling_from_body({"tools": TOOLS, "tool_choice": "required"}, None)
    schema = json.loads(calling.constraint().json)
    assert schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["weather"], ["noop"]]
    _, calls = calling.parse('[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Paris"}), ("noop", {})]


def test_a_forced_call_cut_short_stays_content() -> None:
    calling = ToolCalling("named", TOOLS, "weather")
    assert calling.parse('{"city": "Os') == ('{"city": "Os', [])
    stream = ToolCallStream(calling)
    assert stream.feed('{"city": ') == "" and stream.feed('"Os') == ""
    assert stream.finish("length") == ('{"city": "Os', [], "length")


def test_auto_needs_a_template_with_tools_and_tool_call_blocks() -> None:
    assert supports_hermes_tools(HERMES) and not supports_hermes_tools("{{ messages }}")
    for template in (None, "{{ messages }}"):
        with pytest.raises(FieldError, match="auto"):
            tool_calling_from_body({"tools": TOOLS}, template)
    assert tool_calling_from_body({"tools": TOOLS}, HERMES).mode == "auto"
    assert tool_calling_from_body({"tools": TOOLS, "tool_choice": "none"}, None) is None


def test_hermes_blocks_become_calls_and_the_text_before_them_content() -> None:
    calling = ToolCalling("auto", TOOLS)
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, [call] = calling.parse(text)
    assert content == "Let me look." and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert calling.parse("no call here") == ("no call here", [])
    assert calling.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_a_stream_holds_back_what_may_be_a_tool_call_tag() -> None:
    stream = ToolCallStream(ToolCalling("auto", TOOLS))
    sent = [stream.feed(d) for d in ["Hi <", "tool", "_call>", '{"name": "noop", "arguments": {}}', "</tool_call>"]]
    assert sent == ["Hi ", "", "", "", ""]
    rest, calls, finish_reason = stream.finish("stop")
    assert rest == "" and finish_reason == "tool_calls"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "noop")]
    plain = ToolCallStream(ToolCalling("auto", TOOLS))
    assert plain.feed("a <b") == "a <b" and plain.feed(" <tool") == " " and plain.finish("stop") == ("<tool", [], "stop")


@pytest.mark.parametrize("body", [
    {"tools": "weather"}, {"tools": [{"type": "function", "function": {"parameters": {}}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": ["weather"]}},
    {"tool_choice": "required"},
])
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
