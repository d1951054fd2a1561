"""Naming an adapter (:class:`LoRARequest`) and checking its directory without torch.

The frontend, the gateway and the CLI use this module: they must be able to register
an adapter and refuse a bad one (400) before anything reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of a Llama-family layer an adapter may target (PEFT's module names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# adapter_config.json fields that would change what the adapter computes, and the values
# that leave it plain LoRA (PEFT writes all of them, mostly as their defaults).
_PLAIN_LORA: dict[str, tuple[Any, ...]] = {
    "use_dora": (None, False),
    "bias": (None, "none"),
    "modules_to_save": (None, []),
    "fan_in_fan_out": (None, False),
    "layers_to_transform": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
}


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as vLLM's: ``name`` for people and the API, ``id`` (>= 1)
    for the scheduler (S7 slots, S8 prefix-cache roots), ``path`` a PEFT directory.

    Requests with the same ``id`` share the adapter's slot and cache entry, so one id
    must always mean one path."""

    name: str
    id: int
    path: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("LoRARequest.name must not be empty")
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 1:
            raise ValueError(f"LoRARequest.id must be an integer >= 1, got {self.id!r}")
        if not self.path:
            raise ValueError(f"LoRARequest.path of adapter {self.name!r} must not be empty")


def read_adapter_config(path: str | Path, max_lora_rank: int) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, checked for what fastsched can apply: plain
    LoRA (no DoRA, no bias, no extra trained modules) of rank <= ``max_lora_rank`` on
    :data:`TARGET_MODULES`. Errors name the directory and the offending field."""
    directory = Path(path)
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {CONFIG_FILE}")
    if not (directory / WEIGHTS_FILE).is_file():
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {str(directory)!r}: {CONFIG_FILE} is not JSON ({e})") from None

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"LoRA adapter {str(directory)!r}: {field} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {config['peft_type']!r}; only LORA is supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise bad("r", f"must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise bad("r", f"is {rank}, more than max_lora_rank ({max_lora_rank})")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise bad("target_modules", f"must be a list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise bad("target_modules", f"names {unknown}; supported: {list(TARGET_MODULES)}")
    for field, allowed in _PLAIN_LORA.items():
        if config.get(field) not in allowed:
            raise bad(field, f"is {config[field]!r}, which fastsched does not support")
    return config
