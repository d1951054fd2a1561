"""The routes of the APIs beside OpenAI's chat and completions: OpenAI's Responses and
embeddings, Anthropic's Messages. Each is behind the API key, like every ``/v1`` route, and
reaches the frontends through the same gRPC call, gate and admission as chat."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fastsched.gateway import anthropic_messages, embeddings, responses
from fastsched.gateway.auth import API, Handler
from fastsched.gateway.state import GatewayState

GatewayHandler = Callable[[GatewayState, Request], Awaitable[Response]]


def routes(gateway: GatewayState) -> list[Route]:
    guard = gateway.auth.guard

    def bind(handler: GatewayHandler) -> Handler:
        return functools.partial(handler, gateway)

    def anthropic(handler: GatewayHandler) -> Handler:
        return anthropic_messages.with_anthropic_errors(guard(bind(handler), API, x_api_key=True))

    return [
        Route("/v1/responses", guard(bind(responses.create_response)), methods=["POST"]),
        Route("/v1/responses/{response_id}", guard(bind(responses.retrieve_response)), methods=["GET"]),
        Route("/v1/messages", anthropic(anthropic_messages.create_message), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic(anthropic_messages.count_tokens), methods=["POST"]),
        Route("/v1/embeddings", guard(bind(embeddings.create_embeddings)), methods=["POST"]),
    ]
