"""The adapters a frontend serves by name: ``--lora-modules`` at start, then
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Clients choose an adapter with the OpenAI ``model`` field; the frontend turns the name
into a :class:`LoRARequest` that travels with the request to the engine, which reads
the adapter from its path the first time it sees its id. The id is derived from the
name and the path (a hash), not counted: every frontend of a server, and the same
frontend after a restart, gives one adapter one id without talking to the others, and
reloading a name with a new path gives it a new id (its old blocks and slot are never
mistaken for the new adapter's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

from fastsched.lora.request import LoRARequest, read_adapter_config


class LoRANotFoundError(ValueError):
    """The adapter name is not loaded (404)."""


class LoRAInUseError(ValueError):
    """The adapter still has requests in flight, so it cannot be unloaded (409)."""


def lora_id(name: str, path: str) -> int:
    """A stable positive 31-bit id for (name, path)."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1) + 1


class LoRARegistry:
    """Name -> :class:`LoRARequest`. ``in_use(name)`` counts the live requests of an
    adapter (the frontend's own bookkeeping), consulted before an unload."""

    def __init__(self, max_lora_rank: int, in_use: Callable[[str], int]) -> None:
        self.max_lora_rank = max_lora_rank
        self._in_use = in_use
        self._adapters: dict[str, LoRARequest] = {}

    @classmethod
    def from_modules(cls, modules: Mapping[str, str], max_lora_rank: int,
                     in_use: Callable[[str], int]) -> LoRARegistry:
        registry = cls(max_lora_rank, in_use)
        for name, path in modules.items():
            registry.load(name, path)
        return registry

    def load(self, name: str, path: str) -> LoRARequest:
        """Registers adapter ``name`` at ``path`` after checking its config (a bad one is
        a ValueError naming the field); a name already loaded is refused."""
        if not name:
            raise ValueError("lora_name must not be empty")
        if not path:
            raise ValueError("lora_path must not be empty")
        if name in self._adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        read_adapter_config(path, self.max_lora_rank)
        request = LoRARequest(name, lora_id(name, path), path)
        self._adapters[name] = request
        return request

    def unload(self, name: str) -> None:
        if name not in self._adapters:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        live = self._in_use(name)
        if live:
            raise LoRAInUseError(f"The lora adapter '{name}' is used by {live} request(s) in flight; "
                                 "unload it when they are done.")
        del self._adapters[name]

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())
