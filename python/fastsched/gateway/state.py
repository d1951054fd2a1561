"""What the routes outside ``gateway.app`` use of its ``Gateway``, as a Protocol: they get
the gateway as an argument and need not import the app (which imports them)."""

from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import Request

from fastsched.gateway.auth import Auth
from fastsched.gateway.openai_protocol import ParsedRequest, ResponseFormatter
from fastsched.gateway.pool import FrontendPool, FrontendStream
from fastsched.gateway.response_store import ResponseStore
from fastsched.limits import RequestLimits


class GatewayState(Protocol):
    model_name: str
    tokenizer: Any
    enable_prompt_tokens_details: bool
    retry_after_s: int
    limits: RequestLimits
    pool: FrontendPool
    auth: Auth
    responses_store: ResponseStore
    embedding_size: int | None

    async def read_json(self, request: Request) -> tuple[dict[str, Any], int]: ...

    async def parse_chat_request(self, body: dict[str, Any], size: int, request_id: str) -> ParsedRequest: ...

    def with_adapter(self, parsed: ParsedRequest, body: dict[str, Any]) -> ParsedRequest: ...

    async def open_all(self, parsed: ParsedRequest) -> list[FrontendStream]: ...

    async def collect(self, parsed: ParsedRequest, formatter: ResponseFormatter) -> dict[str, Any]: ...
