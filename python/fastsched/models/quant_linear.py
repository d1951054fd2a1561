"""A linear layer whose weight stays 4- or 8-bit (``fastsched.kernels.quant_matmul``), swapped
in for an ``nn.Linear`` of the model once its checkpoint tensors are known to be quantized,
and an embedding that stays 8-bit (a GGUF's Q8_0 token embedding, tied to the lm_head)."""

from __future__ import annotations

import torch
from torch import nn

from fastsched.kernels.quant_matmul import Int4Weight, Int8Weight, PackedInt4, PackedInt8


def pack(weight: Int4Weight | Int8Weight, device: torch.device) -> PackedInt4 | PackedInt8:
    return PackedInt4(weight, device) if isinstance(weight, Int4Weight) else PackedInt8(weight, device)


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed for the device's int4 / int8 kernel; ``bias`` stays dense."""

    def __init__(
        self, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None, device: torch.device
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_packed = pack(weight, device)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_packed.matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.weight_packed.kind}"


class QuantEmbedding(nn.Module):
    """A token embedding kept 8-bit: a lookup dequantizes only the rows it gathers, and a
    tied lm_head (:meth:`logits`) runs the int8 matmul on the same codes."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.weight_packed = PackedInt8(weight, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_packed.rows(ids, self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits: the kernels sum in float32, and rounding 49k logits to bf16 (a step
        of 1/8 at |logit| ≥ 16) ties close candidates, which greedy decoding then breaks by
        token id (SmolLM2's chat answer flipped on such a tie)."""
        return self.weight_packed.matmul(hidden, torch.float32)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kernel={self.weight_packed.kind}"


def replace_linear(
    model: nn.Module, name: str, weight: Int4Weight | Int8Weight, device: torch.device
) -> QuantLinear:
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


def check_weights_fit(model: nn.Module, new: nn.Module) -> None:
    """Raises ``ValueError`` naming the first tensor of ``new`` that ``model`` lacks, lacks
    room for (shape, dtype) or holds as another kind of layer, before anything is copied: a
    reload that fails leaves the served weights whole (``load_state_dict`` copies what fits
    and reports the rest only afterwards)."""
    served, loaded = model.state_dict(), new.state_dict()
    for name in sorted(served.keys() ^ loaded.keys()):
        side = "the new checkpoint lacks" if name in served else "the served model has no"
        raise ValueError(f"{side} tensor {name}")
    for name, tensor in loaded.items():
        old = served[name]
        if old.shape != tensor.shape or old.dtype != tensor.dtype:
            raise ValueError(
                f"{name}: the new tensor is {tuple(tensor.shape)} {tensor.dtype}, "
                f"the served one {tuple(old.shape)} {old.dtype}"
            )
    for name, module in new.named_modules():
        if isinstance(module, (QuantEmbedding, QuantLinear)):
            old_module = model.get_submodule(name)
            if type(old_module) is not type(module) or _packed_shape(old_module) != _packed_shape(module):
                new_kind, kind = (
                    ("embedding is 8-bit", "one")
                    if isinstance(module, QuantEmbedding)
                    else ("weights are quantized", "layer")
                )
                raise ValueError(
                    f"{name}: the new {new_kind} of shape {_packed_shape(module)}, "
                    f"the served {kind} is {old_module}"
                )


def copy_weights(model: nn.Module, new: nn.Module) -> None:
    """Copies ``new``'s weights into ``model`` of the same architecture (weight reloads):
    dense tensors through ``load_state_dict``, packed 4- and 8-bit ones (not in a state dict)
    by layer. A mismatch raises ``ValueError`` naming the tensor, with ``model`` unchanged
    (:func:`check_weights_fit`)."""
    check_weights_fit(model, new)
    try:
        model.load_state_dict(new.state_dict())
        for name, module in new.named_modules():
            if isinstance(module, (QuantEmbedding, QuantLinear)):
                model.get_submodule(name).weight_packed = module.weight_packed
    finally:  # what was built from the old tensors goes
        weights_replaced = getattr(model, "weights_replaced", None)
        if weights_replaced is not None:
            weights_replaced()


def _packed_shape(module: QuantEmbedding | QuantLinear) -> tuple[int, int]:
    """The shape of the packed weight a reload swaps in."""
    if isinstance(module, QuantEmbedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features
