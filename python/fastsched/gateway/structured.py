"""A request's output constraint in any of the shapes clients send, as one protobuf
``StructuredOutputs``: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` object and its older ``guided_*`` fields.

Only types are checked here; whether a schema, a regex or a grammar compiles is decided by
the frontend (``SamplingParams``), whose ``ValueError`` comes back as a 400 naming it. A
request may carry one constraint only: two would have to agree, which nothing checks.
"""

from __future__ import annotations

import json
from typing import Any

from fastsched.gateway.request_fields import FieldError, shorten
from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_FIELDS})
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs_from_body(body: dict) -> Any:
    """The request's ``pb.StructuredOutputs``, or None when it asks for free text."""
    found: list[tuple[str, str, Any]] = []  # (field, kind, value)
    response_format = body.get("response_format")
    if response_format is not None:
        if (constraint := _response_format(response_format)) is not None:
            found.append(("response_format", *constraint))
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise FieldError(
                f"structured_outputs must be an object, got {shorten(structured)}", "structured_outputs"
            )
        unknown = set(structured) - set(_KINDS)
        if unknown:
            raise FieldError(
                f"structured_outputs has unknown field(s) {sorted(unknown)}; known: {list(_KINDS)}",
                "structured_outputs",
            )
        found += [
            ("structured_outputs", kind, value)
            for kind, value in structured.items()
            if value is not None and value is not False
        ]
    found += [(name, kind, body[name]) for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(
            f"{name}.{kind}" if name == "structured_outputs" else name for name, kind, _ in found
        )
        raise FieldError(f"only one output constraint may be given, got {names}", found[1][0])
    name, kind, value = found[0]
    return to_proto(kind, value, name)


def to_proto(kind: str, value: Any, name: str) -> Any:
    """``value`` of constraint ``kind`` (a ``StructuredOutputsParams`` field) as protobuf;
    ``name``: the request field it came from, for errors."""
    if kind == "json":
        if isinstance(value, dict | bool):
            value = json.dumps(value)
        elif not isinstance(value, str):
            raise FieldError(
                f"{name} must be a JSON schema (an object or its text), got {shorten(value)}", name
            )
        return pb.StructuredOutputs(json=value)
    if kind == "json_object":
        if value is not True:
            raise FieldError(f"{name}.json_object must be true, got {shorten(value)}", name)
        return pb.StructuredOutputs(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise FieldError(f"{name} must be a list of strings, got {shorten(value)}", name)
        return pb.StructuredOutputs(choice=pb.Choices(values=value))
    if not isinstance(value, str):
        raise FieldError(f"{name} must be a string, got {shorten(value)}", name)
    return pb.StructuredOutputs(**{kind: value})


def _response_format(value: Any) -> tuple[str, Any] | None:
    """OpenAI's ``response_format`` as (kind, value); ``strict`` is accepted either way: the
    schema is always enforced, token by token."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError(
            f"response_format must be an object with a type, got {shorten(value)}", "response_format"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise FieldError(
                "response_format.json_schema must be an object with a schema (an object), got "
                f"{shorten(spec)}",
                "response_format",
            )
        if not isinstance(spec.get("name"), str | None) or not isinstance(spec.get("strict"), bool | None):
            raise FieldError(
                "response_format.json_schema.name must be a string and strict a boolean", "response_format"
            )
        return "json", spec["schema"]
    raise FieldError(
        f"response_format.type must be text, json_object or json_schema, got {shorten(kind)}",
        "response_format",
    )
