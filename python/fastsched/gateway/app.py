"""The gateway: OpenAI's HTTP API (Starlette on uvicorn) over K gRPC frontends.

One channel per frontend; each request goes to the frontend with the fewest requests
in flight from this gateway, ties broken round-robin. A frontend that cannot be reached
(UNAVAILABLE without a rejection reason) is skipped and the next one tried; an
admission rejection is not retried elsewhere, because A2 counts in-flight requests over
all frontends — the client gets the 503 and its ``Retry-After`` instead.

Status codes follow docs/design.md §8, in OpenAI's error shape. A streaming response starts
only once the frontend has sent its first chunk, so a rejection (which comes before any
chunk) is still a 503, never an error inside a 200 stream. When the client goes away,
the gRPC call is cancelled and the frontend aborts the request in the engine.

Who may call what is declared per route in ``create_app`` (``gateway.auth``: one key check);
a frontend's gRPC error becomes an HTTP error in one place (``gateway.errors``), and the
frontends are reached through ``gateway.pool`` (routing, and ``FrontendPool.each``, the one
fan-out). The gateway sends its key to the frontends (metadata ``authorization: Bearer <key>``),
whose gRPC ports require it too.

Limits (``fastsched.limits.RequestLimits``): the body is read within ``body_timeout``
and up to ``max_body_bytes`` (408 / 413); it must be JSON without NaN or Infinity, at
most ``max_json_depth`` deep, and its strings valid Unicode (no lone surrogates, which
could not be sent on); headers are bounded by ``gateway.http_protocol``. A chat request
whose body is long is rendered and tokenized in a worker thread, so that the event loop
goes on serving ``/health`` and the other requests meanwhile.

Request ids: a completion's id is the client's ``X-Request-Id`` header when it sends one
(as vLLM honours it; used as is, so that the client can look it up by the id it chose),
else ``cmpl-<hex>`` / ``chatcmpl-<hex>``; prompt ``i`` of it is ``<id>-<i>`` at the
frontends. Every response of ``/v1/completions`` and ``/v1/chat/completions`` carries it
back as ``X-Request-Id``, errors and 503s included. ``GET /debug/requests/{id}`` asks every
frontend where a request is (``frontend.request_status``), by that id or by a prompt's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastsched.admin import AdminSettings, PathNotAllowedError
from fastsched.gateway import cache_admin, other_apis, pause
from fastsched.gateway import metrics as gateway_metrics
from fastsched.gateway.auth import ADMIN, Auth
from fastsched.gateway.endpoint_metrics import CountEndpoints, EndpointCounts
from fastsched.gateway.errors import api_error_from_rpc
from fastsched.gateway.http_protocol import guarded_http_protocol
from fastsched.gateway.json_body import SURROGATE_ESCAPE, check_json, reject_constant
from fastsched.gateway.lora_admin import LoRAAdmin
from fastsched.gateway.openai_protocol import (
    ApiError,
    ParsedRequest,
    ResponseFormatter,
    bad_request,
    check_json_content_type,
    parse_chat,
    parse_completion,
)
from fastsched.gateway.pool import FrontendPool, FrontendStream
from fastsched.gateway.request_ids import assign_request_id
from fastsched.gateway.response_store import ResponseStore
from fastsched.gateway.sessions import SessionSettings, session_websocket
from fastsched.gateway.streams import ClientWatch, merge_streams
from fastsched.gateway.tokenize import detokenize, tokenize
from fastsched.limits import INLINE_TOKENIZE_CHARS, LimitError, RequestLimits
from fastsched.request_gate import run_bounded

logger = logging.getLogger("fastsched.gateway")
_VERSION = importlib.metadata.version("fastsched")

_PROMPT_CHUNK = 8  # prompts of an OpenAI response id looked up at once


class _EventStream(Response):
    """A streaming completion as server-sent events. It opens the request's gRPC calls
    when called, so that an error before the first token (a 503, a 400 from the engine)
    is still an ordinary error response, then sends one body chunk per frontend message;
    the last chunk carries ``[DONE]`` and the end of the response, so a short completion
    costs few socket writes."""

    media_type = "text/event-stream"

    def __init__(self, gateway: Gateway, parsed: ParsedRequest, formatter: ResponseFormatter) -> None:
        self.gateway, self.parsed, self.formatter = gateway, parsed, formatter
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with ClientWatch(receive):
            streams = await self.gateway.open_all(self.parsed)
            try:
                await send(
                    {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
                )
                async for events, last in self.gateway._sse(self.parsed, self.formatter, streams):
                    if events:  # the last always holds [DONE]
                        await send(
                            {"type": "http.response.body", "body": events.encode(), "more_body": not last}
                        )
            finally:
                for stream in streams:
                    stream.cancel()


class Gateway:
    """The routes' state: the frontend pool, the model's name and tokenizer, the limits."""

    tool_parser: str | None = None  # --tool-call-parser, for tool_choice "auto" (gateway.tool_calls)
    embedding_size: int | None = None  # the embeddings' length, once one was computed (gateway.embeddings)

    def __init__(
        self,
        frontend_addrs: Sequence[str],
        model_name: str | Sequence[str],
        tokenizer: Any,
        api_key: str | None,
        limits: RequestLimits,
        retry_after_s: int,
        admin: AdminSettings | None = None,
        sessions: SessionSettings | None = None,
        enable_prompt_tokens_details: bool = False,
        responses_store_size: int = 0,
    ) -> None:
        self.admin = admin or AdminSettings()
        self.admin.check_keys(api_key)
        self.sessions = sessions or SessionSettings()
        self.auth = Auth(api_key, self.admin.admin_api_key)
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.pool = FrontendPool(frontend_addrs, api_key)
        # Clients may send any of the names; responses carry the first (vLLM's --served-model-name).
        self.model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        self.model_name, self.tokenizer, self.api_key = self.model_names[0], tokenizer, api_key
        self.limits, self.retry_after_s = limits, retry_after_s
        self.created = int(time.time())
        self.responses_store = ResponseStore(responses_store_size)  # /v1/responses' stored responses
        self.endpoint_counts = EndpointCounts()
        self.loras = LoRAAdmin(self.pool, retry_after_s, self.admin, self.auth.metadata(ADMIN))
        # Chat templates of long bodies are rendered and tokenized here, off the event loop.
        self._parse_pool = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="fastsched-chat-template"
        )

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _body_too_large(limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _body_too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(
                408,
                f"The request body was not received within {self.limits.body_timeout:g} s (--body-timeout).",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        except ClientDisconnect:  # an answer nobody reads, not a traceback in the log for each drop
            raise ApiError(
                400,
                "The client closed the connection before sending the whole request body.",
                code="client_disconnected",
            ) from None
        return b"".join(chunks)

    async def read_json(self, request: Request) -> tuple[dict[str, Any], int]:
        """The body as a JSON object, checked (see the module docstring), and its size in bytes."""
        check_json_content_type(request.headers.get("content-type"))
        raw = await self._read_body(request)
        try:
            body = json.loads(raw, parse_constant=reject_constant)
        except RecursionError:
            raise bad_request(
                f"The request body nests objects and arrays deeper than this server's limit of "
                f"{self.limits.max_json_depth} (--max-json-depth).",
                None,
            ) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"The request body is not valid JSON: {e}", None) from e
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", None)
        check_json(body, self.limits.max_json_depth, check_strings=SURROGATE_ESCAPE.search(raw) is not None)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request(f"model must be a string, got {model!r}", "model")
        if model is not None and model not in self.model_names and not await self.loras.is_adapter(model):
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )
        return body, len(raw)

    async def completions(self, request: Request) -> Response:
        request_id = assign_request_id(request, "cmpl")
        body, _ = await self.read_json(request)
        info = await self.pool.model_info()
        parsed = parse_completion(
            body, request_id, self.limits, info and info["max_model_len"], self.tokenizer
        )
        return await self._generate(request, self.with_adapter(parsed, body))

    async def chat_completions(self, request: Request) -> Response:
        request_id = assign_request_id(request, "chatcmpl")
        body, size = await self.read_json(request)
        return await self._generate(request, await self.parse_chat_request(body, size, request_id))

    async def parse_chat_request(self, body: dict[str, Any], size: int, request_id: str) -> ParsedRequest:
        """``parse_chat`` of a chat body (``size``: its request's bytes: a long one is rendered off the
        event loop)."""
        info = await self.pool.model_info()
        args = (
            body,
            self.tokenizer,
            info and info["max_model_len"],
            request_id,
            self.limits,
            self.tool_parser,
        )
        if size <= INLINE_TOKENIZE_CHARS:
            parsed = parse_chat(*args)
        else:
            parsed = await run_bounded(
                self._parse_pool,
                self.limits.prepare_timeout,
                "rendering the chat template",
                parse_chat,
                *args,
            )
        return self.with_adapter(parsed, body)

    def with_adapter(self, parsed: ParsedRequest, body: dict[str, Any]) -> ParsedRequest:
        """A ``model`` that is not one of the served names is an adapter (``read_json`` checked)."""
        model = body.get("model")
        if model is not None and model not in self.model_names:
            parsed.lora_name = model
        return parsed

    async def open_all(self, parsed: ParsedRequest) -> list[FrontendStream]:
        requests = parsed.grpc_requests()
        if len(requests) == 1:  # the common case: no task of its own
            return [await self.pool.open(requests[0], self.retry_after_s)]
        tasks = [asyncio.ensure_future(self.pool.open(r, self.retry_after_s)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, FrontendStream):
                    result.cancel()
            raise

    async def _generate(self, request: Request, parsed: ParsedRequest) -> Response:
        formatter = ResponseFormatter(
            parsed, parsed.lora_name or self.model_name, self.tokenizer, self.enable_prompt_tokens_details
        )
        if parsed.stream:
            return _EventStream(self, parsed, formatter)
        body = None
        async with ClientWatch(request.receive) as watch:
            body = await self.collect(parsed, formatter)
        return Response(status_code=499) if watch.gone or body is None else JSONResponse(body)

    async def collect(self, parsed: ParsedRequest, formatter: ResponseFormatter) -> dict[str, Any]:
        streams = await self.open_all(parsed)
        try:
            async for prompt_index, resp in merge_streams(streams):
                formatter.consume(prompt_index, resp)
        except grpc.aio.AioRpcError as e:
            raise api_error_from_rpc(e, self.retry_after_s) from e
        finally:
            for stream in streams:
                stream.cancel()
        return formatter.final()

    async def _sse(
        self, parsed: ParsedRequest, formatter: ResponseFormatter, streams: list[FrontendStream]
    ) -> AsyncIterator[tuple[str, bool]]:
        """``(events, last)``: the events of each frontend message, joined; the last item,
        which ends the response, also holds the usage chunk and ``[DONE]``."""
        unfinished = len(streams)
        try:
            async with contextlib.aclosing(merge_streams(streams)) as responses:
                async for prompt_index, resp in responses:
                    # One choice per chunk, as OpenAI and vLLM stream n > 1 (clients index chunks by choice).
                    entries = formatter.consume(prompt_index, resp)
                    events = "".join(_sse_event(formatter.chunk([entry])) for entry in entries)
                    unfinished -= resp.HasField("usage")  # a call's last message (FrontendStream)
                    if not unfinished:
                        break
                    yield events, False
                else:
                    events = ""
            if parsed.include_usage:
                events += _sse_event(formatter.usage_chunk())
        except grpc.aio.AioRpcError as e:  # after the 200 has been sent: report inside the stream
            events = _sse_event(api_error_from_rpc(e, self.retry_after_s).body())
        yield events + "data: [DONE]\n\n", True

    async def tokenize(self, request: Request) -> Response:
        body, size = await self.read_json(request)
        info = await self.pool.model_info()
        args = (body, self.tokenizer, info and info["max_model_len"], self.limits)
        if size <= INLINE_TOKENIZE_CHARS:
            return JSONResponse(tokenize(*args))
        return JSONResponse(
            await run_bounded(self._parse_pool, self.limits.prepare_timeout, "tokenizing", tokenize, *args)
        )

    async def detokenize(self, request: Request) -> Response:
        body, _ = await self.read_json(request)
        info = await self.pool.model_info()
        return JSONResponse(detokenize(body, self.tokenizer, info and info["vocab_size"]))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _VERSION})

    async def ping(self, request: Request) -> Response:
        """vLLM's ``/ping`` (SageMaker's health probe): the same answer as ``/health``."""
        return await self.health(request)

    async def models(self, request: Request) -> Response:
        info = await self.pool.model_info() or {}
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "fastsched",
                "root": info.get("model", self.model_name),
                "max_model_len": info.get("max_model_len"),
            }
            for name in self.model_names
        ]
        cards += [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "fastsched",
                "root": path,
                "parent": self.model_name,
                "max_model_len": info.get("max_model_len"),
            }
            for name, path in await self.loras.adapters()
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: Request) -> Response:
        body, _ = await self.read_json(request)
        return await self.loras.load(body)

    async def unload_lora_adapter(self, request: Request) -> Response:
        body, _ = await self.read_json(request)
        return await self.loras.unload(body)

    async def health(self, request: Request) -> Response:
        frontends = await self.pool.health()
        healthy = all(status == "serving" for status in frontends.values())
        return JSONResponse(
            {"status": "healthy" if healthy else "unhealthy", "frontends": frontends},
            status_code=200 if healthy else 503,
        )

    async def metrics(self, request: Request) -> Response:
        body = gateway_metrics.render(
            await self.pool.stats(), self.model_name, extra=self.endpoint_counts.families(self.model_name)
        )
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def request_status(self, request: Request) -> Response:
        """``{"request_id", "state", "prompts": [status of each prompt]}``; see docs/serving.md."""
        request_id = request.path_params["request_id"]
        prompts = await self._find_prompts(request_id)
        if not prompts:
            raise ApiError(
                404,
                f"No frontend knows request `{request_id}` (never seen, or no longer remembered).",
                type="not_found_error",
                param="request_id",
                code="request_not_found",
            )
        states = {p["state"] for p in prompts}  # as frontend.request_status.combined_state
        return JSONResponse(
            {
                "request_id": request_id,
                "state": states.pop() if len(states) == 1 else "mixed",
                "prompts": prompts,
            }
        )

    async def _find_prompts(self, request_id: str) -> list[dict[str, Any]]:
        """``request_id`` itself (a prompt's id), else the prompts of the OpenAI response id
        ``request_id``: ``<id>-0``, ``<id>-1``, ... up to the first one no frontend knows."""

        def lookups(start: int) -> list[Awaitable[dict[str, Any] | None]]:
            return [
                self.pool.request_status(f"{request_id}-{i}", self.retry_after_s, self.auth.metadata(ADMIN))
                for i in range(start, start + _PROMPT_CHUNK)
            ]

        exact, *chunk = await asyncio.gather(
            self.pool.request_status(request_id, self.retry_after_s, self.auth.metadata(ADMIN)), *lookups(0)
        )
        if exact is not None:
            return [exact]
        prompts: list[dict[str, Any]] = []
        while True:
            for status in chunk:
                if status is None:
                    return prompts
                prompts.append(status)
            chunk = await asyncio.gather(*lookups(len(prompts)))


def _body_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body exceeds this server's limit of {limit} bytes (--max-body-bytes).",
        code="request_too_large",
    )


class _RequestIdHeader:
    """Adds ``X-Request-Id`` to the response of every request given an id, errors included.
    Pure ASGI (no BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # request.state: where assign_request_id keeps the id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start" and "request_id" in state:
                MutableHeaders(scope=message).append("X-Request-Id", state["request_id"])
            await send(message)

        await self.app(scope, receive, send_with_id)


def _sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        ApiError(exc.status_code, str(exc.detail), type=kind).body(),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _path_not_allowed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PathNotAllowedError)
    error = ApiError(403, str(exc), type="permission_error", param=exc.field, code=exc.code)
    return JSONResponse(error.body(), status_code=403)


async def _limit_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LimitError)
    return JSONResponse(bad_request(str(exc), exc.field).body(), status_code=exc.status)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return JSONResponse(
        ApiError(500, "Internal server error; see the gateway's log.", type="internal_error").body(),
        status_code=500,
    )


