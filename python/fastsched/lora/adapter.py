"""Loading a PEFT LoRA adapter into CPU tensors, checked against the base model.

PEFT stores ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``) per targeted
projection; the delta of a projection is ``x @ A.T @ B.T * scaling``. The scaling
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into ``B`` here, once, so
the forward pass does two matmuls and nothing else.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastsched.lora.request import WEIGHTS_FILE, read_adapter_config
from fastsched.models.config import ModelConfig

# e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_TENSOR_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


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
    layer and a projection of the model, with the shapes ``r`` and the model imply, and
    every targeted projection needs both A and B."""
    adapter_config = read_adapter_config(path, max_lora_rank)
    rank = adapter_config["r"]
    alpha = adapter_config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(Path(path) / WEIGHTS_FILE)).items():
        match = _TENSOR_NAME.search(name)
        if match is None or match[2] not in shapes or int(match[1]) >= config.num_layers:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name} has no place in {config.architecture}")
        layer, module, half = int(match[1]), match[2], match[3]
        in_features, out_features = shapes[module]
        expected = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"LoRA adapter {str(path)!r}: tensor {name} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        halves.setdefault((layer, module), {})[half] = tensor.float()
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {str(path)!r}: layers.{layer}.{module} has no {missing} tensor")
        weights[layer][module] = (pair["A"], pair["B"] * scaling)
    if not halves:
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return LoRAAdapter(adapter_id, rank, weights)
