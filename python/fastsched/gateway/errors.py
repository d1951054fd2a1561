"""The one mapping from a frontend's gRPC status to the gateway's HTTP error (docs/design.md §8),
used by every route, the ``/v1/sessions`` WebSocket and the admin routes alike.

It reads the call's status code and the structured details the frontend attaches as trailing
metadata (``fastsched.rpc``: ``invalid-param``, ``rejection-reason``, ``error-code``), never the
error's text: the text is shown to the client, the metadata decides the status and the fields.
"""

from __future__ import annotations

import grpc

from fastsched.frontend.admission import ENGINE_FAULTED
from fastsched.gateway.openai_protocol import ApiError
from fastsched.rpc import ERROR_CODE_KEY, INVALID_PARAM_KEY, REJECTION_REASON_KEY

__all__ = [
    "FRONTEND_UNAVAILABLE",
    "MAX_CONCURRENT_STREAMS",
    "api_error_from_rpc",
    "rpc_metadata",
    "unavailable",
]

FRONTEND_UNAVAILABLE = "frontend_unavailable"  # the 503 reason when no frontend could be reached
MAX_CONCURRENT_STREAMS = "max_concurrent_streams"  # the 503 reason when every frontend is at its limit
UNAVAILABLE_TYPE = "service_unavailable_error"

# gRPC status -> (HTTP status, OpenAI error type) of the statuses a frontend answers on purpose.
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
}


def rpc_metadata(error: grpc.aio.AioRpcError) -> dict[str, str]:
    """A failed call's trailing metadata (its string values)."""
    return {key: value for key, value in (error.trailing_metadata() or ()) if isinstance(value, str)}


def unavailable(reason: str, retry_after_s: int) -> ApiError:
    """503 with ``Retry-After``: the request may succeed later (an admission rejection, A5)."""
    if reason == ENGINE_FAULTED:
        message = "The engine is not healthy (engine_faulted); the request was not admitted."
    elif reason == FRONTEND_UNAVAILABLE:
        message = "No frontend could be reached (frontend_unavailable)."
    elif reason == MAX_CONCURRENT_STREAMS:
        message = "Every frontend is serving as many calls as it may (max_concurrent_streams)."
    else:
        message = f"The server is overloaded: the request was rejected at admission ({reason})."
    return ApiError(
        503,
        f"{message} Retry after {retry_after_s} s.",
        type=UNAVAILABLE_TYPE,
        code=reason,
        headers={"Retry-After": str(retry_after_s)},
    )


def api_error_from_rpc(error: BaseException, retry_after_s: int) -> ApiError:
    """``error``: what a call to a frontend ended with. UNAVAILABLE (with or without an admission
    reason), RESOURCE_EXHAUSTED, a deadline and any non-gRPC failure (a frontend gone) are 503s;
    the statuses of ``_STATUS`` keep the frontend's message, ``param`` and ``code``; anything
    else is a 500."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return unavailable(FRONTEND_UNAVAILABLE, retry_after_s)
    code, details, metadata = error.code(), error.details() or "", rpc_metadata(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(metadata.get(REJECTION_REASON_KEY, FRONTEND_UNAVAILABLE), retry_after_s)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return unavailable(MAX_CONCURRENT_STREAMS, retry_after_s)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(
            503,
            f"A frontend did not answer in time: {details} Retry after {retry_after_s} s.",
            type=UNAVAILABLE_TYPE,
            code="frontend_timeout",
            headers={"Retry-After": str(retry_after_s)},
        )
    if code in _STATUS:
        status, kind = _STATUS[code]
        if status == 404 and metadata.get(ERROR_CODE_KEY) == "model_not_found":
            kind = "invalid_request_error"  # as OpenAI answers an unknown model
        return ApiError(
            status,
            details,
            type=kind,
            param=metadata.get(INVALID_PARAM_KEY) or None,
            code=metadata.get(ERROR_CODE_KEY) or None,
        )
    return ApiError(500, f"the frontend failed: {code.name}: {details}", type="internal_error")
