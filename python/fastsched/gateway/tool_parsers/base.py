"""What every tool-call parser shares: the shape of what it finds in a model's text, and
the scanning of JSON call objects that most formats are made of.

A parser reads the text generated so far and answers with an :class:`Extraction`: the
content that is certainly not a call, and the calls found, the last possibly incomplete.
It is asked again after every delta (streaming) and once more with ``final`` at the end;
the stream sends the difference. So that a stream can send a call's ``arguments`` in
pieces, an incomplete call's ``arguments`` is always a prefix of the complete one: the
JSON text exactly as the model wrote it, never a re-serialization.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

_DECODER = json.JSONDecoder()
# A call object whose name comes first, up to the opening brace of its arguments: enough
# to stream the name and then the arguments as they are written.
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral write the first, Llama 3.x the second


class NotACall(ValueError):
    """The text is not (or no longer can be) the calls of this format."""


@dataclass(frozen=True)
class PartialCall:
    name: str
    arguments: str  # JSON text of the arguments object; while incomplete, a prefix of it
    complete: bool = True


@dataclass(frozen=True)
class Extraction:
    content: str  # text that is not a call (final) or certainly will not be one (while streaming)
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(Protocol):
    """One model family's tool-call format (``--tool-call-parser NAME``)."""

    name: str

    def extract(self, text: str, final: bool) -> Extraction:
        """Content and calls in ``text``; with ``final``, every call complete or NotACall."""
        ...


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at ``text[start]``, None while it is
    still open (strings and escapes are followed, so braces inside strings do not count)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_from_object(obj: object, raw_arguments: str | None = None) -> PartialCall:
    """A complete call from a decoded ``{"name": ..., "arguments" | "parameters": {...}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise NotACall(f"not a call object: {obj!r:.80}")
    arguments = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    if not isinstance(arguments, dict):
        raise NotACall(f"arguments of {obj['name']!r} are not an object")
    return PartialCall(obj["name"], raw_arguments or json.dumps(arguments, ensure_ascii=False))


def scan_call_object(text: str, pos: int) -> tuple[PartialCall | None, int]:
    """The call object opening at ``text[pos]`` and the index past it. While it is
    incomplete: the call so far (name and arguments prefix, once the name is known, else
    None) and ``len(text)``. NotACall when the object is complete but not a call."""
    head = _CALL_HEAD.match(text, pos)
    raw = None
    if head is not None:
        args_end = json_value_end(text, head.end())
        raw = text[head.end() : args_end] if args_end is not None else None
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        if head is None:
            return None, len(text)
        name = json.loads(f'"{head.group(1)}"')
        return PartialCall(name, raw or text[head.end() :].rstrip(), complete=False), len(text)
    return call_from_object(obj, raw), end


def scan_call_objects(text: str, pos: int, separators: str) -> tuple[list[PartialCall], int]:
    """Consecutive call objects from ``pos``, separated by whitespace or ``separators``; the
    calls and where the scan stopped (at text that is not a call object, or the end)."""
    calls: list[PartialCall] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text) or text[pos] != "{":
            return calls, pos
        call, pos = scan_call_object(text, pos)
        if call is not None:
            calls.append(call)
        if call is None or not call.complete:
            return calls, pos


def safe_content_end(text: str, marker: str) -> int:
    """Where content may end while streaming: before a tail of ``text`` that may begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def require_complete(calls: list[PartialCall], final: bool) -> list[PartialCall]:
    """With ``final``, calls must be complete and at least one: else the text is no call."""
    if final and (not calls or not all(c.complete for c in calls)):
        raise NotACall("an unfinished tool call")
    return calls