def create_app(
    frontend_addrs: Sequence[str],
    model_name: str | Sequence[str],
    tokenizer: Any,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    retry_after_s: int = 1,
    tool_parser: str | None = None,
    admin: AdminSettings | None = None,
    sessions: SessionSettings | None = None,
    enable_prompt_tokens_details: bool = False,
    responses_store_size: int = 0,
) -> Starlette:
    """The gateway's ASGI app over the frontends at ``frontend_addrs`` (``host:port``).

    ``model_name`` is the name (or names, the first reported) clients send as ``model``
    (another one is a 404);
    ``tokenizer`` (a ``fastsched.model_loader.Tokenizer``) renders chat templates and
    decodes logprob tokens; ``limits``: see ``fastsched.limits`` (default: ``RequestLimits()``);
    ``retry_after_s`` is the ``Retry-After`` of every 503; ``tool_parser`` (a name of
    ``gateway.tool_parsers``) finds the calls of ``tool_choice: "auto"``; ``admin``: which admin
    routes exist and their key (``fastsched.admin``; default: none); ``sessions``: the
    ``/v1/sessions`` WebSocket's settings (``gateway.sessions.SessionSettings``). ``ValueError``
    for admin routes guarded by ``api_key`` alone. ``enable_prompt_tokens_details``:
    ``usage.prompt_tokens_details.cached_tokens`` in responses (vLLM's flag of that name).
    ``responses_store_size``: how many ``/v1/responses`` answers are kept (``gateway.response_store``).
    """
    gateway = Gateway(
        frontend_addrs,
        model_name,
        tokenizer,
        api_key,
        limits or RequestLimits(),
        retry_after_s,
        admin,
        sessions,
        enable_prompt_tokens_details,
        responses_store_size,
    )
    gateway.tool_parser = tool_parser

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.pool.start()
        try:
            yield
        finally:
            await gateway.pool.close()
            gateway._parse_pool.shutdown(wait=False, cancel_futures=True)

    guard = gateway.auth.guard
    routes = [
        Route("/v1/completions", guard(gateway.completions), methods=["POST"]),
        Route("/v1/chat/completions", guard(gateway.chat_completions), methods=["POST"]),
        Route("/v1/models", guard(gateway.models), methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics, methods=["GET"]),
        Route("/tokenize", guard(gateway.tokenize), methods=["POST"]),
        Route("/detokenize", guard(gateway.detokenize), methods=["POST"]),
        Route("/version", gateway.version, methods=["GET"]),
        Route("/ping", gateway.ping, methods=["GET", "POST"]),
        WebSocketRoute("/v1/sessions", session_websocket),
        *other_apis.routes(gateway),
    ]
    # Admin routes exist only when enabled (fastsched.admin), behind the admin key.
    if gateway.admin.enable_runtime_lora_updating:
        routes += [
            Route("/v1/load_lora_adapter", guard(gateway.load_lora_adapter, ADMIN), methods=["POST"]),
            Route("/v1/unload_lora_adapter", guard(gateway.unload_lora_adapter, ADMIN), methods=["POST"]),
        ]
    if gateway.admin.enable_admin_api:
        routes += [
            Route("/debug/requests/{request_id}", guard(gateway.request_status, ADMIN), methods=["GET"]),
            Route("/pause", guard(pause.pause, ADMIN), methods=["POST"]),
            Route("/resume", guard(pause.resume, ADMIN), methods=["POST"]),
            Route("/is_paused", guard(pause.is_paused, ADMIN), methods=["GET"]),
            Route("/reload_weights", guard(pause.reload_weights, ADMIN), methods=["POST"]),
            Route("/reset_prefix_cache", guard(cache_admin.reset_prefix_cache, ADMIN), methods=["POST"]),
        ]
    if (
        gateway.admin.enable_admin_api or gateway.admin.enable_runtime_lora_updating
    ) and gateway.admin.admin_api_key is None:
        logger.warning(
            "admin routes are on without --admin-api-key: anyone who reaches the gateway may use them"
        )
    handlers = {
        ApiError: _api_error,
        LimitError: _limit_error,
        PathNotAllowedError: _path_not_allowed,
        HTTPException: _http_error,
        Exception: _internal_error,
    }
    app = Starlette(
        routes=routes,
        exception_handlers=handlers,
        lifespan=lifespan,
        middleware=[Middleware(_RequestIdHeader), Middleware(CountEndpoints, gateway.endpoint_counts)],
    )
    app.state.gateway = gateway
    return app


def gateway_server(
    app: Starlette, host: str = "127.0.0.1", port: int = 8000, **uvicorn_kwargs: Any
) -> uvicorn.Server:
    """A uvicorn server for ``app``: ``await server.serve()`` (or ``server.run()``) runs it,
    ``server.should_exit = True`` stops it. Its HTTP protocol enforces the header limits of
    the app's ``RequestLimits`` (``gateway.http_protocol``), and a WebSocket message (a
    ``/v1/sessions`` chunk) is bounded as a request body is: larger ones close the socket
    with code 1009."""
    uvicorn_kwargs.setdefault("log_level", "info")
    limits = app.state.gateway.limits
    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on",
            http=guarded_http_protocol(limits),
            ws_max_size=limits.max_body_bytes,
            **uvicorn_kwargs,
        )
    )
