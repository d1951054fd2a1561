"""Mistral: content, then ``[TOOL_CALLS]`` followed by a JSON array of
``{"name": ..., "arguments": {...}}`` (tokenizer v3), or by ``NAME[ARGS]{...}`` per call,
each after its own ``[TOOL_CALLS]`` (tokenizer v11 and later)."""

from __future__ import annotations

import json
import re

from fastsched.gateway.tool_parsers.base import (
    Extraction,
    NotACall,
    PartialCall,
    json_value_end,
    require_complete,
    safe_content_end,
    scan_call_objects,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"\s*([A-Za-z_][\w.-]*)" + re.escape(ARGS) + r"\s*(?=\{)")


class MistralParser:
    name = "mistral"

    def extract(self, text: str, final: bool) -> Extraction:
        first = text.find(TOOL_CALLS)
        if first < 0:
            if final:
                raise NotACall(f"no {TOOL_CALLS}")
            return Extraction(text[: safe_content_end(text, TOOL_CALLS)])
        content = text[:first]
        rest = text[first + len(TOOL_CALLS) :]
        if rest.lstrip().startswith("["):
            calls, stop = scan_call_objects(rest, rest.index("[") + 1, ",")
            if final and rest[stop:].strip() != "]":
                raise NotACall("the call array is not closed")
        else:
            calls = self._named_calls(text, first, final)
        return Extraction(content, require_complete(calls, final))

    @staticmethod
    def _named_calls(text: str, pos: int, final: bool) -> list[PartialCall]:
        """``[TOOL_CALLS]name[ARGS]{...}`` repeated."""
        calls: list[PartialCall] = []
        while text.startswith(TOOL_CALLS, pos):
            head = _NAMED.match(text, pos + len(TOOL_CALLS))
            if head is None:
                if final:
                    raise NotACall(f"{TOOL_CALLS} not followed by NAME{ARGS}{{...}}")
                break
            end = json_value_end(text, head.end())
            if end is None:
                calls.append(PartialCall(head.group(1), text[head.end() :].rstrip(), complete=False))
                break
            raw = text[head.end() : end]
            try:
                json.loads(raw)
            except json.JSONDecodeError as e:
                raise NotACall(f"arguments of {head.group(1)!r} are not JSON") from e
            calls.append(PartialCall(head.group(1), raw))
            pos = end
            while pos < len(text) and text[pos].isspace():
                pos += 1
        return calls
