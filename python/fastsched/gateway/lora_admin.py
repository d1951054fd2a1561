"""LoRA adapters over HTTP, as vLLM's: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, and the adapter cards of ``/v1/models``.

Every frontend keeps its own registry (fastsched.frontend.lora_registry), so a load or
an unload goes to all of them. When some accept and another refuses, the ones that
accepted are put back as they were, so the frontends never disagree on what is served.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from starlette.responses import Response

from fastsched.gateway.openai_protocol import ApiError, bad_request
from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()

# (rpc name, request) -> each frontend's reply or the error its call ended with
EachFrontend = Callable[[str, Any], Awaitable[list[Any]]]


def _string_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string, got {value!r}", name)
    return value


def _error(error: BaseException) -> ApiError:
    if not isinstance(error, grpc.aio.AioRpcError):
        return ApiError(500, f"a frontend failed: {error}", type="internal_error")
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(details, None)
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, details, type="invalid_request_error", param="lora_name", code="lora_not_found")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ApiError(409, details, type="invalid_request_error", param="lora_name", code="lora_in_use")
    return ApiError(503, f"a frontend could not be reached: {code.name}: {details}",
                    type="service_unavailable_error", code="frontend_unavailable")


class LoRAAdmin:
    def __init__(self, each: EachFrontend) -> None:
        self._each = each

    async def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of the adapters served, from the first frontend that answers."""
        for reply in await self._each("ListLoRAAdapters", pb.ListLoRAAdaptersRequest()):
            if not isinstance(reply, BaseException):
                return [(a.name, a.path) for a in reply.adapters]
        return []

    async def is_adapter(self, name: str) -> bool:
        return any(name == served for served, _ in await self.adapters())

    async def load(self, body: dict[str, Any]) -> Response:
        name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
        replies = await self._each("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            if len(errors) < len(replies):
                await self._each("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name))
            raise _error(errors[0])
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload(self, body: dict[str, Any]) -> Response:
        name = _string_field(body, "lora_name")
        path = dict(await self.adapters()).get(name)
        replies = await self._each("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name))
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            if len(errors) < len(replies) and path is not None:
                # Those that unloaded load it again (the others answer that it is loaded).
                await self._each("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
            raise _error(errors[0])
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
