"""OpenAI tool calls in the chat endpoint (``tools``, ``tool_choice``), and the
``tool_calls`` of the answer.

- ``tool_choice`` naming a function: the output is constrained to JSON that validates
  against that function's ``parameters``; it becomes that call's ``arguments``.
- ``"required"``: the output is constrained to a non-empty JSON array of
  ``{"name": ..., "parameters": ...}``, each validating against its function's schema (the
  shape vLLM forces too); each element becomes one call.
- ``"auto"`` (the default with tools): the model decides. Only the model's own format can
  say it called a tool, so this needs a chat template that renders ``tools`` and writes
  calls as Hermes/Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks;
  any other template is a 400, as is any other ``tool_choice``.
- ``"none"``: tools are neither rendered nor called.

A forced answer ends with finish reason ``tool_calls``; one cut by ``max_tokens`` keeps its
text as content and ``length``. Streaming: forced calls arrive whole with the last chunk
(their text is not a call until it is complete); with ``auto``, text before the first
``<tool_call>`` streams as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastsched.gateway.request_fields import FieldError, shorten
from fastsched.gateway.structured import to_proto

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def supports_hermes_tools(chat_template: str | None) -> bool:
    """The template renders ``tools`` and writes calls as ``<tool_call>`` blocks."""
    return chat_template is not None and "tools" in chat_template and TOOL_CALL_START in chat_template


@dataclass(frozen=True)
class ToolCalling:
    mode: Literal["named", "required", "auto"]
    tools: list[dict[str, Any]]  # the request's tools, as given (for the chat template)
    name: str | None = None  # mode "named": the function called

    def parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or _EMPTY_PARAMETERS

    def constraint(self) -> Any:
        """The ``pb.StructuredOutputs`` forcing the call(s); None for ``auto``."""
        if self.mode == "named":
            return to_proto("json", self.parameters(self.name), "tools")
        if self.mode == "required":
            calls = [{"type": "object",
                      "properties": {"name": {"enum": [t["function"]["name"]]},
                                     "parameters": self.parameters(t["function"]["name"])},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            return to_proto("json", {"type": "array", "minItems": 1, "items": {"anyOf": calls}}, "tools")
        return None

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished output; no calls when it is not one (cut short)."""
        try:
            if self.mode == "named":
                json.loads(text)
                return None, [_call(self.name, text)]
            if self.mode == "required":
                return None, [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                              for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []
        return _parse_hermes(text)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            call = json.loads(block)
            calls.append(_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # not a call after all: all of it is content
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_START)].strip()
    return content or None, calls


@dataclass
class ToolCallStream:
    """One streamed choice: what of its text may go out as content now, and its calls at the end."""

    calling: ToolCalling
    text: list[str] = field(default_factory=list)
    sent: int = 0  # characters already sent as content (auto)

    def feed(self, delta: str) -> str:
        """The content to send for ``delta`` (held back while it may be, or is, a call)."""
        self.text.append(delta)
        if self.calling.mode != "auto":
            return ""
        text = "".join(self.text)
        start = text.find(TOOL_CALL_START)
        end = start if start >= 0 else _safe_end(text)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out

    def finish(self, finish_reason: str) -> tuple[str, list[dict[str, Any]], str]:
        """(content still to send, tool calls, finish reason) once the choice has finished."""
        text = "".join(self.text)
        calls = self.calling.parse(text)[1] if finish_reason == "stop" else []
        if not calls:
            return text[self.sent :], [], finish_reason
        head = text[: text.find(TOOL_CALL_START)] if self.calling.mode == "auto" else ""
        return head[self.sent :], [{"index": i, **c} for i, c in enumerate(calls)], "tool_calls"


def _safe_end(text: str) -> int:
    """Where content may safely end: before any tail of ``text`` that could begin ``<tool_call>``."""
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def tool_calling_from_body(body: dict, chat_template: str | None) -> ToolCalling | None:
    """The request's tool calling, None without tools (or with ``tool_choice`` "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise FieldError(f"tool_choice {shorten(choice)} needs tools", "tool_choice")
        return None
    _check_tools(tools)
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if not supports_hermes_tools(chat_template):
            raise FieldError('tool_choice "auto" needs a chat template that renders tools and writes '
                             f'{TOOL_CALL_START} blocks, which this model\'s does not; use tool_choice "required" or '
                             'a named function, whose calls the grammar forces', "tool_choice")
        return ToolCalling("auto", tools)
    if choice == "required":
        return ToolCalling("required", tools)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         f'{{"name": ...}}}}, got {shorten(choice)}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise FieldError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return ToolCalling("named", tools, name)


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise FieldError(f"tools must be a list, got {shorten(tools)}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(function.get("name"),
                                                                                               str):
            raise FieldError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                             f"...}}}}, got {shorten(tool)}", "tools")
        if not isinstance(function.get("parameters"), dict | None):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a chat template: the ``arguments`` of earlier tool calls as objects, as
    templates iterate over them (OpenAI sends them as JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_arguments_as_object(c) for c in calls]}
        out.append(message)
    return out


def _arguments_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
