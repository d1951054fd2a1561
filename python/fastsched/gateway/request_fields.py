"""The error of a request field with the wrong shape, raised by the gateway's request parts
that know nothing of HTTP (output constraints, tools, chat template controls) and answered
by the endpoints as a 400 naming the field."""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """``param``: the request field at fault (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def shorten(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
