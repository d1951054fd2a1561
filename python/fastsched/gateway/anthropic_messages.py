"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, served
over the chat path (``gateway.chat_based``; the request's translation is ``gateway.anthropic_input``).

The answer's ``content`` holds a ``text`` block and a ``tool_use`` block per tool call;
``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence`` the
one matched) or ``tool_use``. A stream sends Anthropic's events: ``message_start``, per block
``content_block_start``, ``content_block_delta`` (``text_delta`` / ``input_json_delta``)...,
``content_block_stop``, then ``message_delta`` (``stop_reason``, usage) and ``message_stop``.
``usage.input_tokens`` counts the whole prompt (prefix-cache hits included), so it equals what
``count_tokens`` answers for the same input. Errors are in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), with the status codes of docs/design.md §8
(a rejection at admission is a 503 ``overloaded_error`` with ``Retry-After``); the key may come
as ``x-api-key`` as well as ``Authorization: Bearer``.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastsched.gateway.anthropic_input import to_chat
from fastsched.gateway.auth import Handler
from fastsched.gateway.chat_based import answer, as_api_error, sse
from fastsched.gateway.openai_protocol import ApiError
from fastsched.gateway.request_ids import assign_request_id
from fastsched.gateway.state import GatewayState
from fastsched.limits import LimitError

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error(error: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def anthropic_error_response(error: ApiError) -> Response:
    return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)


def with_anthropic_errors(handler: Handler) -> Handler:
    """``handler`` whose errors (the key check's 401 included) are answered in Anthropic's shape."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except (ApiError, LimitError) as e:
            return anthropic_error_response(as_api_error(e))

    return wrapped


async def create_message(gateway: GatewayState, request: Request) -> Response:
    message_id = assign_request_id(request, "msg")
    body, size = await gateway.read_json(request)
    parsed = await gateway.parse_chat_request(to_chat(body), size, message_id)
    api = MessagesApi(body.get("model") or gateway.model_name, message_id, len(parsed.prompts[0]))
    return await answer(gateway, request, parsed, api)


async def count_tokens(gateway: GatewayState, request: Request) -> Response:
    """The prompt's tokens as ``/v1/messages`` renders it: the ``input_tokens`` it would report."""
    body, size = await gateway.read_json(request)
    parsed = await gateway.parse_chat_request(to_chat(body, count_only=True), size, "count_tokens")
    return JSONResponse({"input_tokens": len(parsed.prompts[0])})


def _tool_use_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished chat choice."""
    finish, matched = choice["finish_reason"], choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish, "end_turn"), None


class MessagesApi:
    """One Messages request's answer (a ``chat_based.ChatBasedApi``)."""

    def __init__(self, model: str, message_id: str, input_tokens: int) -> None:
        self.model, self.id, self.input_tokens = model, message_id, input_tokens
        self._block: int | None = None  # the open content block's index
        self._open_kind: str | None = None  # "text" or "tool_use"
        self._next = 0  # the next block's index
        self._calls: dict[int, int] = {}  # chat's tool-call index -> its block's index

    def _message(
        self,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        stop_sequence: str | None,
        output_tokens: int,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        }

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        content = []
        if message.get("content") or not message.get("tool_calls"):
            content.append({"type": "text", "text": message.get("content") or ""})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_use_id(call["id"]),
                    "name": function["name"],
                    "input": json.loads(function["arguments"]),
                }
            )
        return self._message(content, *_stop(choice), chat["usage"]["completion_tokens"])

    # ---------------------------------------------------------------- the stream

    def stream_start(self) -> str:
        return sse("message_start", {"type": "message_start", "message": self._message([], None, None, 0)})

    def stream_events(self, entries: list[dict[str, Any]]) -> str:
        events = ""
        for entry in entries:
            delta = entry["delta"]
            if delta.get("content"):
                if self._open_kind != "text":
                    events += self._start_block({"type": "text", "text": ""})
                events += self._delta(self._block, {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                if call["index"] not in self._calls:
                    block = {
                        "type": "tool_use",
                        "id": _tool_use_id(call["id"]),
                        "name": call["function"]["name"],
                        "input": {},
                    }
                    events += self._start_block(block)
                    self._calls[call["index"]] = self._block  # type: ignore[assignment]
                piece = call.get("function", {}).get("arguments")
                if piece:
                    events += self._delta(
                        self._calls[call["index"]], {"type": "input_json_delta", "partial_json": piece}
                    )
        return events

    def _start_block(self, block: dict[str, Any]) -> str:
        events = self._stop_block()
        self._block, self._open_kind = self._next, block["type"]
        self._next += 1
        return events + sse(
            "content_block_start",
            {"type": "content_block_start", "index": self._block, "content_block": block},
        )

    @staticmethod
    def _delta(index: int | None, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _stop_block(self) -> str:
        if self._block is None:
            return ""
        index, self._block, self._open_kind = self._block, None, None
        return sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def stream_end(self, chat: dict[str, Any]) -> str:
        events = self._stop_block()
        stop_reason, stop_sequence = _stop(chat["choices"][0])
        return (
            events
            + sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": chat["usage"]["completion_tokens"]},
                },
            )
            + sse("message_stop", {"type": "message_stop"})
        )

    def stream_error(self, error: ApiError) -> str:
        return sse("error", anthropic_error(error))

    def error_response(self, error: ApiError) -> Response:
        return anthropic_error_response(error)
