"""Request ids: the client's ``X-Request-Id`` when it sends a valid one (as vLLM honours it),
else ``<prefix>-<hex>``; the app's ``_RequestIdHeader`` sends it back on the response."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request

from fastsched.gateway.openai_protocol import bad_request

# An X-Request-Id the gateway accepts: printable ASCII without "/", so it fits a URL path.
_VALID_REQUEST_ID = re.compile(r"[!-.0-~]{1,128}")


def assign_request_id(request: Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` if it sends a valid one, else ``<prefix>-<hex>``; kept
    on the request so that the app's ``_RequestIdHeader`` returns it."""
    request_id = request.headers.get("x-request-id")
    if request_id is None:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
    elif not _VALID_REQUEST_ID.fullmatch(request_id):
        raise bad_request(
            "X-Request-Id must be 1 to 128 printable ASCII characters other than '/' and spaces, "
            f"got {request_id[:80]!r}",
            None,
        )
    request.state.request_id = request_id
    return request_id
