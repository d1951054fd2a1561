"""What both ends of the gateway ↔ frontend gRPC hop agree on beyond the ``.proto``:
the metadata keys that carry an error's details and the API key, and the message size limit."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

REJECTION_REASON_KEY = "rejection-reason"  # an UNAVAILABLE's admission reason (A5)
INVALID_PARAM_KEY = "invalid-param"  # the request field an INVALID_ARGUMENT is about
AUTHORIZATION_KEY = "authorization"  # "Bearer <key>" on every call when the server has an API key
# A long prompt sent as token ids (the gateway's chat path) outgrows gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# An error's OpenAI ``code`` (context_length_exceeded, model_not_found, lora_in_use, not_paused, ...),
# set by the frontend where it raises the error, so that the gateway never reads an error's text.
ERROR_CODE_KEY = "error-code"


def error_metadata(
    *, param: str | None = None, reason: str | None = None, code: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a failed call: the request field it is about (``invalid-param``),
    an admission rejection's reason (``rejection-reason``), the error's code (``error-code``)."""
    pairs = ((INVALID_PARAM_KEY, param), (REJECTION_REASON_KEY, reason), (ERROR_CODE_KEY, code))
    return tuple((key, value) for key, value in pairs if value)


def metadata_authorization(metadata: Iterable[tuple[str, Any]]) -> str | None:
    """The ``authorization`` value of gRPC metadata as an HTTP server reads the header: the
    first entry, whatever follows (both gRPC checks, the API key's and the admin key's, read
    it here, so one call cannot pass the one with a second entry the other ignores)."""
    for name, value in metadata:
        if name == AUTHORIZATION_KEY:
            return value if isinstance(value, str) else None
    return None


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header (or gRPC metadata) value is ``Bearer <key>``, compared in
    constant time: the one key check of the gateway's routes, its WebSocket and the frontends' gRPC."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
