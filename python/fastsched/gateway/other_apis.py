"""The routes of the APIs beside OpenAI's chat and completions: OpenAI's Responses and
embeddings, Anthropic's Messages. Each is behind the API key, like every ``/v1`` route, and
reaches the frontends through the same gRPC call, gate and admission as chat."""

from __future__ import annotations

import functools

from starlette.routing import Route

from fastsched.gateway import anthropic_messages, embeddings, responses
from fastsched.gateway.auth import API
from fastsched.gateway.state import GatewayState


def routes(gateway: GatewayState) -> list[Route]:
    guard, bind = gateway.auth.guard, functools.partial

    def anthropic(handler: object) -> object:
        return anthropic_messages.with_anthropic_errors(guard(bind(handler, gateway), API, x_api_key=True))

    return [
        Route("/v1/responses", guard(bind(responses.create_response, gateway)), methods=["POST"]),
        Route("/v1/responses/{response_id}", guard(bind(responses.retrieve_response, gateway)), methods=["GET"]),
        Route("/v1/messages", anthropic(anthropic_messages.create_message), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic(anthropic_messages.count_tokens), methods=["POST"]),
        Route("/v1/embeddings", guard(bind(embeddings.create_embeddings, gateway)), methods=["POST"]),
    ]
