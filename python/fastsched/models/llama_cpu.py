"""The decoder stack as one Rust call a step on the CPU (``fastsched_kernels::decoder``).

At one decode token SmolLM2's 30 layers make ~450 kernel calls of 2–70 µs each; from Python,
with a check, an allocation and a float32 → bfloat16 cast around each, the step took about
twice the kernels' own time (bench/RESULTS.md, "CPU decode: one call for the decoder stack").
:class:`CpuDecoderStack` hands the whole stack (norms, quantized projections, q/k norms, RoPE,
the KV write and paged attention, the activation, residual adds, the final norm) to the crate
in one call.

A model describes its layers as :class:`StackLayer` values: the Llama family through
:func:`llama_stack`, Gemma 2 / 3 through :func:`gemma_stack` (output norms, GeGLU, sliding
windows with their own RoPE table, soft-capped attention, ``1 + w`` norms given as float32).
It runs the same kernels in the same order as ``LlamaForCausalLM._forward_cpu_bf16`` (Gemma's
layers: ``GemmaDecoderLayer.forward_cpu_bf16``), so its output is bit-equal to that path
(tests/models/test_llama_cpu.py), and it applies only where that path would run those
kernels: bfloat16 activations, every projection an int4 / int8 :class:`QuantLinear` on the
Rust kernels (with or without a bfloat16 bias, as Qwen2's q/k/v), no tensor parallelism, no
LoRA in the step, every request's attention on the Rust kernel (no SDPA prefill chunk), and a
CPU with the many-row GEMM's AVX-512 BF16. Otherwise the model runs layer by layer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.dlpack import to_dlpack

from fastsched import _core
from fastsched.attention.base import PLAIN_ATTENTION, AttentionOptions
from fastsched.kernels import cpu_ops, quant_matmul_cpu
from fastsched.models.config import GEMMA_ARCHITECTURES, ModelConfig
from fastsched.models.quant_linear import QuantLinear

logger = logging.getLogger(__name__)

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass
class StackLayer:
    """One decoder layer as the stack runs it (the crate's ``decoder`` module docs give the
    order). Norm weights are ``[hidden]`` (q/k norms ``[head_dim]``), all bfloat16 (Llama's
    rounding) or all float32 (Gemma's, given as ``1 + w``: one rounding), the stack's final
    norm included."""

    input_norm: torch.Tensor
    # before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
    post_norm: torch.Tensor
    # qkv [q + 2 kv, hidden], o, gate_up [2 I, hidden] (gate first), down
    projections: tuple[QuantLinear, QuantLinear, QuantLinear, QuantLinear]
    scale: float  # the attention's: scores are scale * q.k
    q_norm: torch.Tensor | None = None  # per-head norms before RoPE (Qwen3, Gemma 3); both or neither
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma's post_attention_layernorm, on o_proj's output
    mlp_out_norm: torch.Tensor | None = None  # Gemma's post_feedforward_layernorm, on down_proj's output
    activation: str = "silu"  # of the gate, times up: "silu" or "gelu_tanh" (GeGLU)
    attention: AttentionOptions = field(default=PLAIN_ATTENTION)  # sliding window, logit soft-cap
    rope_table: int = 0  # which of ``forward``'s RoPE tables rotates this layer's q and k

    def norms(self) -> list[torch.Tensor | None]:
        """In the binding's order: input, post, q, k, attn_out, mlp_out."""
        return [
            self.input_norm,
            self.post_norm,
            self.q_norm,
            self.k_norm,
            self.attn_out_norm,
            self.mlp_out_norm,
        ]


def layers_unsupported_reason(layers: Sequence[StackLayer], final_norm: torch.Tensor) -> str | None:
    """Why these layers cannot run as one stack call (None: they can), whatever the model."""
    if not (hasattr(_core, "CpuDecoder") and cpu_ops.AVAILABLE and quant_matmul_cpu.GEMM_SIMD):
        return "this CPU lacks the kernels' AVX-512 BF16 GEMM"
    norms = [final_norm] + [n for layer in layers for n in layer.norms() if n is not None]
    if any(w.device.type != "cpu" for w in norms) or {w.dtype for w in norms} not in (
        {torch.bfloat16},
        {torch.float32},
    ):
        return "norm weights not all bfloat16 or all float32 on the CPU"
    for i, layer in enumerate(layers):
        for name, proj in zip(_PROJECTIONS, layer.projections):
            if not isinstance(proj, QuantLinear) or proj.weight_packed.kind != "cpu_rust":
                return f"layer {i} {name} is not an int4/int8 layer on the Rust kernels"
            if proj.bias is not None and proj.bias.dtype != torch.bfloat16:
                return f"layer {i} {name}'s bias is {proj.bias.dtype}, not bfloat16"
    return None


def _layer(layer: nn.Module, config: ModelConfig, **options: object) -> StackLayer:
    """A decoder layer's parts every family shares (the projections, the attention's scale,
    window and soft-cap, the input norm and q/k norms, as the kernels take them) with the
    family's ``options``."""
    attn = layer.self_attn
    return StackLayer(
        input_norm=layer.input_layernorm.kernel_weight(),
        projections=tuple(layer.get_submodule(name) for name in _PROJECTIONS),  # type: ignore[arg-type]
        scale=attn.scale,
        q_norm=attn.q_norm.kernel_weight() if attn.qk_norm else None,
        k_norm=attn.k_norm.kernel_weight() if attn.qk_norm else None,
        attention=AttentionOptions(attn.sliding_window, config.attn_logit_softcapping),
        **options,  # type: ignore[arg-type]
    )


def llama_layers(model: nn.Module) -> list[StackLayer]:
    """The layers of a ``fastsched.models.llama.LlamaForCausalLM`` (Llama, Mistral, Qwen2, Qwen3)."""
    return [
        _layer(layer, model.config, post_norm=layer.post_attention_layernorm.kernel_weight())
        for layer in model.layers
    ]


def gemma_layers(model: nn.Module) -> list[StackLayer]:
    """The layers of a ``fastsched.models.gemma.GemmaForCausalLM`` (Gemma 2, Gemma 3): float32
    ``1 + w`` norms, four a layer, GeGLU, and RoPE table 1 (the local RoPE) on Gemma 3's
    sliding layers."""
    return [
        _layer(
            layer,
            model.config,
            post_norm=layer.pre_feedforward_layernorm.kernel_weight(),
            attn_out_norm=layer.post_attention_layernorm.kernel_weight(),
            mlp_out_norm=layer.post_feedforward_layernorm.kernel_weight(),
            activation="gelu_tanh",
            rope_table=layer.rope_table,
        )
        for layer in model.layers
    ]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` (a ``fastsched.models.llama.LlamaForCausalLM`` or its Gemma subclass)
    cannot run as one stack call (None: it can)."""
    if model.tp is not None:
        return "tensor parallelism"
    config = model.config
    gemma = config.architecture in GEMMA_ARCHITECTURES
    rotaries = [model.rotary] + ([model.local_rotary] if gemma and model.local_rotary is not None else [])
    activation = "gelu_pytorch_tanh" if gemma else "silu"
    if config.hidden_act != activation or not all(r.full_width for r in rotaries):
        return f"the {config.hidden_act} activation or partial rotary embeddings"
    if model.norm.weight.dtype != torch.bfloat16:
        return "weights not bfloat16 on the CPU"
    layers = gemma_layers(model) if gemma else llama_layers(model)
    return layers_unsupported_reason(layers, model.norm.kernel_weight())


def llama_stack(model: nn.Module) -> CpuDecoderStack:
    """The stack of a ``LlamaForCausalLM`` for which :func:`unsupported_reason` is None."""
    return _stack(model, llama_layers(model))


def gemma_stack(model: nn.Module) -> CpuDecoderStack:
    """The stack of a ``GemmaForCausalLM`` for which :func:`unsupported_reason` is None; its
    ``forward`` takes the global RoPE table, then (Gemma 3) the local one. The embedding
    scale and the final logit soft-cap stay the model's."""
    return _stack(model, gemma_layers(model))


def _stack(model: nn.Module, layers: list[StackLayer]) -> CpuDecoderStack:
    attn = model.layers[0].self_attn
    return CpuDecoderStack(
        layers,
        model.norm.kernel_weight(),
        model.norm.eps,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
    )


class CpuDecoderStack:
    """The Rust stack of ``layers``, which holds their tensors (DLPack) and checks them
    against the model's shape, failing naming the layer and the part. The layers must have
    passed :func:`layers_unsupported_reason`."""

    def __init__(
        self,
        layers: Sequence[StackLayer],
        final_norm: torch.Tensor,
        eps: float,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        for i, layer in enumerate(layers):
            if layer.activation not in ACTIVATIONS:
                raise ValueError(
                    f"layer {i}: activation must be one of {ACTIVATIONS}, got {layer.activation!r}"
                )
        gate_up = layers[0].projections[2].weight_packed.cpu if layers else None
        hidden = final_norm.shape[0]
        self._rust = _core.CpuDecoder(
            [hidden, num_heads, num_kv_heads, head_dim, 0 if gate_up is None else gate_up.n // 2],
            eps,
            quant_matmul_cpu.DENSE_MIN_ROWS,
            [[_dl(n) for n in layer.norms()] for layer in layers],
            [[p.weight_packed.cpu.rust for p in layer.projections] for layer in layers],
            [[_dl(p.bias) for p in layer.projections] for layer in layers],
            _dl(final_norm),
            [
                (
                    layer.activation,
                    layer.attention.sliding_window,
                    layer.rope_table,
                    layer.attention.logits_soft_cap,
                    layer.scale,
                )
                for layer in layers
            ],
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        step: tuple[torch.Tensor, ...],
        num_rows: int,
    ) -> torch.Tensor:
        """Every layer and the final norm on ``hidden [T, hidden]`` (bfloat16, the embedded
        tokens, Gemma's scaling applied; used as the residual stream, so overwritten). RoPE:
        ``tables`` holds a ``(cos, sin)`` pair of ``[len, head_dim]`` tables per RoPE the layers
        name (``StackLayer.rope_table``), row ``t`` takes row ``positions[t]`` of them. ``step``:
        the attention backend's checked tensors (slot_mapping, query_start_loc, seq_lens,
        block_tables, the requests), which must cover the ``num_rows`` real rows."""
        out = torch.empty_like(hidden)
        cpu_ops.sync_threads()
        self._rust.forward(
            to_dlpack(hidden),
            to_dlpack(out),
            to_dlpack(positions),
            [(to_dlpack(cos), to_dlpack(sin)) for cos, sin in tables],
            [to_dlpack(c) for c in kv_caches],
            *map(to_dlpack, step),
            num_rows,
        )
        return out


def _dl(t: torch.Tensor | None) -> object | None:
    """A weight as the binding holds it: a DLPack capsule of a contiguous copy if need be."""
    return None if t is None else to_dlpack(t.detach().contiguous())
