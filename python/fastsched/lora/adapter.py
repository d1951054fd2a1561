"""Loading a PEFT LoRA adapter into CPU tensors, checked against the base model.

PEFT stores ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``) per targeted
projection; the delta of a projection is ``x @ A.T @ B.T * scaling``. The scaling
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into ``B`` here, once, so
the forward pass does two matmuls and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastsched.lora.request import TENSOR_NAME, WEIGHTS_FILE, read_adapter_config, read_safetensors_header
from fastsched.models.config import ModelConfig


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU: ``weights[layer][module] = (A [r, in], B * scaling [out, r])``."""

    id: int
    rank: int
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def target_modules(self) -> set[str]:
        return {module for layer in self.weights for module in layer}


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


def load_adapter(path: str | Path, adapter_id: int, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter in directory ``path``: every tensor must belong to a
    layer and a projection of the model, with the shapes ``r`` and the model imply, hold
    finite numbers, and every targeted projection needs both A and B. Whatever is wrong
    with the files is a ``ValueError`` naming them (the request that names the adapter
    fails, never the engine); shapes are checked from the file's header before any
    tensor is read."""
    adapter_config = read_adapter_config(path, max_lora_rank)
    rank = adapter_config["r"]
    alpha = adapter_config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    shapes = projection_shapes(config)
    weights_file = Path(path) / WEIGHTS_FILE
    for name, info in read_safetensors_header(weights_file).items():
        match = TENSOR_NAME.search(name)
        if match is None or match[2] not in shapes or int(match[1]) >= config.num_layers:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name} has no place in {config.architecture}")
        in_features, out_features = shapes[match[2]]
        expected = (rank, in_features) if match[3] == "A" else (out_features, rank)
        if tuple(info["shape"]) != expected:
            raise ValueError(
                f"LoRA adapter {str(path)!r}: tensor {name} has shape {tuple(info['shape'])}, expected {expected}"
            )
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:  # safetensors raises its own error types (and OSError)
        raise ValueError(f"LoRA adapter weights {str(weights_file)!r} cannot be read: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = TENSOR_NAME.search(name)
        assert match is not None  # checked in the header above
        if not torch.isfinite(tensor).all():
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name} holds NaN or infinite values")
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {str(path)!r}: layers.{layer}.{module} has no {missing} tensor")
        weights[layer][module] = (pair["A"], pair["B"] * scaling)
    if not halves:
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return LoRAAdapter(adapter_id, rank, weights)
