"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``, vLLM's names):
each reads one model family's way of writing calls into its answer."""

from __future__ import annotations

from fastsched.gateway.tool_parsers.base import Extraction, NotACall, PartialCall, ToolParser
from fastsched.gateway.tool_parsers.hermes import HermesParser
from fastsched.gateway.tool_parsers.llama3_json import Llama3JsonParser
from fastsched.gateway.tool_parsers.mistral import MistralParser
from fastsched.gateway.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get_parser(name: str) -> ToolParser:
    """The parser called ``name``; a ValueError listing the known names otherwise."""
    if name not in PARSERS:
        raise ValueError(f"tool call parser {name!r} is not one of {', '.join(PARSERS)}")
    return PARSERS[name]()


__all__ = ["PARSERS", "Extraction", "NotACall", "PartialCall", "ToolParser", "get_parser"]
