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

from fastsched.lora.adapter_checks import check_adapter_fits, check_finite
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


def load_adapter(path: str | Path, adapter_id: int, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter in directory ``path``: every tensor must belong to a
    layer and a projection of the model, with the shapes ``r`` and the model imply, hold
    finite numbers, and every targeted projection needs both A and B (the frontend ran the
    same checks, ``fastsched.lora.adapter_checks``, when the adapter was registered).
    Whatever is wrong with the files is a ``ValueError`` naming them (the request that
    names the adapter fails, never the engine); shapes are checked from the file's header
    before any tensor is read."""
    adapter_config = read_adapter_config(path, max_lora_rank)
    rank = adapter_config["r"]
    alpha = adapter_config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    weights_file = Path(path) / WEIGHTS_FILE
    header = read_safetensors_header(weights_file)
    check_adapter_fits(path, header, rank, config)
    check_finite(path, weights_file, header)
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:  # safetensors raises its own error types (and OSError)
        raise ValueError(f"LoRA adapter weights {str(weights_file)!r} cannot be read: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = TENSOR_NAME.search(name)
        assert match is not None  # checked in the header above
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for (layer, module), pair in sorted(halves.items()):  # whole pairs (check_adapter_fits), at least one
        weights[layer][module] = (pair["A"], pair["B"] * scaling)
    return LoRAAdapter(adapter_id, rank, weights)
