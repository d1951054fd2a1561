"""The other APIs' requests as the chat requests they are served as, and their field tables
(docs/other-apis.md): no server, just the translations, the store's bound and the docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")

from fastsched.gateway import anthropic_input, embeddings, responses_input
from fastsched.gateway.openai_protocol import IGNORED_FIELDS, ApiError
from fastsched.gateway.response_store import ResponseStore, StoredResponse

DOC = Path(__file__).resolve().parents[2] / "docs" / "other-apis.md"


def _documented(section: str) -> set[str]:
    """The field names in the first cells of the table under the heading that starts with ``section``."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## `POST {section}")
    end = text.find("\n## ", start + 1)
    rows = [
        line.split("|")[1]
        for line in text[start : end if end > 0 else None].splitlines()
        if line.startswith("| `")
    ]
    return {name for cell in rows for name in cell.split("`")[1::2]}


@pytest.mark.parametrize(
    ("section", "fields"),
    [
        ("/v1/responses", responses_input.FIELDS),
        ("/v1/messages", anthropic_input.FIELDS),
        ("/v1/embeddings", embeddings.FIELDS),
    ],
)
def test_every_field_the_parsers_know_is_in_the_field_table(section: str, fields: frozenset[str]) -> None:
    ignored = set(IGNORED_FIELDS) if section != "/v1/messages" else set()  # chat's check_fields: `user`
    assert _documented(section) == set(fields) | ignored


def test_count_tokens_fields_are_the_documented_ones() -> None:
    text = DOC.read_text(encoding="utf-8")
    sentence = text[text.index("`count_tokens` takes") : text.index('answers `{"input_tokens"}`')]
    named = set(re.findall(r"`(\w+)`", sentence)) - {"count_tokens"}
    refused = {
        "container",
        "mcp_servers",
        "context_management",
        "diagnostics",
        "inference_geo",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
    assert named | refused == anthropic_input.COUNT_FIELDS


def test_responses_input_items_become_chat_messages() -> None:
    translated = responses_input.to_chat(
        {
            "model": "m",
            "instructions": "Be brief.",
            "max_output_tokens": 9,
            "temperature": 0.5,
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "done"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        },
        None,
    )
    chat = translated.chat
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    assert translated.conversation == chat["messages"][1:]  # what a follow-up extends: no instructions
    assert chat["max_completion_tokens"] == 9 and chat["temperature"] == 0.5 and translated.store is True
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }


def test_a_previous_conversation_comes_before_the_new_input() -> None:
    previous = [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}]
    chat = responses_input.to_chat({"input": "Three", "instructions": "New rules."}, previous).chat
    assert [m["content"] for m in chat["messages"]] == ["New rules.", "One", "Two", "Three"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "instructions": 3}, "instructions"),
    ],
)
def test_responses_requests_that_cannot_be_served_name_their_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as error:
        responses_input.to_chat(body, None)
    assert error.value.status == 400 and error.value.param == param


def test_anthropic_tool_use_and_results_become_chat_tool_calls_and_messages() -> None:
    chat = anthropic_input.to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Sys", "cache_control": {"type": "x"}}],
            "stop_sequences": ["END"],
            "top_k": 4,
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "Sunny"}],
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [{"name": "w", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat["stop"] == ["END"] and chat["max_tokens"] == 5 and chat["top_k"] == 4
    assert chat["tool_choice"] == "required"
    assert chat["tools"][0]["function"] == {
        "name": "w",
        "parameters": {"type": "object"},
        "description": "Weather",
    }


def test_count_tokens_renders_what_a_message_renders() -> None:
    body = {
        "model": "m",
        "system": "S",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
    }
    counted = anthropic_input.to_chat(body, count_only=True)
    sent = anthropic_input.to_chat({**body, "max_tokens": 7, "temperature": 0.0})
    assert counted["messages"] == sent["messages"] and counted["tools"] == sent["tools"]
    with pytest.raises(ApiError) as error:
        anthropic_input.to_chat({**body, "max_tokens": 7}, count_only=True)  # not a count_tokens field
    assert error.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"max_tokens": 4, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, "tool_choice"),
        ({"max_tokens": 4, "metadata": {"user_id": "u", "other": 1}}, "metadata"),
        ({"max_tokens": 4, "speed": "fast"}, "speed"),
        ({"max_tokens": 4, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_anthropic_requests_that_cannot_be_served_name_their_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as error:
        anthropic_input.to_chat({"messages": [{"role": "user", "content": "x"}], **body})
    assert error.value.status == 400 and error.value.param == param


def test_the_response_store_keeps_at_most_its_size_oldest_forgotten_first() -> None:
    store = ResponseStore(2)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse({"id": name}, []))
    assert len(store) == 2 and store.get("a") is None and store.get("c").body == {"id": "c"}
    off = ResponseStore()
    assert not off.enabled
    with pytest.raises(ValueError):
        ResponseStore(-1)
