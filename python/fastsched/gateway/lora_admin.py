"""LoRA adapters over HTTP, as vLLM's: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (admin routes: there only with
``--enable-runtime-lora-updating``, behind ``--admin-api-key``; an adapter's path must lie under
``--allowed-local-paths``, ``fastsched.admin``), and the adapter cards of ``/v1/models``.

Every frontend keeps its own registry (fastsched.frontend.lora_registry), so a load or
an unload goes to all of them. When some accept and another refuses, the ones that
accepted are put back as they were, so the frontends never disagree on what is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import Response

from fastsched.admin import AdminSettings
from fastsched.gateway.errors import api_error_from_rpc
from fastsched.gateway.openai_protocol import bad_request
from fastsched.gateway.pool import FrontendPool
from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()


def _string_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string, got {value!r}", name)
    return value


class LoRAAdmin:
    """The adapters of every frontend of ``pool``, through its fan-out (``FrontendPool.each``)."""

    def __init__(
        self,
        pool: FrontendPool,
        retry_after_s: int = 1,
        admin: AdminSettings | None = None,
        admin_metadata: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        self.pool = pool
        self.retry_after_s = retry_after_s
        self.admin = admin or AdminSettings()
        self._admin_metadata = admin_metadata  # loads and unloads are admin calls

    async def _admin_each(self, rpc: str, request: Any) -> list[Any]:
        return await self.pool.each(rpc, request, metadata=self._admin_metadata)

    async def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of the adapters served, from the first frontend that answers."""
        for reply in await self.pool.each("ListLoRAAdapters", pb.ListLoRAAdaptersRequest()):
            if not isinstance(reply, BaseException):
                return [(a.name, a.path) for a in reply.adapters]
        return []

    async def is_adapter(self, name: str) -> bool:
        return any(name == served for served, _ in await self.adapters())

    async def load(self, body: dict[str, Any]) -> Response:
        name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
        self.admin.check_local_path(path, "lora_path")
        replies = await self._admin_each(
            "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        )
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            if len(errors) < len(replies):
                await self._admin_each("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name))
            raise api_error_from_rpc(errors[0], self.retry_after_s)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload(self, body: dict[str, Any]) -> Response:
        name = _string_field(body, "lora_name")
        path = dict(await self.adapters()).get(name)
        replies = await self._admin_each("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name))
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            if len(errors) < len(replies) and path is not None:
                # Those that unloaded load it again (the others answer that it is loaded).
                await self._admin_each(
                    "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
                )
            raise api_error_from_rpc(errors[0], self.retry_after_s)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
