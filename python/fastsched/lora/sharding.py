"""Which slice of a LoRA adapter a tensor-parallel rank holds: its base layer's (vLLM's scheme).

- A column-parallel base (q/k/v, gate/up: output rows split) keeps ``A`` whole and the rows
  of ``B`` for its own outputs: the rank's outputs get ``x @ A.T @ B_r.T``, from the whole
  ``x`` every rank has.
- A row-parallel base (o, down: input columns split, all-reduced after) keeps the columns
  of ``A`` for its own inputs and ``B`` whole. The shrink splits over the inputs,
  ``x @ A.T = sum_r x_r @ A_r.T``, and the expand is linear, so each rank's
  ``x_r @ A_r.T @ B.T``, added to its partial output *before* the all-reduce, sums there to
  the whole delta, counted once. Nothing per rank is constant in ``x``: LoRA has no bias
  (``read_adapter_config`` refuses one), unlike the base layer, whose bias rank 0 alone adds.

The slices are cut by :func:`fastsched.models.tp_shard.shard_weight` under the base layer's
name (``B`` as a column-parallel weight, ``A`` as a row-parallel one), so an adapter is split
exactly as the model's own weights are, whatever the head bookkeeping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastsched.lora.adapter import LoRAAdapter
from fastsched.lora.adapter_checks import projection_shapes
from fastsched.models.config import ModelConfig
from fastsched.models.tp_shard import shard_weight

if TYPE_CHECKING:
    from fastsched.distributed.parallel import TensorParallel

# The projections whose base layer splits its outputs; the others (o_proj, down_proj) split inputs.
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def _base_name(layer: int, module: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"layers.{layer}.{block}.{module}.weight"


def local_projection_shapes(config: ModelConfig, tp: TensorParallel | None) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection as rank ``tp.rank`` holds it (the whole model's without ``tp``)."""
    shapes = projection_shapes(config)
    if tp is None:
        return shapes
    local = {}
    for module, (in_features, out_features) in shapes.items():
        shard = shard_weight(
            _base_name(0, module), torch.empty(out_features, in_features, device="meta"), config, tp
        )
        local[module] = (shard.shape[1], shard.shape[0])
    return local


def shard_adapter(adapter: LoRAAdapter, config: ModelConfig, tp: TensorParallel) -> LoRAAdapter:
    """Rank ``tp.rank``'s part of a whole adapter (as ``load_adapter`` returns it, scaling in ``B``)."""
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for layer, modules in enumerate(adapter.weights):
        sharded = {}
        for module, (a, b) in modules.items():
            name = _base_name(layer, module)
            if module in COLUMN_PARALLEL:
                sharded[module] = (a, shard_weight(name, b, config, tp).contiguous())
            else:
                sharded[module] = (shard_weight(name, a, config, tp).contiguous(), b)
        weights.append(sharded)
    return LoRAAdapter(adapter.id, adapter.rank, weights)
