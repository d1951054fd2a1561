"""OpenAI tool calls in the chat endpoint (``tools``, ``tool_choice``), and the
``tool_calls`` of the answer.

- ``tool_choice`` naming a function: the output is constrained to JSON that validates
  against that function's ``parameters``; it becomes that call's ``arguments``.
- ``"required"``: the output is constrained to a non-empty JSON array of
  ``{"name": ..., "parameters": ...}``, each validating against its function's schema (the
  shape vLLM forces too); each element becomes one call.
- ``"auto"`` (the default with tools): the model decides, and a parser of its format finds
  the calls in its text: the one ``--enable-auto-tool-choice --tool-call-parser NAME``
  chose (gateway/tool_parsers: hermes, llama3_json, mistral, pythonic), or without those
  flags Hermes when the chat template writes ``<tool_call>`` blocks; otherwise a 400.
- ``"none"``: tools are neither rendered nor called.

A call ends the answer with finish reason ``tool_calls``; a forced answer cut by
``max_tokens`` keeps its text as content and ``length``. Streaming works as vLLM's: text
that is not a call streams as content; a call's first delta carries its id and name, the
next ones the pieces of its ``arguments`` as the model writes them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastsched.gateway.request_fields import FieldError, shorten
from fastsched.gateway.structured import to_proto
from fastsched.gateway.tool_parsers import PARSERS, Extraction, NotACall, PartialCall, ToolParser, get_parser
from fastsched.gateway.tool_parsers.base import require_complete, scan_call_objects
from fastsched.gateway.tool_parsers.hermes import START as TOOL_CALL_START

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def supports_hermes_tools(chat_template: str | None) -> bool:
    """The template renders ``tools`` and writes calls as ``<tool_call>`` blocks."""
    return chat_template is not None and "tools" in chat_template and TOOL_CALL_START in chat_template


class _NamedParser:
    """``tool_choice`` naming a function: the whole output is that call's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def extract(self, text: str, final: bool) -> Extraction:
        if not final:
            body = text.strip()
            return Extraction("", [PartialCall(self.function, body, complete=False)] if body else [])
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError as e:
            raise NotACall("the arguments are not JSON") from e
        if not isinstance(arguments, dict):
            raise NotACall("the arguments are not an object")
        return Extraction("", [PartialCall(self.function, text.strip())])


class _RequiredParser:
    """``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}``."""

    name = "required"

    def extract(self, text: str, final: bool) -> Extraction:
        body = text.lstrip()
        if not body.startswith("["):
            if final:
                raise NotACall("not a JSON array")
            return Extraction("")
        calls, stop = scan_call_objects(body, 1, ",")
        if final and body[stop:].strip() != "]":
            raise NotACall("the call array is not closed")
        return Extraction("", require_complete(calls, final))


@dataclass(frozen=True)
class ToolCalling:
    mode: Literal["named", "required", "auto"]
    tools: list[dict[str, Any]]  # the request's tools, as given (for the chat template)
    name: str | None = None  # mode "named": the function called
    parser: ToolParser | None = None  # mode "auto": the model's format (default: hermes)

    def parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or _EMPTY_PARAMETERS

    def constraint(self) -> Any:
        """The ``pb.StructuredOutputs`` forcing the call(s); None for ``auto``."""
        if self.mode == "named":
            return to_proto("json", self.parameters(self.name), "tools")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"enum": [t["function"]["name"]]},
                        "parameters": self.parameters(t["function"]["name"]),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            return to_proto("json", {"type": "array", "minItems": 1, "items": {"anyOf": calls}}, "tools")
        return None

    def text_parser(self) -> ToolParser:
        """What reads this mode's calls out of the output text."""
        if self.mode == "named":
            return _NamedParser(self.name)
        if self.mode == "required":
            return _RequiredParser()
        return self.parser or get_parser("hermes")

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished output; no calls when it is not one (cut short)."""
        try:
            found = self.text_parser().extract(text, final=True)
        except NotACall:
            return text, []
        return found.content.strip() or None, [_call(c.name, c.arguments) for c in found.calls]


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class ToolCallStream:
    """One choice's output as it arrives: the content and tool-call deltas to send for each
    text delta, and at the end the answer's content and calls (for a response not streamed)."""

    calling: ToolCalling
    text: list[str] = field(default_factory=list)
    content_sent: int = 0  # characters of content already sent
    sent: list[tuple[str, str]] = field(default_factory=list)  # per call: (id, arguments sent)
    content: str | None = None  # once finished
    calls: list[dict[str, Any]] = field(default_factory=list)  # once finished, without "index"

    def __post_init__(self) -> None:
        self.parser = self.calling.text_parser()

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call deltas) to send for ``delta``; what may still be a call is held back."""
        self.text.append(delta)
        text = "".join(self.text)
        try:
            found = self.parser.extract(text, final=False)
        except NotACall:  # not a call after all: content, unless a call went out already
            found = Extraction("" if self.sent else text)
        return self._content(found.content), self._deltas(found.calls)

    def finish(self, finish_reason: str) -> tuple[str, list[dict[str, Any]], str]:
        """(content still to send, tool-call deltas still to send, finish reason) at the end."""
        text = "".join(self.text)
        found = None
        if finish_reason == "stop":
            try:
                found = self.parser.extract(text, final=True)
            except NotACall:
                pass
        if found is None:  # no calls: the text is the answer
            self.content = text
            return ("" if self.sent else self._content(text)), [], finish_reason
        deltas = self._deltas(found.calls)
        self.content = found.content.strip() or None
        self.calls = [_call(c.name, c.arguments, call_id) for c, (call_id, _) in zip(found.calls, self.sent)]
        return self._content(found.content), deltas, "tool_calls"

    def _content(self, content: str) -> str:
        out = content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(content))
        return out

    def _deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.sent):
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self.sent.append((call_id, call.arguments))
                deltas.append({"index": i, **_call(call.name, call.arguments, call_id)})
                continue
            call_id, sent = self.sent[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
                self.sent[i] = (call_id, call.arguments)
        return deltas


def tool_calling_from_body(
    body: dict, chat_template: str | None, tool_parser: str | None = None
) -> ToolCalling | None:
    """The request's tool calling, None without tools (or with ``tool_choice`` "none").
    ``tool_parser``: the server's ``--tool-call-parser`` (given with ``--enable-auto-tool-choice``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise FieldError(f"tool_choice {shorten(choice)} needs tools", "tool_choice")
        return None
    _check_tools(tools)
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if tool_parser is not None:
            return ToolCalling("auto", tools, parser=get_parser(tool_parser))
        if not supports_hermes_tools(chat_template):
            raise FieldError(
                'tool_choice "auto" (the default with tools) needs a parser of the model\'s tool calls: '
                "start the server with --enable-auto-tool-choice --tool-call-parser "
                f'{{{",".join(PARSERS)}}}, or send tool_choice "required" or a named function, whose '
                "calls the grammar forces",
                "tool_choice",
            )
        return ToolCalling("auto", tools)
    if choice == "required":
        return ToolCalling("required", tools)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
            f'{{"name": ...}}}}, got {shorten(choice)}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise FieldError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return ToolCalling("named", tools, name)


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise FieldError(f"tools must be a list, got {shorten(tools)}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise FieldError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                f"...}}}}, got {shorten(tool)}",
                "tools",
            )
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
