"""Naming an adapter (:class:`LoRARequest`) and checking its directory without torch.

The frontend, the gateway and the CLI use this module: they must be able to register
an adapter and refuse a bad one (400) before anything reaches the engine.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
TENSOR_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# safetensors: an 8-byte little-endian header length, a JSON header, then the tensors' bytes.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# A LoRA adapter's header lists a few hundred tensors; a larger header is not an adapter.
MAX_HEADER_BYTES = 16 * 2**20
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
    except OSError as e:
        raise ValueError(f"LoRA adapter {str(directory)!r}: {CONFIG_FILE} cannot be read ({e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(directory)!r}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(directory)!r}: {CONFIG_FILE} is not a JSON object")

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
    check_adapter_weights(directory / WEIGHTS_FILE, rank)
    return config


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file lists (name -> dtype, shape, data_offsets), checked
    against the file: a sound header whose tensors, of a float dtype, exactly tile the bytes
    after it. ``ValueError`` naming the file for anything else (empty, truncated, not
    safetensors), so that a bad file is refused before anything reads its tensors."""

    def bad(why: str) -> ValueError:
        return ValueError(f"LoRA adapter weights {str(path)!r} {why}")

    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise bad(f"are not a safetensors file: {size} bytes")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise bad(
                    "are not a safetensors file: the header length its first 8 bytes give exceeds the file"
                )
            header = json.loads(f.read(header_len))  # errors below never quote the file's bytes
    except OSError as e:
        raise bad(f"cannot be read: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("are not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("are not a safetensors file: its header is not an object")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"hold tensor {name} with a malformed entry (not an object)")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise bad(
                f"hold tensor {name} of dtype {dtype!r}; LoRA weights are one of {sorted(_DTYPE_BYTES)}"
            )
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        ):
            raise bad(f"hold tensor {name} with a malformed entry (shape or data_offsets)")
        if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype] or offsets[0] < 0:
            raise bad(
                f"hold tensor {name} whose bytes {offsets} do not match its shape {shape} and dtype {dtype}"
            )
        spans.append((offsets[0], offsets[1]))
    spans.sort()
    end = 0
    for start, stop in spans:
        if start != end:
            raise bad("are not a safetensors file: its tensors' bytes overlap or leave gaps")
        end = stop
    if 8 + header_len + end != size:
        raise bad(f"are truncated or padded: {size} bytes, the header says {8 + header_len + end}")
    return header


def check_adapter_weights(path: Path, rank: int) -> None:
    """The adapter's weights file, checked without loading its tensors: a sound safetensors
    file (:func:`read_safetensors_header`) of PEFT LoRA tensors (``lora_A`` ``[r, in]``,
    ``lora_B`` ``[out, r]``), at least one. The engine checks the in and out sizes against
    the model when it loads the adapter."""
    header = read_safetensors_header(path)
    if not header:
        raise ValueError(f"LoRA adapter weights {str(path)!r} hold no tensors")
    for name, info in header.items():
        match = TENSOR_NAME.search(name)
        if match is None or match[2] not in TARGET_MODULES:
            raise ValueError(
                f"LoRA adapter weights {str(path)!r}: tensor {name} is not a LoRA tensor of "
                f"{list(TARGET_MODULES)}"
            )
        shape = info["shape"]
        if len(shape) != 2 or shape[0 if match[3] == "A" else 1] != rank:
            raise ValueError(
                f"LoRA adapter weights {str(path)!r}: tensor {name} has shape {shape}, not that of a "
                f"lora_{match[3]} of rank r={rank}"
            )
