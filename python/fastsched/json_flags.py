"""Flags whose value is a JSON object (``--speculative-config``, ``--kv-transfer-config``)."""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str, name: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; ``ValueError`` naming ``name`` and the value otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value
