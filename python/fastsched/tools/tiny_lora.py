"""A random LoRA adapter in PEFT's format for a given base checkpoint, for tests and demos.

``peft.PeftModel.from_pretrained`` loads the result onto ``transformers``' model of the
base, which makes it a correctness oracle for fastsched's LoRA path. PEFT initialises
``lora_B`` to zero (a fresh adapter changes nothing); here both halves are random, so
that each adapter visibly changes the base model's greedy outputs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from fastsched.lora.adapter_checks import projection_shapes
from fastsched.lora.request import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE
from fastsched.model_loader import load_model_config

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_tiny_lora(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    seed: int = 0,
    target_modules: Sequence[str] = TARGET_MODULES,
    lora_alpha: int | None = None,
) -> Path:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir``
    (created if needed) for the model in ``base_dir``; same arguments, same bytes."""
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown or not target_modules:
        raise ValueError(
            f"target_modules must be a non-empty subset of {list(TARGET_MODULES)}, got {unknown}"
        )
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    config = load_model_config(base_dir)
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in target_modules:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if module in _ATTENTION else 'mlp'}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, in_features, generator=generator
            ) / math.sqrt(in_features)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features, rank, generator=generator
            ) / math.sqrt(rank)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_dir).resolve()),
        "r": rank,
        "lora_alpha": lora_alpha if lora_alpha is not None else rank,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
