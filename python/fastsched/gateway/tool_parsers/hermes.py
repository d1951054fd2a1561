"""Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, after
optional text (the content). Text after the last block is dropped, as vLLM's parser does."""

from __future__ import annotations

from fastsched.gateway.tool_parsers.base import (
    Extraction,
    NotACall,
    PartialCall,
    require_complete,
    safe_content_end,
    scan_call_object,
)

START, END = "<tool_call>", "</tool_call>"


class HermesParser:
    name = "hermes"

    def extract(self, text: str, final: bool) -> Extraction:
        first = text.find(START)
        if first < 0:
            if final:
                raise NotACall("no <tool_call> block")
            return Extraction(text[: safe_content_end(text, START)])
        calls: list[PartialCall] = []
        pos = first
        while pos < len(text) and text.startswith(START, pos):
            pos += len(START)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                break
            if text[pos] != "{":
                raise NotACall(f"a {START} block that does not hold a JSON object")
            call, pos = scan_call_object(text, pos)
            if call is not None:
                calls.append(call)
            if call is None or not call.complete:
                break
            end = text.find(END, pos)
            if end < 0:
                if final:
                    raise NotACall(f"a {START} block without {END}")
                break
            pos = text.find(START, end)
            if pos < 0:
                break
        return Extraction(text[:first], require_complete(calls, final))
