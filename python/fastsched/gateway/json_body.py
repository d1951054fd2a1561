"""The checks of a request body the JSON parser does not make (``Gateway.read_json``): no NaN or
Infinity, a bounded nesting depth, and strings that are valid Unicode (no lone surrogates, which
could be neither sent to a frontend nor tokenized)."""

from __future__ import annotations

import re
from typing import Any

from fastsched.gateway.openai_protocol import bad_request

__all__ = ["SURROGATE_ESCAPE", "check_json", "reject_constant"]

# A raw JSON string escape of a UTF-16 surrogate: only then can a parsed string hold a lone one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json(body: Any, max_depth: int, check_strings: bool) -> None:
    """400 for a body nested deeper than ``max_depth`` or, when ``check_strings``, with a
    string (key or value) that holds a lone surrogate: it cannot be encoded as UTF-8, so
    neither sent to a frontend nor tokenized. Iterative: the depth is what is checked."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > max_depth:
            raise bad_request(
                f"The request body nests objects and arrays more than {max_depth} deep (at "
                f"{path or 'the top'}): this server's limit (--max-json-depth).",
                None,
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, _json_path(path, key)))
            elif check_strings and isinstance(item, str):
                _check_unicode(item, _json_path(path, key))
            if check_strings and isinstance(key, str):
                _check_unicode(key, _json_path(path, key))


def _json_path(path: str, key: str | int) -> str:
    return f"{path}.{key}".lstrip(".") if isinstance(key, str) else f"{path}[{key}]"


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        field = where.split(".")[0].split("[")[0] or None
        raise bad_request(
            f"{where} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is "
            "not valid Unicode text.",
            field,
        ) from None
