"""An OpenAI Responses request (``POST /v1/responses``) as the chat request it is served as.

``input`` (a string, or a list of messages and items) and ``instructions`` become chat
``messages``: ``instructions`` the system message (not carried over from a previous
response, as vLLM and OpenAI do), ``developer`` messages system ones, ``function_call``
items an assistant message's ``tool_calls`` and ``function_call_output`` items ``tool``
messages. ``max_output_tokens`` is ``max_completion_tokens``; ``text.format`` is
``response_format``; Responses' flat function tools and ``tool_choice`` take chat's nested
shape. Every field is honoured, refused with a 400 naming it, or unknown and a 400 naming it
(docs/other-apis.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastsched.gateway.openai_protocol import ApiError, bad_request, check_fields
from fastsched.gateway.request_fields import shorten

# Sampling and scheduling fields passed to the chat request as they are (chat checks them).
PASSED = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "priority",
        "cache_salt",
        "stream",
    }
)
# Fields with only the value that changes nothing accepted (a 400 for any other).
_ONLY = {
    "parallel_tool_calls": (True,),  # a forced "required" answer may hold several calls
    "truncation": ("disabled",),  # an input longer than the context is a 400, never cut
    "background": (False,),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
}
# Fields refused when set to anything but null, [] or {}.
_REFUSED = (
    "include",
    "reasoning",
    "max_tool_calls",
    "prompt",
    "prompt_cache_key",
    "conversation",
    "stream_options",
)
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "text",
        "tools",
        "tool_choice",
        "store",
        "previous_response_id",
        "metadata",
        *PASSED,
        *_ONLY,
        *_REFUSED,
    }
)
# OpenAI's limits on metadata: what a client can make the server echo (and keep, when stored).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    """What a Responses request asks beyond its chat body."""

    chat: dict[str, Any]  # the chat request it is served as
    conversation: list[dict[str, Any]]  # its chat messages but the instructions: what a follow-up extends
    store: bool  # the client asked for the response to be kept (OpenAI's default: true)
    metadata: dict[str, str] | None


def to_chat(body: dict[str, Any], previous: list[dict[str, Any]] | None) -> ResponsesRequest:
    """The chat request of ``body``; ``previous``: the stored conversation ``previous_response_id`` names."""
    check_fields(body, FIELDS)
    for name, allowed in _ONLY.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise bad_request(
                f"{name} {shorten(body[name])} is not supported by this server; allowed: "
                f"{', '.join(map(repr, allowed))}",
                name,
            )
    for name in _REFUSED:
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server", name)
    conversation = [*(previous or []), *_input_messages(body.get("input"))]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request(f"instructions must be a string, got {shorten(instructions)}", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict[str, Any] = {"messages": messages, **{k: body[k] for k in PASSED if body.get(k) is not None}}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if (response_format := _response_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    if body.get("tools"):
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad_request(f"store must be a boolean, got {shorten(store)}", "store")
    return ResponsesRequest(chat, conversation, store, _metadata(body.get("metadata")))


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list, got {shorten(value)}", name)
    return value


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request(
            f"input must be a string or a non-empty list of items, got {shorten(value)}", "input"
        )
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            function = {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}
            call = {"id": _string(item, "call_id", i), "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # one assistant turn, several calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", i),
                    "content": _string(item, "output", i),
                }
            )
        else:
            raise bad_request(
                f"input[{i}] must be a message, a function_call or a function_call_output "
                f"item, got {shorten(item)}",
                "input",
            )
    return messages


def _string(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{name} must be a string, got {shorten(value)}", "input")
    return value


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise bad_request(
            f"input[{i}].role must be one of {sorted(_ROLES)}, got {shorten(item.get('role'))}", "input"
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"input[{i}].content: only text parts ({', '.join(_TEXT_PARTS)}) are "
                    f"supported, got {shorten(part)}",
                    "input",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(
            f"input[{i}].content must be a string or a list of text parts, got {shorten(content)}", "input"
        )
    return {"role": role, "content": content}


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise bad_request(f"text must be an object with (only) a format, got {shorten(text)}", "text")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise bad_request(f"text.format must be an object, got {shorten(spec)}", "text")
    if spec.get("type") != "json_schema":
        return spec  # text or json_object: chat's shape; chat judges anything else
    extra = set(spec) - {"type", "name", "schema", "strict", "description"}
    if extra:
        raise bad_request(f"text.format has unknown field(s) {sorted(extra)}", "text")
    return {
        "type": "json_schema",
        "json_schema": {k: spec[k] for k in ("name", "schema", "strict") if k in spec},
    }


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(
            f'tools[{i}] must be {{"type": "function", "name": ..., "parameters": ...}} '
            f"(function tools only), got {shorten(tool)}",
            "tools",
        )
    extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if extra:
        raise bad_request(f"tools[{i}] has unknown field(s) {sorted(extra)}", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # none, auto, required: chat's names
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
        f"got {shorten(choice)}",
        "tool_choice",
    )


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items())
    ):
        raise bad_request(
            f"metadata must be at most {MAX_METADATA_PAIRS} string pairs, keys of at most "
            f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}",
            "metadata",
        )
    return value


def not_found(response_id: str, param: str, stored: bool) -> ApiError:
    why = "" if stored else " (this server keeps no responses: --responses-store-size is 0)"
    return ApiError(
        404, f"Response with id '{response_id}' not found{why}.", param=param, code="response_not_found"
    )
