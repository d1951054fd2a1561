"""A linear layer whose weight stays 4-bit (``fastsched.kernels.quant_matmul``), swapped in
for an ``nn.Linear`` of the model once its checkpoint tensors are known to be quantized."""

from __future__ import annotations

import torch
from torch import nn

from fastsched.kernels.quant_matmul import Int4Weight, PackedInt4


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed for the device's int4 kernel; ``bias`` stays dense."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_packed = PackedInt4(weight, device)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_packed.matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.weight_packed.kind}"


def replace_linear(model: nn.Module, name: str, weight: Int4Weight, device: torch.device) -> QuantLinear:
    """Puts a :class:`QuantLinear` holding ``weight`` on ``device`` where the ``nn.Linear``
    ``name`` was, keeping its bias; the dense weight it had (if it was ever allocated) is freed."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != weight.shape:
        raise ValueError(f"{name} is not a linear layer of shape {weight.shape}")
    new = QuantLinear(weight, old.bias, device)
    setattr(parent, child, new)
    return new


def copy_weights(model: nn.Module, new: nn.Module) -> None:
    """Copies ``new``'s weights into ``model`` of the same architecture (weight reloads):
    dense tensors through ``load_state_dict``, packed 4-bit ones (not in a state dict) by
    layer. A mismatch raises ``RuntimeError`` naming the layer."""
    model.load_state_dict(new.state_dict())
    for name, module in new.named_modules():
        if isinstance(module, QuantLinear):
            old = model.get_submodule(name)
            if not isinstance(old, QuantLinear) or (old.out_features, old.in_features) != (
                    module.out_features, module.in_features):
                raise RuntimeError(f"{name}: the new weights are 4-bit of shape "
                                   f"{(module.out_features, module.in_features)}, the served layer is {old}")
            old.weight_packed = module.weight_packed
