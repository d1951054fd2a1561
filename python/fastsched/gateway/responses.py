"""OpenAI's Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{id}``, served over
the chat path (``gateway.chat_based``; the request's translation is ``gateway.responses_input``).

The answer's ``output`` holds a ``message`` item (one ``output_text`` part) for the text and a
``function_call`` item per tool call; ``status`` is ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when the output was cut at its limit. A stream sends the Responses
events: ``response.created`` and ``response.in_progress``; per item ``response.output_item.added``,
then for text ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta``... and ``response.function_call_arguments.done``, then
``response.output_item.done``; last ``response.completed`` with the whole response (whose
``status`` may be ``incomplete``: vLLM's choice). Every event carries a ``sequence_number``.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastsched.gateway.chat_based import answer, sse
from fastsched.gateway.openai_protocol import ApiError
from fastsched.gateway.request_ids import assign_request_id
from fastsched.gateway.response_store import StoredResponse
from fastsched.gateway.responses_input import ResponsesRequest, not_found, to_chat
from fastsched.gateway.state import GatewayState


async def create_response(gateway: GatewayState, request: Request) -> Response:
    response_id = assign_request_id(request, "resp")
    body, size = await gateway.read_json(request)
    previous_id = body.get("previous_response_id")
    previous = None
    if previous_id is not None:
        stored = gateway.responses_store.get(previous_id) if isinstance(previous_id, str) else None
        if stored is None:
            raise not_found(str(previous_id), "previous_response_id", gateway.responses_store.enabled)
        previous = stored.conversation
    translated = to_chat(body, previous)
    parsed = await gateway.parse_chat_request(translated.chat, size, response_id)
    return await answer(gateway, request, parsed, ResponsesApi(gateway, response_id, body, translated))


async def retrieve_response(gateway: GatewayState, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = gateway.responses_store.get(response_id)
    if stored is None:
        raise not_found(response_id, "response_id", gateway.responses_store.enabled)
    return JSONResponse(stored.body)


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    usage = chat["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesApi:
    """One Responses request's answer (a ``chat_based.ChatBasedApi``)."""

    def __init__(
        self, gateway: GatewayState, response_id: str, body: dict[str, Any], request: ResponsesRequest
    ) -> None:
        self.gateway, self.id, self.request = gateway, response_id, request
        self.store = request.store and gateway.responses_store.enabled
        self.created_at = int(time.time())
        self.echo = {  # the request's settings, as a response reports them
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": request.metadata or {},
            "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [],
            "truncation": "disabled",
            "store": self.store,
        }
        self.model = body.get("model") or gateway.model_name
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # streamed output items, in output order
        self._message: dict[str, Any] | None = None  # the open message item, while text streams
        self._calls: dict[int, dict[str, Any]] = {}  # chat's tool-call index -> its function_call item

    # ---------------------------------------------------------------- the whole response

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content") or not message.get("tool_calls"):
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{self.id}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [_text_part(message.get("content") or "")],
                }
            )
        for call in message.get("tool_calls") or []:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call['id']}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
        return self._finish(chat, output)

    def _finish(self, chat: dict[str, Any], output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = chat["choices"][0]["finish_reason"] == "length"
        status = "incomplete" if incomplete else "completed"
        response = self._response(status, output, _usage(chat), incomplete)
        if self.store:
            message = chat["choices"][0]["message"]
            said = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                said["tool_calls"] = message["tool_calls"]
            conversation = [*self.request.conversation, said]
            self.gateway.responses_store.put(self.id, StoredResponse(response, conversation))
        return response

    # ---------------------------------------------------------------- the stream

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(kind, payload)

    def stream_start(self) -> str:
        opened = self._response("in_progress", [], None)
        return self._event("response.created", response=opened) + self._event(
            "response.in_progress", response=opened
        )

    def stream_events(self, entries: list[dict[str, Any]]) -> str:
        events = ""
        for entry in entries:
            delta = entry["delta"]
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
        return events

    def _text(self, text: str) -> str:
        events = ""
        if self._message is None:
            item_id = f"msg_{self.id}-{len(self._items)}"
            self._message = {
                "type": "message",
                "id": item_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
                "text": "",
            }
            self._items.append(self._message)
            index = len(self._items) - 1
            events += self._event(
                "response.output_item.added", output_index=index, item=self._public(self._message)
            )
            events += self._event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=_text_part(""),
            )
        self._message["text"] += text
        return events + self._event(
            "response.output_text.delta",
            item_id=self._message["id"],
            output_index=self._items.index(self._message),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close_message(self) -> str:
        message, self._message = self._message, None
        if message is None:
            return ""
        index, text = self._items.index(message), message.pop("text")
        message.update(status="completed", content=[_text_part(text)])
        return (
            self._event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            + self._event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=_text_part(text),
            )
            + self._event("response.output_item.done", output_index=index, item=message)
        )

    def _call_delta(self, call: dict[str, Any]) -> str:
        events = ""
        item = self._calls.get(call["index"])
        if item is None:  # a new call: its id and name come first
            events += self._close_message()
            item = {
                "type": "function_call",
                "id": f"fc_{call['id']}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self._calls[call["index"]] = item
            self._items.append(item)
            events += self._event(
                "response.output_item.added", output_index=len(self._items) - 1, item=dict(item)
            )
        piece = call.get("function", {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events += self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self._items.index(item),
                delta=piece,
            )
        return events

    def stream_end(self, chat: dict[str, Any]) -> str:
        events = self._close_message()
        for item in self._calls.values():
            index = self._items.index(item)
            item["status"] = "completed"
            events += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            events += self._event("response.output_item.done", output_index=index, item=item)
        if not self._items:  # nothing was said: one empty message, as a whole response has
            events += self._text("") + self._close_message()
        # Always response.completed, as vLLM sends it, its status incomplete when cut (the clients' stream
        # helpers wait for it; OpenAI would send response.incomplete instead).
        return events + self._event("response.completed", response=self._finish(chat, self._items))

    def stream_error(self, error: ApiError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def error_response(self, error: ApiError) -> Response:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @staticmethod
    def _public(message: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in message.items() if k != "text"}
