"""The gateway's one key check, declared per route in ``create_app`` instead of called by each handler.

Two keys, two kinds of route: ``--api-key`` guards the inference API (``/v1/*``, the
``/v1/sessions`` WebSocket included, ``/tokenize``, ``/detokenize``; ``/v1/messages`` also takes it
as Anthropic's ``x-api-key`` header); ``--admin-api-key`` guards
the admin routes (pause, resume, reload, LoRA load/unload, ``/debug/*``), which are off unless
enabled (``fastsched.admin``). The API key never grants admin. ``/health``, ``/ping``,
``/version`` and ``/metrics`` stay open for probes and scrapers, as in vLLM.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response

from fastsched.gateway.openai_protocol import ApiError
from fastsched.rpc import AUTHORIZATION_KEY, bearer_matches

__all__ = ["API", "ADMIN", "Auth"]

API, ADMIN = "api", "admin"
Handler = Callable[[Request], Awaitable[Response]]


class Auth:
    def __init__(self, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.keys = {API: api_key, ADMIN: admin_api_key}

    def failure(
        self, headers: Mapping[str, str], scope: str = API, x_api_key: bool = False
    ) -> ApiError | None:
        """The 401 for a request without the key ``scope`` requires; None when it may pass.
        ``x_api_key``: the key may come as an ``x-api-key`` header too (Anthropic's clients send it so)."""
        key = self.keys[scope]
        if key is None or bearer_matches(headers.get("authorization"), key):
            return None
        if x_api_key and hmac.compare_digest(headers.get("x-api-key", "").encode(), key.encode()):
            return None
        which = "admin API key (--admin-api-key)" if scope == ADMIN else "API key"
        return ApiError(
            401,
            f"Invalid or missing {which}: send `Authorization: Bearer <key>`.",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def guard(self, handler: Handler, scope: str = API, x_api_key: bool = False) -> Handler:
        """``handler`` behind the key of ``scope`` (``x_api_key``: see :meth:`failure`)."""

        @functools.wraps(handler)
        async def guarded(request: Request) -> Response:
            error = self.failure(request.headers, scope, x_api_key)
            if error is not None:
                raise error
            return await handler(request)

        return guarded

    def metadata(self, scope: str = API) -> tuple[tuple[str, str], ...]:
        """What the gateway sends the frontends for a call of ``scope``: their gRPC ports require the same keys."""
        key = self.keys[scope]
        return ((AUTHORIZATION_KEY, f"Bearer {key}"),) if key is not None else ()
