"""The gateway's K frontends: one gRPC channel each, least-loaded routing (ties broken
round-robin), skipping a frontend that cannot be reached, and ``each``: the one fan-out that
asks every frontend at once (health, stats, admin calls, request status, LoRA adapters).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from fastsched.gateway.errors import (
    FRONTEND_UNAVAILABLE,
    MAX_CONCURRENT_STREAMS,
    api_error_from_rpc,
    rpc_metadata,
    unavailable,
)
from fastsched.proto_gen import import_stubs
from fastsched.rpc import AUTHORIZATION_KEY, MESSAGE_SIZE_OPTIONS, REJECTION_REASON_KEY

pb, pb_grpc = import_stubs()

logger = logging.getLogger("fastsched.gateway")

__all__ = ["Frontend", "FrontendPool", "FrontendStream", "PROBE_TIMEOUT_S", "STATUS_TIMEOUT_S"]

PROBE_TIMEOUT_S = 2.0
STATUS_TIMEOUT_S = 10.0  # longer than a frontend's wait for its engine (engine_timeout, 5 s by default)
_CHANNEL_OPTIONS = [
    ("grpc.enable_http_proxy", 0),  # frontends are local: never route through $http_proxy
    *MESSAGE_SIZE_OPTIONS,
]


class Frontend:
    """One frontend's channel and the number of this gateway's requests in flight on it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.FrontendStub(self.channel)
        self.outstanding = 0


class FrontendStream:
    """A Generate call whose first response has arrived; iterate for the rest. The
    message that carries ``usage`` is the call's last (the frontend sends usage when the
    request ends), so iteration stops there without waiting for the call's status."""

    def __init__(self, frontend: Frontend, call: Any, first: Any) -> None:
        self.frontend, self.call, self.first = frontend, call, first
        self._released = False
        self._finished = False  # the last message arrived: nothing left to cancel

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.frontend.outstanding -= 1

    def cancel(self) -> None:
        """Cancels the call (the frontend then aborts the request in the engine) unless
        its last message arrived."""
        if not self._finished and not self.call.done():
            self.call.cancel()
        self._release()

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            msg = self.first
            while msg is not grpc.aio.EOF:
                self._finished = msg.HasField("usage")
                yield msg
                if self._finished:
                    return
                msg = await self.call.read()
        finally:
            self.cancel()


