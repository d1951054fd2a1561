"""JSON Lines input, shared by the request-trace and step-trace readers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any


def read_objects(path: str | os.PathLike[str]) -> Iterator[tuple[dict[str, Any], str]]:
    """Each non-blank line of ``path`` as a JSON object, with ``file:line`` for the caller's
    error messages; a line that is not a JSON object is a ``ValueError`` naming it."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON: {e}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield record, where
