"""Requests per API endpoint and HTTP status, counted where the gateway answers them:
``fastsched:http_requests_total{model_name, endpoint, status}`` in ``/metrics``.

The frontends' families count what reached the engine, whatever API it came through; this
one says which API each request came through and how it was answered, so a burst's 503s on
``/v1/messages`` or ``/v1/embeddings`` show beside chat's. Counted in pure ASGI from the
response's start (a stream's status included, which is decided when the stream starts, after
the handler returned), for the generating endpoints only.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client.core import CounterMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "fastsched:"
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
)


class EndpointCounts:
    """(endpoint, status) -> requests answered."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()

    def families(self, model_name: str) -> list[Metric]:
        family = CounterMetricFamily(
            PREFIX + "http_requests",
            "HTTP requests answered, by API endpoint and status.",
            labels=["model_name", "endpoint", "status"],
        )
        for (endpoint, status), count in sorted(self.counts.items()):
            family.add_metric([model_name, endpoint, str(status)], count)
        return [family]


class CountEndpoints:
    """ASGI middleware: counts each generating endpoint's responses into ``counts``."""

    def __init__(self, app: ASGIApp, counts: EndpointCounts) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in ENDPOINTS:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counts.counts[path, message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counting_send)