class FrontendPool:
    """The K frontends. Channels are made in ``start`` (inside the serving event loop)."""

    def __init__(self, addresses: Sequence[str], api_key: str | None = None) -> None:
        if not addresses:
            raise ValueError("frontend_addrs must name at least one frontend")
        self.addresses = list(addresses)
        # Sent on every call: the frontends' gRPC ports require the key the gateway does.
        self.metadata = ((AUTHORIZATION_KEY, f"Bearer {api_key}"),) if api_key is not None else ()
        self.frontends: list[Frontend] = []
        self._next = 0
        self._model_info: dict[str, Any] | None = None

    async def start(self) -> None:
        if not self.frontends:
            self.frontends = [Frontend(address) for address in self.addresses]

    async def close(self) -> None:
        frontends, self.frontends = self.frontends, []
        await asyncio.gather(*(f.channel.close() for f in frontends), return_exceptions=True)

    def pick(self) -> Frontend:
        """The frontend a new call goes to (a session's, which is not retried elsewhere)."""
        return self.order()[0]

    def order(self) -> list[Frontend]:
        """Least outstanding first; equal counts in round-robin order."""
        k = len(self.frontends)
        start, self._next = self._next, (self._next + 1) % k
        rotated = [self.frontends[(start + i) % k] for i in range(k)]
        return sorted(rotated, key=lambda f: f.outstanding)  # stable: keeps the rotation among ties

    async def open(self, request: Any, retry_after_s: int) -> FrontendStream:
        """Starts ``request`` on a frontend and waits for its first response (or its error)."""
        await self.start()
        last_error: grpc.aio.AioRpcError | None = None
        reason = FRONTEND_UNAVAILABLE
        for frontend in self.order():
            call = frontend.stub.Generate(request, metadata=self.metadata)
            frontend.outstanding += 1
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                frontend.outstanding -= 1
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # at max_concurrent_streams: try another
                    reason, last_error = MAX_CONCURRENT_STREAMS, e
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE and REJECTION_REASON_KEY not in rpc_metadata(e):
                    logger.warning("frontend %s unreachable: %s", frontend.address, e.details())
                    last_error = e
                    continue
                raise api_error_from_rpc(e, retry_after_s) from e
            except BaseException:  # cancelled (client gone) while waiting for the first token
                call.cancel()
                frontend.outstanding -= 1
                raise
            return FrontendStream(frontend, call, first)
        raise unavailable(reason, retry_after_s) from last_error

    async def stats_by_frontend(self) -> list[Any | BaseException]:
        """Each frontend's GetStats reply, or the error its call ended with (the launcher's
        liveness probe: a hung frontend times out, a dead engine shows as ``dead``)."""
        return await self.each("GetStats", pb.GetStatsRequest())

    async def each(
        self,
        rpc: str,
        request: Any,
        timeout: float = PROBE_TIMEOUT_S,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> list[Any | BaseException]:
        """The fan-out: ``rpc`` on every frontend at once; each one's reply or the error its call
        ended with, in frontend order. ``metadata``: instead of the API key's (an admin call's)."""
        await self.start()
        sent = self.metadata if metadata is None else tuple(metadata)
        calls = [getattr(f.stub, rpc)(request, timeout=timeout, metadata=sent) for f in self.frontends]
        return await asyncio.gather(*calls, return_exceptions=True)

    async def model_info(self) -> dict[str, Any] | None:
        """The served model's limits from the first frontend that answers; cached."""
        if self._model_info is None:
            for reply in await self.each("ModelInfo", pb.ModelInfoRequest()):
                if not isinstance(reply, BaseException):
                    self._model_info = {
                        "model": reply.model,
                        "max_model_len": reply.max_model_len,
                        "vocab_size": reply.vocab_size,
                    }
                    break
        return self._model_info

    async def health(self) -> dict[str, str]:
        replies = await self.each("Health", pb.HealthRequest())
        return {
            f.address: "unreachable"
            if isinstance(r, BaseException)
            else pb.ServingStatus.Name(r.status).lower()
            for f, r in zip(self.frontends, replies)
        }

    async def request_status(
        self, request_id: str, retry_after_s: int, metadata: Sequence[tuple[str, str]] | None = None
    ) -> dict[str, Any] | None:
        """Where ``request_id`` is, from the frontend that knows it (the latest arrival if several
        do: an id reused after a rejection); None when every frontend answers NOT_FOUND."""
        replies = await self.each(
            "GetRequestStatus", pb.RequestStatusRequest(request_id=request_id), STATUS_TIMEOUT_S, metadata
        )
        found = [
            json_format.MessageToDict(r, preserving_proto_field_name=True)
            for r in replies
            if not isinstance(r, BaseException)
        ]
        if found:
            return max(found, key=lambda status: status.get("metrics", {}).get("arrival_time", 0.0))
        for reply in replies:  # a frontend that could not answer might know it: not a 404
            if not isinstance(reply, grpc.aio.AioRpcError):
                raise reply
            if reply.code() != grpc.StatusCode.NOT_FOUND:
                raise api_error_from_rpc(reply, retry_after_s) from reply
        return None

    async def stats(self) -> list[Any]:
        replies = await self.each("GetStats", pb.GetStatsRequest())
        for f, r in zip(self.frontends, replies):
            if isinstance(r, BaseException):
                logger.warning("GetStats from %s failed: %s", f.address, r)
        return [r for r in replies if not isinstance(r, BaseException)]
