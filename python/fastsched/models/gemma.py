"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention, MLP and loading with Gemma's layer.

What differs from Llama, each as transformers computes it (so fp32 greedy tokens match):

- RMSNorms scale by ``1 + w`` (the checkpoint stores ``w``; llama.cpp's GGUF files store
  ``1 + w``, which the loader turns back), multiplying in fp32 before the cast back;
- four norms a layer: the attention and MLP outputs are normed again before their residual add;
- the token embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype;
- GeGLU (tanh GELU) instead of SwiGLU, and the attention scale ``query_pre_attn_scalar**-0.5``;
- layers alternate sliding-window and global attention (``ModelConfig.layer_types``);
- Gemma 2 soft-caps attention scores and final logits; Gemma 3 instead norms each q/k
  head and gives its sliding layers their own RoPE base (``rope_local_theta``), the global
  ones keeping ``rope_theta`` and its scaling.

The output embedding is tied to the input one (both families).

In bfloat16 on a CPU the layers run on the Rust kernels (``forward_cpu_bf16``), and where the
projections are int4 / int8 on those kernels as one decoder-stack call a step
(``fastsched.models.llama_cpu.gemma_stack``), bit-equal to the layer-by-layer kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fastsched.attention.base import AttentionBackend, AttentionMetadata
from fastsched.kernels import cpu_ops
from fastsched.models.config import ModelConfig
from fastsched.models.llama import MLP, Attention, LlamaForCausalLM
from fastsched.models.llama_cpu import CpuDecoderStack, gemma_stack
from fastsched.models.rope import Rope, RotaryEmbedding

if TYPE_CHECKING:
    from fastsched.distributed.parallel import TensorParallel
    from fastsched.lora.slots import LayerLoRA, LoRAStep


class GemmaRMSNorm(nn.Module):
    """``normalize(x) * (1 + w)`` in fp32, cast back to ``x``'s dtype after the scaling
    (Llama casts before), with ``w`` the checkpoint's zero-centred weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        # ((the weight's storage, its version), 1 + w): see kernel_weight
        self._kernel_weight: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def kernel_weight(self) -> torch.Tensor:
        """The weight as the CPU kernels take it: float32 ``1 + w``, which they apply before
        the one rounding to bfloat16, as :meth:`forward` does. Kept between steps while the
        parameter is unchanged: same storage, and its version counter, which moves with every
        in-place write (a weight reload's included)."""
        weight = self.weight.detach()
        key = (weight.data_ptr(), weight._version)
        if self._kernel_weight is None or self._kernel_weight[0] != key:
            self._kernel_weight = (key, 1.0 + weight.float())
        return self._kernel_weight[1]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None, layer: int = 0) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Attention(config, tp, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        sliding = config.layer_types[layer] == "sliding_attention"
        # the step's RoPEs: the global one, then (Gemma 3) the sliding layers' own
        self.rope_table = 1 if sliding and config.rope_local_theta is not None else 0

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata, backend, lora)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden), lora)
        return hidden + self.post_feedforward_layernorm(mlp)

    def forward_cpu_bf16(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        """``forward`` with the CPU kernels, as ``DecoderLayer.forward_cpu_bf16``: adds the
        previous layer's ``delta`` (its normed MLP output) to ``hidden`` in place and returns
        this layer's. The output norms run in place, as the decoder stack runs them."""
        eps = self.input_layernorm.eps
        normed = cpu_ops.add_rms_norm(hidden, delta, self.input_layernorm.kernel_weight(), eps)
        attn = self.self_attn(normed, rope, kv_cache, metadata, backend, lora)
        cpu_ops.rms_norm_heads_(attn, 1, self.post_attention_layernorm.kernel_weight(), eps)
        normed = cpu_ops.add_rms_norm(hidden, attn, self.pre_feedforward_layernorm.kernel_weight(), eps)
        mlp = self.mlp(normed, lora, cpu_bf16=True)
        cpu_ops.rms_norm_heads_(mlp, 1, self.post_feedforward_layernorm.kernel_weight(), eps)
        return mlp


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and 3; parameter names as the Hugging Face checkpoint's minus ``model.``."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        if not config.tie_word_embeddings:
            raise ValueError(
                f"{config.architecture} ties its output embedding to the input one; "
                "this checkpoint has tie_word_embeddings false"
            )
        super().__init__(config, tp)
        self.local_rotary = (
            None
            if config.rope_local_theta is None
            else RotaryEmbedding(config, config.rope_local_theta, None)
        )
        self.embed_scale = config.hidden_size**0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:  # [T, hidden_size], final-normed
        hidden = self.embed_tokens(input_ids) if self.tp is None else self._embed_vocab_parallel(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        rotaries = [self.rotary] + ([] if self.local_rotary is None else [self.local_rotary])
        # bfloat16 on the CPU: the Rust kernels for everything but the matmuls (and, where the
        # model and the step allow, for those too: the decoder stack)
        if (
            hidden.device.type == "cpu"
            and cpu_ops.AVAILABLE
            and hidden.dtype == torch.bfloat16
            and all(r.full_width for r in rotaries)
        ):
            ropes = [r.table(positions, hidden.dtype) for r in rotaries]
            return self._forward_cpu_bf16(hidden, ropes, kv_caches, metadata, backend, lora)
        ropes = [Rope(*r(positions, hidden.dtype)) for r in rotaries]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(
                hidden,
                ropes[layer.rope_table],
                kv_cache,
                metadata,
                backend,
                None if lora is None else lora.layer(i),
            )
        return self.norm(hidden)

    def _build_cpu_stack(self) -> CpuDecoderStack:
        return gemma_stack(self)
