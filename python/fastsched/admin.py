"""Who may run the server's admin operations, and on which files (docs/serving.md, "Admin API").

Admin operations change what the server does for everyone: pause and resume (S13), reload the
weights, reset the prefix caches, load and unload LoRA adapters, and look into requests (``/debug/*``). As vLLM does
(its dev mode and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), they are off unless enabled:
``--enable-admin-api`` turns on pause/resume/reload/debug, ``--enable-runtime-lora-updating``
the adapter loads. They take their own key, ``--admin-api-key`` (the inference ``--api-key``
never grants them), and a file they name must lie under one of ``--allowed-local-paths``,
whatever the symlinks on the way, and so must every file in a directory it names: the answer
for a path outside never says whether it exists.
The gateway's routes and the frontends' gRPC methods apply the same :class:`AdminSettings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ADMIN_RPCS", "LORA_RPCS", "AdminSettings", "PathNotAllowedError"]

# The frontends' gRPC methods each switch turns on.
ADMIN_RPCS = frozenset(
    {"Pause", "Resume", "IsPaused", "ReloadWeights", "ResetPrefixCache", "GetRequestStatus"}
)
LORA_RPCS = frozenset({"LoadLoRAAdapter", "UnloadLoRAAdapter"})


class PathNotAllowedError(ValueError):
    """A file an admin request names lies outside ``--allowed-local-paths`` (403)."""

    code = "path_not_allowed"

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AdminSettings:
    enable_admin_api: bool = False  # pause, resume, is_paused, reload_weights, reset_prefix_cache, /debug/*
    enable_runtime_lora_updating: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    admin_api_key: str | None = None  # required by every admin operation when set
    allowed_local_paths: tuple[str, ...] = ()  # directories the named files must lie under

    def __post_init__(self) -> None:
        if self.admin_api_key is not None and not self.admin_api_key.strip():
            raise ValueError("admin_api_key must not be empty")
        for path in self.allowed_local_paths:
            if not os.path.isabs(path):
                raise ValueError(f"allowed_local_paths must be absolute directories, got {path!r}")

    def check_keys(self, api_key: str | None) -> None:
        """``ValueError`` when admin operations are on and only the inference key guards the server:
        they would be open to anyone while inference needs a key."""
        if (
            (self.enable_admin_api or self.enable_runtime_lora_updating)
            and api_key is not None
            and self.admin_api_key is None
        ):
            raise ValueError(
                "--enable-admin-api / --enable-runtime-lora-updating with --api-key need "
                "--admin-api-key or --admin-api-key-file: the API key never grants admin operations"
            )

    def enabled(self, rpc: str) -> bool:
        """Whether the gRPC method ``rpc`` is served (every method outside the two sets is)."""
        if rpc in ADMIN_RPCS:
            return self.enable_admin_api
        if rpc in LORA_RPCS:
            return self.enable_runtime_lora_updating
        return True

    def is_admin(self, rpc: str) -> bool:
        return rpc in ADMIN_RPCS or rpc in LORA_RPCS

    def check_local_path(self, path: str, field: str) -> str:
        """``path`` resolved (symlinks followed), when it lies under an allowed directory and,
        for a directory (a checkpoint, an adapter), so does every file in it once resolved:
        the loaders open those by name, and a link to a file elsewhere would be read through.
        Else :class:`PathNotAllowedError`, whose message is the same whether or not ``path`` exists."""
        where = ", ".join(self.allowed_local_paths) if self.allowed_local_paths else "nowhere: none is set"
        resolved = os.path.realpath(path)
        if not self._allowed(resolved):
            raise PathNotAllowedError(
                f"{field} must lie under one of the server's --allowed-local-paths ({where})", field
            )
        if os.path.isdir(resolved):
            with os.scandir(resolved) as entries:
                for entry in entries:
                    if not self._allowed(os.path.realpath(entry.path)):
                        raise PathNotAllowedError(
                            f"{field} holds {entry.name!r}, a link that leaves the server's "
                            f"--allowed-local-paths ({where})",
                            field,
                        )
        return resolved

    def _allowed(self, resolved: str) -> bool:
        for root in self.allowed_local_paths:
            base = os.path.realpath(root)
            if os.path.commonpath([base, resolved]) == base:
                return True
        return False
