"""``/v1/sessions``: streaming-input sessions (S15) over a WebSocket, behind ``--api-key``.

A page of another site cannot open one: when the client sends ``Origin`` (browsers do), it must
be the gateway's own or one of ``--allowed-origins``. The ``open`` message must come within
``--session-open-timeout`` seconds of connecting. Over ``--max-sessions``, the frontend rejects the
session as it rejects a request at admission: an error with status 503 and ``retry_after``.

One WebSocket is one session, carried to a frontend as one gRPC ``GenerateSession`` call.
The client sends JSON messages:

- ``{"type": "open", "prompt": text or token ids, "max_tokens": n, ...}`` first, with any
  sampling parameter of the gRPC ``SamplingParams`` (``temperature``, ``seed``, ...) and
  optionally ``request_id``, ``priority``, ``model`` (a served name or a LoRA adapter's) and
  ``cache_salt`` (vLLM's: the session's prefix-cache blocks are shared only with its salt);
- ``{"type": "chunk", "prompt": ..., "max_tokens": n, "last": false}`` for each next chunk;
- ``{"type": "close"}`` to end the session once its chunks are served.

The server sends ``{"type": "output", "request_id", "segment", "text", "token_ids",
"segment_ended", "finish_reason"}`` as tokens come (``usage`` on the last one), and on an
error ``{"type": "error", "status": http_status, "error": {...}}`` in OpenAI's shape (and
``retry_after``, seconds, with a 503) before closing the socket
(code 1008 for a request that can never succeed, 1013 for a 503, 1011 otherwise). A
client that disconnects ends the session at once: its slot and KV are freed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from google.protobuf import json_format
from starlette.websockets import WebSocket, WebSocketDisconnect

from fastsched.frontend.settings import SESSION_OPEN_TIMEOUT_S
from fastsched.gateway.errors import api_error_from_rpc
from fastsched.gateway.openai_protocol import ApiError, bad_request
from fastsched.limits import LimitError, check_cache_salt
from fastsched.proto_gen import import_stubs

pb, pb_grpc = import_stubs()

_OPEN_FIELDS = frozenset({"type", "prompt", "request_id", "priority", "model", "cache_salt"})
# The sampling parameters an open message may carry: SamplingParams' fields, by either JSON name.
_SAMPLING_FIELDS = frozenset(
    name for field in pb.SamplingParams.DESCRIPTOR.fields for name in (field.name, field.json_name)
)
_CHUNK_FIELDS = frozenset({"type", "prompt", "max_tokens", "last"})
_CLOSE_POLICY, _CLOSE_TRY_AGAIN, _CLOSE_INTERNAL = 1008, 1013, 1011


@dataclass(frozen=True)
class SessionSettings:
    """The WebSocket's own bounds (the frontends bound what a session holds in the engine:
    ``--max-sessions``, ``--session-idle-timeout``)."""

    # Seconds a client has to send its ``open`` message after connecting (--session-open-timeout).
    open_timeout: float = SESSION_OPEN_TIMEOUT_S
    # Origins (scheme://host[:port]) whose pages may open a session besides the gateway's own
    # (--allowed-origins); "*" allows any. A client that sends no Origin (not a browser) is not asked.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.open_timeout < float("inf"):
            raise ValueError(
                f"session_open_timeout must be a positive number of seconds, got {self.open_timeout}"
            )

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """Same-origin (the Origin's host is the Host the client connected to), listed, or not sent."""
        if origin is None or "*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins:
            return True
        return host is not None and urlsplit(origin).netloc.lower() == host.lower()


async def session_websocket(websocket: WebSocket) -> None:
    gateway = websocket.app.state.gateway
    settings: SessionSettings = gateway.sessions
    if not settings.origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host")):
        # A page of another site (cross-site WebSocket hijacking): refused before the handshake, 403.
        await websocket.close(code=_CLOSE_POLICY, reason="Origin not allowed (--allowed-origins)")
        return
    if gateway.auth.failure(websocket.headers) is not None:
        await websocket.close(
            code=_CLOSE_POLICY, reason="Invalid or missing API key: send Authorization: Bearer"
        )
        return
    await websocket.accept()
    pool = gateway.pool
    await pool.start()
    frontend = pool.pick()
    call = None
    try:
        try:
            async with asyncio.timeout(settings.open_timeout):
                first = await _receive(websocket)
        except TimeoutError:
            raise ApiError(
                408,
                f"No open message within {settings.open_timeout:g} s of connecting (--session-open-timeout).",
                code="session_open_timeout",
            ) from None
        opening = open_request(first, gateway.model_names)
        call = frontend.stub.GenerateSession(metadata=pool.metadata)
        frontend.outstanding += 1
        await call.write(opening)
        feeder = asyncio.create_task(_feed(websocket, call))
        try:
            async for response in call:
                await websocket.send_json(_output(response))
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            return  # the feeder ended the call: the client left, or was told why
        finally:
            feeder.cancel()
        await websocket.close()
    except ApiError as e:
        await _fail(websocket, e)
    except grpc.aio.AioRpcError as e:
        await _fail(websocket, api_error_from_rpc(e, gateway.retry_after_s))
    except WebSocketDisconnect:
        pass  # the client left: cancelling the call aborts the session
    finally:
        if call is not None:
            call.cancel()
            frontend.outstanding -= 1


def open_request(message: dict[str, Any], model_names: Sequence[str] = ()) -> Any:
    """The ``open`` message as a ``SessionRequest``; ``ApiError`` 400 naming a bad field. A
    ``model`` that is not one of ``model_names`` names a LoRA adapter (the frontend answers
    NOT_FOUND, a 404, for one it does not serve)."""
    if message.get("type") != "open":
        raise bad_request('a session\'s first message must be {"type": "open", ...}', "type")
    model = _field(message, "model", str, "")
    request = pb.GenerateRequest(
        request_id=_field(message, "request_id", str, ""),
        priority=_field(message, "priority", int, 0),
        model="" if model in model_names else model,
    )
    _set_prompt(request, message.get("prompt"))
    try:
        salt = check_cache_salt(message.get("cache_salt"))
    except LimitError as e:
        raise bad_request(str(e), "cache_salt") from None
    if salt is not None:
        request.cache_salt = salt
    params = {k: v for k, v in message.items() if k not in _OPEN_FIELDS}
    unknown = sorted(set(params) - _SAMPLING_FIELDS)
    if unknown:
        raise bad_request(
            f"unknown open fields: {', '.join(unknown)} (an open message takes "
            f"{', '.join(sorted(_OPEN_FIELDS))} and the sampling parameters)",
            unknown[0],
        )
    try:
        json_format.ParseDict(params, request.sampling_params)
    except json_format.ParseError as e:
        raise bad_request(f"invalid sampling parameters: {e}", None) from None
    return pb.SessionRequest(open=request)


def chunk_request(message: dict[str, Any]) -> Any:
    """A ``chunk`` or ``close`` message as a ``SessionRequest``; ``ApiError`` 400 otherwise."""
    kind = message.get("type")
    if kind == "close":
        return pb.SessionRequest(close=True)
    if kind != "chunk":
        raise bad_request(f"type must be chunk or close after open, got {kind!r}", "type")
    unknown = sorted(set(message) - _CHUNK_FIELDS)
    if unknown:
        raise bad_request(f"unknown chunk fields: {', '.join(unknown)}", unknown[0])
    chunk = pb.SessionChunk(
        max_tokens=_field(message, "max_tokens", int, 16), last=_field(message, "last", bool, False)
    )
    _set_prompt(chunk, message.get("prompt"))
    return pb.SessionRequest(chunk=chunk)


def _set_prompt(msg: Any, prompt: Any) -> None:
    if isinstance(prompt, str):
        msg.text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        msg.token_ids.ids.extend(prompt)
    else:
        raise bad_request("prompt must be a string or an array of token ids", "prompt")


def _field(message: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = message.get(name, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"{name} must be of type {kind.__name__}, got {value!r}", name)
    return value


async def _feed(websocket: WebSocket, call: Any) -> None:
    """The client's chunks into the call. A malformed message or a disconnect ends the call."""
    try:
        while True:
            await call.write(chunk_request(await _receive(websocket)))
    except ApiError as e:
        await _fail(websocket, e)
        call.cancel()
    except (WebSocketDisconnect, RuntimeError):
        call.cancel()  # gone: the frontend aborts the session at once
    except grpc.aio.AioRpcError:
        pass  # the call ended; its error reaches the reading side


async def _receive(websocket: WebSocket) -> dict[str, Any]:
    """The next message, a JSON object in a text frame; ``ApiError`` 400 for anything else
    (a binary frame, which ``receive_text`` met with a ``KeyError``)."""
    frame = await websocket.receive()
    if frame["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(frame.get("code", 1000), frame.get("reason"))
    text = frame.get("text")
    if text is None:
        raise bad_request("a session message must be a JSON object in a text frame, not a binary frame", None)
    try:
        message = json.loads(text)
    except ValueError as e:
        raise bad_request(f"a session message must be a JSON object: {e}", None) from None
    if not isinstance(message, dict):
        raise bad_request("a session message must be a JSON object", None)
    return message


def _output(response: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "output",
        "request_id": response.request_id,
        "segment": response.segment,
        "text": response.text,
        "token_ids": list(response.token_ids),
        "segment_ended": response.segment_ended,
        "finish_reason": response.finish_reason or None,
    }
    if response.HasField("usage"):
        out["usage"] = {
            "prompt_tokens": response.usage.prompt_tokens,
            "completion_tokens": response.usage.completion_tokens,
        }
    return out


async def _fail(websocket: WebSocket, error: ApiError) -> None:
    code = (
        _CLOSE_POLICY if error.status < 500 else _CLOSE_TRY_AGAIN if error.status == 503 else _CLOSE_INTERNAL
    )
    try:
        message: dict[str, Any] = {"type": "error", "status": error.status, **error.body()}
        if "Retry-After" in error.headers:  # a WebSocket has no headers left to carry it
            message["retry_after"] = int(error.headers["Retry-After"])
        await websocket.send_json(message)
        await websocket.close(code=code, reason=error.message[:120])
    except (WebSocketDisconnect, RuntimeError):
        pass  # already gone or closed
