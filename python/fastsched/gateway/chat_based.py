"""The routes that speak another API over the chat path: OpenAI's Responses (``gateway.responses``)
and Anthropic's Messages (``gateway.anthropic_messages``).

Each translates its request into a chat request, which ``parse_chat`` renders and checks as it
does ``/v1/chat/completions``' own, so it reaches the frontends through the same gRPC call,
the same request gate and the same admission (A1–A6: a rejection is the same 503 with its
``Retry-After``). The answer is chat's too (``ResponseFormatter``: text, tool calls found by
the same parsers, usage); a :class:`ChatBasedApi` only reshapes it: the finished chat body into
its own body, a stream's chat entries into its own events. An error before the first event is
an ordinary error response in the API's own shape (:meth:`ChatBasedApi.error_response`).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from fastsched.gateway.errors import api_error_from_rpc
from fastsched.gateway.openai_protocol import ApiError, ParsedRequest, ResponseFormatter
from fastsched.gateway.state import GatewayState
from fastsched.gateway.streams import ClientWatch, merge_streams
from fastsched.limits import LimitError


class ChatBasedApi(Protocol):
    """One request's answer in an API of its own, from chat's."""

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The whole answer, from the finished chat completion body."""

    def stream_start(self) -> str:
        """The events that open a stream (sent once the first frontend message is in)."""

    def stream_events(self, entries: list[dict[str, Any]]) -> str:
        """The events of one frontend message's chat chunk entries."""

    def stream_end(self, chat: dict[str, Any]) -> str:
        """The events that close a stream, from the finished chat completion body."""

    def stream_error(self, error: ApiError) -> str:
        """An error after the stream has started, as an event."""

    def error_response(self, error: ApiError) -> Response:
        """An error before any event, in the API's shape."""


def sse(event: str | None, payload: dict[str, Any]) -> str:
    """One server-sent event; ``event`` names it (both APIs name theirs)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


async def answer(
    gateway: GatewayState, request: Request, parsed: ParsedRequest, api: ChatBasedApi
) -> Response:
    """Runs a translated chat request and answers it in ``api``'s shape, streamed or whole."""
    formatter = ResponseFormatter(
        parsed,
        parsed.lora_name or gateway.model_name,
        gateway.tokenizer,
        gateway.enable_prompt_tokens_details,
    )
    if parsed.stream:
        return _ApiEventStream(gateway, parsed, formatter, api)
    body = None
    async with ClientWatch(request.receive) as watch:
        body = await gateway.collect(parsed, formatter)
    return Response(status_code=499) if watch.gone or body is None else JSONResponse(api.body(body))


def as_api_error(error: Exception) -> ApiError:
    """A gateway exception as the ApiError it is answered with (``LimitError``: its own status)."""
    if isinstance(error, LimitError):
        return ApiError(error.status, str(error), param=error.field)
    assert isinstance(error, ApiError)
    return error


class _ApiEventStream(Response):
    """``app._EventStream`` for a :class:`ChatBasedApi`: the gRPC calls are opened before the
    200, so that a 503 or a 400 from the frontend is still an error response (in the API's
    shape); then one body chunk per frontend message, the last one closing the response."""

    media_type = "text/event-stream"

    def __init__(
        self, gateway: GatewayState, parsed: ParsedRequest, formatter: ResponseFormatter, api: ChatBasedApi
    ) -> None:
        self.gateway, self.parsed, self.formatter, self.api = gateway, parsed, formatter, api
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with ClientWatch(receive):
            try:
                streams = await self.gateway.open_all(self.parsed)
            except (ApiError, LimitError) as e:
                await self.api.error_response(as_api_error(e))(scope, receive, send)
                return
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                events = self.api.stream_start()
                try:
                    async for prompt_index, resp in merge_streams(streams):
                        events += self.api.stream_events(self.formatter.consume(prompt_index, resp))
                        if events:
                            await send(
                                {"type": "http.response.body", "body": events.encode(), "more_body": True}
                            )
                        events = ""
                    events += self.api.stream_end(self.formatter.final())
                except grpc.aio.AioRpcError as e:
                    events += self.api.stream_error(api_error_from_rpc(e, self.gateway.retry_after_s))
                await send({"type": "http.response.body", "body": events.encode(), "more_body": False})
            finally:
                for stream in streams:
                    stream.cancel()
