"""``POST /reset_prefix_cache`` (vLLM's route): every engine forgets its cached prefixes, so
that what follows (a benchmark at the next rate, a timing run) starts from a cold cache.
Served only with ``--enable-admin-api`` (a 404 otherwise, as an unknown route), and behind
``--api-key``. Requests in flight keep their blocks; a 200 means every engine has reset."""

from __future__ import annotations

import asyncio

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastsched.gateway.openai_protocol import ApiError
from fastsched.proto_gen import import_stubs

pb, pb_grpc = import_stubs()

_CALL_TIMEOUT_S = 10.0  # longer than a frontend's wait for its engines (engine_timeout, 5 s by default)


async def reset_prefix_cache(request: Request) -> Response:
    gateway = request.app.state.gateway
    gateway._check_api_key(request)
    pool = gateway.pool
    await pool.start()
    replies = await asyncio.gather(
        *(f.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=_CALL_TIMEOUT_S, metadata=pool.metadata)
          for f in pool.frontends),
        return_exceptions=True,
    )
    failed = {f.address: _describe(r) for f, r in zip(pool.frontends, replies) if isinstance(r, BaseException)}
    if failed:
        raise ApiError(503, f"ResetPrefixCache failed on frontend(s): {failed}", type="service_unavailable",
                       code="frontend_unavailable", headers={"Retry-After": str(gateway.retry_after_s)})
    return JSONResponse({"reset": True})


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
