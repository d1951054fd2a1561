"""A request's output constraint (vLLM's ``structured_outputs``), and the grammar it compiles to.

Exactly one kind per request: ``json`` (a JSON schema, as an object or its text),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
``grammar`` (llguidance's Lark dialect; also takes the same ``%llguidance`` and GBNF-free
forms vLLM's guidance backend does). ``grammar_text()`` is what the engine builds its
matchers from; :func:`check_compiles` rejects, with the grammar engine's own message, what
would fail there, so a bad schema is a 400 at the door and never an engine error.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Room for the model to lay JSON out as it likes (False: no whitespace between tokens,
    # vLLM's guidance default is the same).
    whitespace_flexible: bool = field(default=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if isinstance(self.json, dict):  # canonical text: one cache entry per schema
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))

    @classmethod
    def from_value(
        cls, value: StructuredOutputsParams | dict[str, Any] | None
    ) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        unknown = set(value) - {*KINDS, "whitespace_flexible"}
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {sorted(unknown)}; known: {list(KINDS)}"
            )
        return cls(**value)

    def grammar_text(self) -> str:
        """The llguidance grammar for this constraint (cached by its text)."""
        return _grammar_text(
            self.json,
            self.json_object,
            self.regex,
            tuple(self.choice or ()),
            self.grammar,
            self.whitespace_flexible,
        )


@functools.lru_cache(maxsize=256)
def _grammar_text(
    schema: str | None,
    json_object: bool,
    regex: str | None,
    choice: tuple[str, ...],
    grammar: str | None,
    whitespace_flexible: bool,
) -> str:
    import llguidance

    options = {"whitespace_flexible": whitespace_flexible}
    if schema is not None or json_object:
        text = schema if schema is not None else '{"type": "object"}'
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(parsed, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        return llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=options)
    if regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(regex)
    if choice:
        alternatives = " | ".join(json.dumps(c) for c in choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def check_compiles(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` with the grammar engine's message if ``params`` cannot compile."""
    try:
        text = params.grammar_text()
    except ValueError:
        raise
    except Exception as e:  # llguidance raises its own errors for bad schemas and regexes
        raise ValueError(f"structured_outputs cannot be compiled: {e}") from None
    error = _compile_error(text)
    if error:
        raise ValueError(f"structured_outputs cannot be compiled: {error}")


@functools.lru_cache(maxsize=256)
def _compile_error(grammar: str) -> str:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if is_error else ""
