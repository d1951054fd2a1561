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
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from fastsched.lora.adapter_checks import check_adapter_fits, check_finite
from fastsched.lora.request import WEIGHTS_FILE, LoRARequest, read_adapter_config, read_safetensors_header
from fastsched.models.config import ModelConfig


class LoRANotFoundError(ValueError):
    """The adapter name is not loaded (404)."""


class LoRAInUseError(ValueError):
    """The adapter still has requests in flight, so it cannot be unloaded (409)."""


def lora_id(name: str, path: str) -> int:
    """A stable positive 31-bit id for (name, path)."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1) + 1


class _UsesAdapter(Protocol):
    lora_name: str | None


class LoRARegistry:
    """Name -> :class:`LoRARequest`, and how many requests in flight use each adapter
    (consulted before an unload), counted from the request table's ``added`` and
    ``finished`` events (``request_started`` / ``request_finished``)."""

    def __init__(self, max_lora_rank: int, model_config: ModelConfig | None = None) -> None:
        self.max_lora_rank = max_lora_rank
        self.model_config = model_config  # the served model's, which an adapter must fit
        self._adapters: dict[str, LoRARequest] = {}
        self._in_use: Counter[str] = Counter()

    @classmethod
    def from_modules(
        cls, modules: Mapping[str, str], max_lora_rank: int, model_config: ModelConfig | None = None
    ) -> LoRARegistry:
        registry = cls(max_lora_rank, model_config)
        for name, path in modules.items():
            registry.load(name, path)
        return registry

    def load(self, name: str, path: str) -> LoRARequest:
        """Registers adapter ``name`` at ``path`` after checking its config and, given the
        served model's config, that its tensors fit the model and are finite (a bad one is a
        ValueError naming the field or tensor: never listed, so no request fails on it);
        a name already loaded is refused."""
        if not name:
            raise ValueError("lora_name must not be empty")
        if not path:
            raise ValueError("lora_path must not be empty")
        if name in self._adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        rank = read_adapter_config(path, self.max_lora_rank)["r"]
        if self.model_config is not None:
            weights_file = Path(path) / WEIGHTS_FILE
            header = read_safetensors_header(weights_file)
            check_adapter_fits(path, header, rank, self.model_config)
            check_finite(path, weights_file, header)
        request = LoRARequest(name, lora_id(name, path), path)
        self._adapters[name] = request
        return request

    def unload(self, name: str) -> None:
        if name not in self._adapters:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        live = self._in_use[name]
        if live:
            raise LoRAInUseError(
                f"The lora adapter '{name}' is used by {live} request(s) in flight; "
                "unload it when they are done."
            )
        del self._adapters[name]

    def in_use(self, name: str) -> int:
        """Requests in flight that run with adapter ``name``."""
        return self._in_use[name]

    def request_started(self, request: _UsesAdapter) -> None:
        if request.lora_name is not None:
            self._in_use[request.lora_name] += 1

    def request_finished(self, request: _UsesAdapter, error: str | None = None, counted: bool = True) -> None:
        if request.lora_name is not None:
            self._in_use[request.lora_name] -= 1
            if not self._in_use[request.lora_name]:
                del self._in_use[request.lora_name]

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())
