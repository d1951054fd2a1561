"""An Anthropic Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``) as the
chat request it is served as.

``system`` (a string or text blocks) is the system message; each message's text blocks are
its content, an assistant's ``tool_use`` blocks its ``tool_calls`` (``input`` as JSON text)
and a user's ``tool_result`` blocks ``tool`` messages before its text. Tools are functions
whose ``parameters`` are their ``input_schema``; ``tool_choice`` ``auto`` / ``any`` /
``tool`` / ``none`` are chat's ``auto`` / ``required`` / a named function / ``none``.
``max_tokens`` is required, as Anthropic requires it; ``stop_sequences`` are ``stop``. Every
other field is refused with a 400 naming it (docs/other-apis.md lists them all).
"""

from __future__ import annotations

import json
from typing import Any

from fastsched.gateway.openai_protocol import bad_request
from fastsched.gateway.request_fields import shorten

_PASSED = ("temperature", "top_p", "top_k", "stream")
# Fields refused when set to anything but null, [] or {} (thinking: unless disabled).
_REFUSED = (
    "container",
    "mcp_servers",
    "context_management",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
)
# cache_control (top level or on a block) is accepted: the prefix cache keeps every prompt's blocks anyway.
FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "service_tier",
        "output_config",
        "cache_control",
        *_PASSED,
        *_REFUSED,
    }
)
COUNT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "cache_control",
        *_REFUSED,
    }
)
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(body: dict[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """The chat request of ``body``; ``count_only``: for ``count_tokens`` (no generation fields)."""
    known = COUNT_FIELDS if count_only else FIELDS
    for name in body:
        if name not in known:
            raise bad_request(
                f"The request field `{name}` is not supported by this server "
                "(see docs/other-apis.md for every field and its status).",
                name,
            )
    for name in _REFUSED:
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server", name)
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise bad_request('thinking is not supported by this server (only {"type": "disabled"})', "thinking")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad_request(
            f"service_tier {shorten(body['service_tier'])} is not supported; allowed: auto, standard_only",
            "service_tier",
        )
    _check_metadata(body.get("metadata"))
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if count_only:
        # Nothing is generated; chat refuses max_tokens 0, and 1 is the room chat needs anyway.
        chat["max_tokens"] = 1
    else:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad_request(
                f"max_tokens is required: a positive integer, got {shorten(max_tokens)}", "max_tokens"
            )
        chat["max_tokens"] = max_tokens
        chat.update({k: body[k] for k in _PASSED if body.get(k) is not None})
        if body.get("stop_sequences"):
            chat["stop"] = body["stop_sequences"]
    if (response_format := _output_format(body.get("output_config"))) is not None and not count_only:
        chat["response_format"] = response_format
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad_request(f"tools must be a list, got {shorten(tools)}", "tools")
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def _output_format(config: Any) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema the answer must follow) as chat's ``response_format``."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise bad_request(f"output_config may hold format and effort, got {shorten(config)}", "output_config")
    if config.get("effort") is not None:
        raise bad_request("output_config.effort is not supported by this server", "output_config")
    spec = config.get("format")
    if spec is None:
        return None
    if (
        not isinstance(spec, dict)
        or spec.get("type") != "json_schema"
        or not isinstance(spec.get("schema"), dict)
        or set(spec) - {"type", "schema"}
    ):
        raise bad_request(
            f'output_config.format must be {{"type": "json_schema", "schema": {{...}}}}, got {shorten(spec)}',
            "output_config",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


def _check_metadata(metadata: Any) -> None:
    """Anthropic's ``metadata`` holds only ``user_id``, an end-user id for abuse monitoring:
    accepted and unused, as OpenAI's ``user`` is (fastsched keeps no per-user state)."""
    if metadata is None:
        return
    if (
        not isinstance(metadata, dict)
        or set(metadata) - {"user_id"}
        or not isinstance(metadata.get("user_id"), str | None)
    ):
        raise bad_request(f"metadata may hold only user_id (a string), got {shorten(metadata)}", "metadata")


def _text_blocks(value: Any, where: str) -> str:
    """A string, or text blocks joined (``cache_control`` accepted: the prefix cache keeps every prefix)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or a list of text blocks, got {shorten(value)}", where)
    texts = []
    for block in value:
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
            or set(block) - {"type", "text", "cache_control"}
        ):
            raise bad_request(f"{where}: only text blocks are supported, got {shorten(block)}", where)
        texts.append(block["text"])
    return "".join(texts)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"messages must be a non-empty list, got {shorten(messages)}", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant") or set(message) - {"role", "content"}:
            raise bad_request(
                f'messages[{i}] must be {{"role": "user" or "assistant", "content": ...}}, got '
                f"{shorten(message)}",
                "messages",
            )
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"messages[{i}].content must be a string or a list of blocks", "messages")
        out += _turn(role, blocks, i)
    return out


def _turn(role: str, blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first (each its own ``tool`` message)."""
    texts, calls, results = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_blocks([block], "messages"))
        elif kind == "tool_use" and role == "assistant":
            if (
                not isinstance(block.get("id"), str)
                or not isinstance(block.get("name"), str)
                or not isinstance(block.get("input"), dict)
            ):
                raise bad_request(
                    f"messages[{i}]: a tool_use block needs an id, a name and an input object", "messages"
                )
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"messages[{i}]: a tool_result block needs a tool_use_id", "messages")
            if block.get("is_error"):
                raise bad_request(
                    f"messages[{i}]: tool_result is_error is not supported by this server (the "
                    "chat template has no place for it)",
                    "messages",
                )
            content = block.get("content", "")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _text_blocks(content, "messages"),
                }
            )
        else:
            allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
            raise bad_request(
                f"messages[{i}]: {role} content blocks may be {allowed}; got {shorten(block)}", "messages"
            )
    turn = results
    if texts or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        turn = [*turn, message]
    return turn


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "custom") != "custom"
        or not isinstance(tool.get("name"), str)
        or not isinstance(tool.get("input_schema"), dict)
    ):
        raise bad_request(
            f'tools[{i}] must be {{"name": ..., "input_schema": {{...}}}} (client tools only), '
            f"got {shorten(tool)}",
            "tools",
        )
    extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
    if extra:
        raise bad_request(f"tools[{i}] has unknown field(s) {sorted(extra)}", "tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or set(choice) - {"type", "name", "disable_parallel_tool_use"}
        or (kind not in _CHOICES and kind != "tool")
    ):
        raise bad_request(
            'tool_choice must be {"type": "auto" | "any" | "none"} or '
            f'{{"type": "tool", "name": ...}}, got {shorten(choice)}',
            "tool_choice",
        )
    if choice.get("disable_parallel_tool_use"):
        raise bad_request(
            "tool_choice.disable_parallel_tool_use is not supported by this server (a forced "
            "answer may hold several calls)",
            "tool_choice",
        )
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice of type tool needs a name", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return _CHOICES[kind]
