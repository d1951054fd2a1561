"""``POST /reset_prefix_cache`` (vLLM's route): every engine forgets its cached prefixes, so
that what follows (a benchmark at the next rate, a timing run) starts from a cold cache.
An admin route (``fastsched.admin``): served only with ``--enable-admin-api`` (a 404 otherwise,
as an unknown route), behind ``--admin-api-key``. Requests in flight keep their blocks; a 200
means every engine has reset."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastsched.gateway.auth import ADMIN
from fastsched.gateway.errors import FRONTEND_UNAVAILABLE, api_error_from_rpc, unavailable
from fastsched.proto_gen import import_stubs

pb, pb_grpc = import_stubs()

_CALL_TIMEOUT_S = 10.0  # longer than a frontend's wait for its engines (engine_timeout, 5 s by default)


async def reset_prefix_cache(request: Request) -> Response:
    gateway = request.app.state.gateway
    replies = await gateway.pool.each(
        "ResetPrefixCache", pb.ResetPrefixCacheRequest(), _CALL_TIMEOUT_S, gateway.auth.metadata(ADMIN)
    )
    failed = [r for r in replies if isinstance(r, BaseException)]
    if failed:
        error = api_error_from_rpc(failed[0], gateway.retry_after_s)
        if error.status >= 500:
            error = unavailable(FRONTEND_UNAVAILABLE, gateway.retry_after_s)
            error.message = f"ResetPrefixCache failed on {len(failed)} frontend(s). {error.message}"
        raise error
    return JSONResponse({"reset": True})
