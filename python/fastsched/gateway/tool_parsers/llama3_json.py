"""Llama 3.1/3.2 JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``
(several separated by ``;``), optionally after ``<|python_tag|>``. An answer that starts
otherwise is content, as in vLLM's ``llama3_json`` parser."""

from __future__ import annotations

from fastsched.gateway.tool_parsers.base import Extraction, NotACall, require_complete, scan_call_objects

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"

    def extract(self, text: str, final: bool) -> Extraction:
        body = text.lstrip()
        if not final and (not body or PYTHON_TAG.startswith(body)):
            return Extraction("")  # undecided: may still become a call
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        elif not body.startswith("{"):
            if final:
                raise NotACall("the answer does not start with a JSON object")
            return Extraction(text)
        calls, stop = scan_call_objects(body, 0, ";")
        if final and stop != len(body):
            raise NotACall("text after the calls")
        return Extraction("", require_complete(calls, final))
