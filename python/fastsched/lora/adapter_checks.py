"""An adapter's tensors checked against the served model and for finite values, without torch.

The frontend runs these when an adapter is registered (``--lora-modules``,
``/v1/load_lora_adapter``), so an adapter that can never be applied (a tensor for a layer
or projection the model lacks, a shape that does not fit, a NaN or an infinity) is refused
with a 400 there, instead of being listed and then failing every request that names it;
the engine runs the same checks when it reads the adapter (``fastsched.lora.adapter``).
Finiteness is read from the raw bits (exponent all ones), so bfloat16 needs no torch.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from fastsched.lora.request import TENSOR_NAME
from fastsched.models.config import ModelConfig

# safetensors dtype -> (the unsigned integer of its width, the exponent bits).
_EXPONENT_MASKS = {
    "F64": (np.uint64, 0x7FF0000000000000),
    "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
}


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-targetable projection of a layer."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_adapter_fits(
    path: str | Path, header: dict[str, dict[str, Any]], rank: int, config: ModelConfig
) -> None:
    """Every tensor the weights file's ``header`` lists belongs to a layer and a projection of
    the model, with the shape ``rank`` and the model imply, and each projection has both A
    and B; ``ValueError`` naming the tensor otherwise."""
    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], set[str]] = {}
    for name, info in header.items():
        match = TENSOR_NAME.search(name)
        if match is None or match[2] not in shapes or int(match[1]) >= config.num_layers:
            raise ValueError(
                f"LoRA adapter {str(path)!r}: tensor {name} has no place in "
                f"{config.architecture} ({config.num_layers} layers)"
            )
        in_features, out_features = shapes[match[2]]
        expected = (rank, in_features) if match[3] == "A" else (out_features, rank)
        if tuple(info["shape"]) != expected:
            raise ValueError(
                f"LoRA adapter {str(path)!r}: tensor {name} has shape "
                f"{tuple(info['shape'])}, expected {expected}"
            )
        halves.setdefault((int(match[1]), match[2]), set()).add(match[3])
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {str(path)!r}: layers.{layer}.{module} has no {missing} tensor")


def check_finite(path: str | Path, weights_file: Path, header: dict[str, dict[str, Any]]) -> None:
    """``ValueError`` naming the first tensor of ``weights_file`` (whose checked ``header``
    is given) that holds a NaN or an infinity."""
    with open(weights_file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            unsigned, mask = _EXPONENT_MASKS[info["dtype"]]
            start, stop = info["data_offsets"]
            f.seek(8 + header_len + start)
            bits = np.frombuffer(f.read(stop - start), dtype=np.dtype(unsigned).newbyteorder("<"))
            if np.any((bits & unsigned(mask)) == unsigned(mask)):
                raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name} holds NaN or infinite values")
