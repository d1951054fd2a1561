"""``POST /pause?mode=new|all``, ``POST /resume``, ``GET /is_paused`` and ``POST /reload_weights``
(S13): admin routes, there only with ``--enable-admin-api``, behind ``--admin-api-key``
(``fastsched.admin``).

Each asks every frontend (gRPC ``Pause`` / ``Resume`` / ``IsPaused``), and each frontend
every engine, so one call pauses the whole server, D engines included; a frontend answers
once its engines have confirmed the state, so a 200 means the pause is in force. ``new``:
running requests finish, waiting ones stay queued; ``all``: nothing is scheduled and
running requests keep their KV (an RL trainer swapping weights between rollouts).
Requests are still admitted while paused (and count toward ``max_num_queued_reqs``);
``/health`` stays 200. The answer: ``{"is_paused": bool, "engines": {index: state}}``.

``POST /reload_weights`` with ``{"path": checkpoint}`` loads new weights into every engine
(a checkpoint of the served architecture, a path the engines can read) and drops their prefix
caches, whose KV the new weights make stale: the RL loop is pause (all), reload, resume. It is
a 409 unless the server is paused with mode ``all``, a 400 when the weights do not fit, a 403
for a path outside ``--allowed-local-paths``.
"""

from __future__ import annotations

from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastsched.engine.protocol import PAUSE_MODES
from fastsched.gateway.auth import ADMIN
from fastsched.gateway.errors import FRONTEND_UNAVAILABLE, api_error_from_rpc, unavailable
from fastsched.gateway.openai_protocol import bad_request
from fastsched.proto_gen import import_stubs

pb, pb_grpc = import_stubs()

_CALL_TIMEOUT_S = 10.0  # longer than a frontend's wait for its engines (engine_timeout, 5 s by default)
_RELOAD_TIMEOUT_S = 660.0  # longer than a frontend's wait for a reload (AsyncLLM.reload_weights, 600 s)


async def pause(request: Request) -> Response:
    mode = request.query_params.get("mode", "all")
    if mode not in PAUSE_MODES:
        raise bad_request(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
    return await _call_all(request, "Pause", pb.PauseRequest(mode=mode))


async def resume(request: Request) -> Response:
    return await _call_all(request, "Resume", pb.ResumeRequest())


async def is_paused(request: Request) -> Response:
    return await _call_all(request, "IsPaused", pb.IsPausedRequest())


async def reload_weights(request: Request) -> Response:
    """``{"path": checkpoint}``: new weights on every engine, only while paused with mode all (else 409)."""
    gateway = request.app.state.gateway
    body, _ = await gateway.read_json(request)
    model = body.get("path")
    if not isinstance(model, str) or not model:
        raise bad_request("path must name the checkpoint to load (a path the engines can read)", "path")
    gateway.admin.check_local_path(model, "path")
    replies = await gateway.pool.each(
        "ReloadWeights", pb.ReloadWeightsRequest(model=model), _RELOAD_TIMEOUT_S, gateway.auth.metadata(ADMIN)
    )
    errors = [reply for reply in replies if isinstance(reply, BaseException)]
    if errors:
        error = api_error_from_rpc(errors[0], gateway.retry_after_s)
        if error.param == "model":  # the gRPC field; the HTTP body calls it path
            error.param = "path"
        if error.code == "not_paused":
            error.message += "; POST /pause?mode=all first"
        raise error
    return JSONResponse({"reloaded": True, "path": model})


async def _call_all(request: Request, rpc: str, message: Any) -> Response:
    """``rpc`` on every frontend; 503 naming the frontends that could not do it."""
    gateway = request.app.state.gateway
    pool = gateway.pool
    replies = await pool.each(rpc, message, _CALL_TIMEOUT_S, gateway.auth.metadata(ADMIN))
    failed = {
        f.address: _describe(r) for f, r in zip(pool.frontends, replies) if isinstance(r, BaseException)
    }
    if failed:
        error = api_error_from_rpc(
            next(r for r in replies if isinstance(r, BaseException)), gateway.retry_after_s
        )
        if error.status >= 500:  # say which frontends could not do it
            error = unavailable(FRONTEND_UNAVAILABLE, gateway.retry_after_s)
            error.message = f"{rpc} failed on frontend(s): {failed}. {error.message}"
        raise error
    engines: dict[str, str] = {}
    for reply in replies:
        engines.update({str(index): state for index, state in reply.engines.items()})
    return JSONResponse(
        {
            "is_paused": any(r.paused for r in replies),
            "engines": dict(sorted(engines.items(), key=lambda kv: int(kv[0]))),
        }
    )


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
