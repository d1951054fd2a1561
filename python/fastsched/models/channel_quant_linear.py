"""Weight-only 8-bit linear layers made at load from a dense checkpoint (``--quantization
int8`` / ``fp8``, vLLM's spelling): each output channel's weights share one float32 scale,
``w = scale·c``, so the projections take 1 byte a weight instead of 2 (bf16) or 4 (fp32).

- int8: ``c`` int8 in −127..127, ``scale = max|w| / 127`` (round to nearest). On CPU with
  bf16 activations the matmul is torch's ``_weight_int8pack_mm`` (scales in bf16); its fp32
  path has no vectorised kernel (measured 5–30× slower than upcasting), so fp32 activations,
  and every other device, upcast the codes per call. Measured against dense bf16 on this
  project's CPU (bench/RESULTS.md) the int8 kernel is slower, 1.2× at one row and 2.2× at 32:
  int8 is a memory saving, not a speed-up.
- fp8: ``c`` float8_e4m3fn, ``scale = max|w| / 448``. On CUDA with fp8 tensor cores
  (compute capability ≥ 8.9) and bf16 activations, ``torch._scaled_mm`` with the
  activations quantized per token (fp8 × fp8, float32 accumulation); everywhere else,
  and always on CPU, the codes are upcast to the activations' dtype for a dense matmul
  (memory saving only: no CPU kernel reads fp8).

The codes and scales are buffers, so a weight reload (``copy_weights``) copies them through
the state dict like any dense tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("int8", "fp8")
_INT8_MAX = 127.0
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448
_CPU_INT8 = hasattr(torch.ops.aten, "_weight_int8pack_mm")
# Layers a checkpoint's projections become; lm_head and the embedding stay dense.
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_per_channel(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` → (codes ``[N, K]`` int8 or float8_e4m3fn, scale ``[N]`` float32), round to
    nearest with the largest magnitude of each row mapped to the format's largest value."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    if kind == "int8":
        scale = amax / _INT8_MAX
        return (w / scale[:, None]).round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale
    if kind == "fp8":
        scale = amax / _FP8_MAX
        return (w / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale
    raise ValueError(f"per-channel quantization kind must be one of {', '.join(KINDS)}; got {kind!r}")


def _fp8_tensor_cores(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


class ChannelQuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as per-channel 8-bit codes (module docstring)."""

    def __init__(self, linear: nn.Linear, kind: str) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.out_features, linear.in_features
        codes, scale = quantize_per_channel(linear.weight, kind)
        device = linear.weight.device
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scale", scale.to(device))
        self.bias = linear.bias
        self.kind = kind
        if kind == "int8":
            bf16_cpu = device.type == "cpu" and linear.weight.dtype == torch.bfloat16  # the model's dtype
            self.kernel = "int8pack" if bf16_cpu and _CPU_INT8 else "upcast"
        else:  # _scaled_mm's fp8 operands need dimensions that are multiples of 16
            aligned = self.in_features % 16 == 0 and self.out_features % 16 == 0
            self.kernel = "scaled_mm" if aligned and _fp8_tensor_cores(device) else "upcast"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "int8pack" and x.dtype == torch.bfloat16:
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.codes, self.scale.to(x.dtype))
        elif self.kernel == "scaled_mm" and x.dtype == torch.bfloat16:
            out = self._scaled_mm(x2)
        else:
            out = F.linear(x2, self.codes.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """fp8 × fp8 on tensor cores: activations quantized per token (row-wise scales)."""
        x_scale = (x.abs().amax(dim=1, keepdim=True).float() / _FP8_MAX).clamp_min(
            torch.finfo(torch.float32).tiny
        )
        xq = (x.float() / x_scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
        return torch._scaled_mm(
            xq, self.codes.t(), scale_a=x_scale, scale_b=self.scale[None, :], out_dtype=x.dtype
        )

    def dequantize(self) -> torch.Tensor:
        """The weight this layer computes with, float32 ``[N, K]`` (tests' reference)."""
        return self.codes.float() * self.scale[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, "
            f"kernel={self.kernel}"
        )


def quantize_projections(model: nn.Module, kind: str) -> list[ChannelQuantLinear]:
    """Replaces every decoder layer's projections (:data:`PROJECTIONS`) by a
    :class:`ChannelQuantLinear` of ``kind``; their dense weights are freed."""
    replaced = []
    for layer in model.get_submodule("layers"):
        for name in PROJECTIONS:
            parent_name, child = name.split(".")
            parent = layer.get_submodule(parent_name)
            old = getattr(parent, child)
            if not isinstance(old, nn.Linear):
                raise ValueError(f"{name} is a {type(old).__name__}, not a dense linear layer to quantize")
            new = ChannelQuantLinear(old, kind)
            setattr(parent, child, new)
            replaced.append(new)
    return replaced
