"""The Llama decoder stack as one Rust call a step on the CPU (``fastsched_kernels::decoder``).

At one decode token SmolLM2's 30 layers make ~450 kernel calls of 2–70 µs each; from Python,
with a check, an allocation and a float32 → bfloat16 cast around each, the step took about
twice the kernels' own time (bench/RESULTS.md, "CPU decode: one call for the decoder stack").
:class:`CpuDecoderStack` hands the whole stack (norms, quantized projections, RoPE, the KV
write and paged attention, SiLU, residual adds, the final norm) to the crate in one call.

It runs the same kernels in the same order as ``LlamaForCausalLM._forward_cpu_bf16``, so its
output is bit-equal to that path (tests/models/test_llama_cpu.py), and it applies only
where that path would run those kernels: bfloat16 activations, every projection an int4 /
int8 :class:`QuantLinear` on the Rust kernels (with or without a bfloat16 bias, as Qwen2's
q/k/v), no q/k norm, sliding window, soft-capping or GeGLU, no tensor parallelism, no LoRA
in the step, every request's attention on the Rust kernel (no SDPA prefill chunk), and a CPU
with the many-row GEMM's AVX-512 BF16. Otherwise the model runs layer by layer.
"""

from __future__ import annotations

import logging
import torch
from torch import nn

from fastsched import _core
from fastsched.kernels import cpu_ops, quant_matmul_cpu
from fastsched.models.config import GEMMA_ARCHITECTURES
from fastsched.models.quant_linear import QuantLinear

logger = logging.getLogger(__name__)

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` (a ``fastsched.models.llama.LlamaForCausalLM``) cannot run as one stack
    call (None: it can)."""
    if not (hasattr(_core, "CpuDecoder") and cpu_ops.AVAILABLE and quant_matmul_cpu.GEMM_SIMD):
        return "this CPU lacks the kernels' AVX-512 BF16 GEMM"
    if model.tp is not None:
        return "tensor parallelism"
    config = model.config
    if config.architecture in GEMMA_ARCHITECTURES:
        return "Gemma's (1 + w) norms, post-attention and post-FFN norms"
    if config.qk_norm:
        return "per-head q/k norms"
    windowed = [i for i, layer in enumerate(model.layers) if layer.self_attn.sliding_window is not None]
    if windowed:
        return f"sliding-window attention (layers {windowed[0]}..{windowed[-1]}), which the kernel lacks"
    if config.attn_logit_softcapping is not None:
        return "attention logit soft-capping, which the kernel lacks"
    if config.hidden_act != "silu" or not model.rotary.full_width:
        return f"the {config.hidden_act} activation or partial rotary embeddings"
    norms = [model.norm.weight] + [n.weight for layer in model.layers
                                   for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(w.dtype != torch.bfloat16 or w.device.type != "cpu" for w in norms):
        return "weights not bfloat16 on the CPU"
    for i, layer in enumerate(model.layers):
        for name in _PROJECTIONS:
            proj = layer.get_submodule(name)
            if not isinstance(proj, QuantLinear) or proj.weight_packed.kind != "cpu_rust":
                return f"layer {i} {name} is not an int4/int8 layer on the Rust kernels"
            if proj.bias is not None and proj.bias.dtype != torch.bfloat16:
                return f"layer {i} {name}'s bias is {proj.bias.dtype}, not bfloat16"
    return None


class CpuDecoderStack:
    """The Rust stack of ``model``'s layers; holds every tensor whose address it gave away."""

    def __init__(self, model: nn.Module) -> None:
        config, attn = model.config, model.layers[0].self_attn
        projections = [[layer.get_submodule(name) for name in _PROJECTIONS] for layer in model.layers]
        packed = [[proj.weight_packed for proj in layer] for layer in projections]
        biases = [[None if proj.bias is None else proj.bias.detach().contiguous() for proj in layer]
                  for layer in projections]
        norms = [(layer.input_layernorm.weight.detach().contiguous(),
                  layer.post_attention_layernorm.weight.detach().contiguous()) for layer in model.layers]
        final_norm = model.norm.weight.detach().contiguous()
        self._alive = (packed, biases, norms, final_norm)
        self.scale = attn.scale
        self._rust = _core.CpuDecoder(
            [config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, model.layers[0].mlp.intermediate_size],
            model.norm.eps, quant_matmul_cpu.DENSE_MIN_ROWS,
            [[i.data_ptr(), p.data_ptr()] for i, p in norms],
            [[(w.cpu.bits, w.cpu.n, w.cpu.k, w.cpu.addresses) for w in layer] for layer in packed],
            [[0 if b is None else b.data_ptr() for b in layer] for layer in biases],
            final_norm.data_ptr(),
        )
        self._hidden, self._kv_heads, self._head_dim = config.hidden_size, attn.num_kv_heads, attn.head_dim
        self._caches: tuple[tuple[int, int], list[int], bool, list[int]] | None = None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[torch.Tensor], step: tuple[torch.Tensor, ...], num_rows: int) -> torch.Tensor:
        """Every layer and the final norm on ``hidden [T, hidden]`` (bfloat16, the embedded
        tokens; used as the residual stream, so overwritten). RoPE: row ``t`` takes row
        ``positions[t]`` of the ``[len, head_dim]`` tables ``cos``, ``sin``. ``step``: the
        attention backend's checked tensors (slot_mapping, query_start_loc, seq_lens,
        block_tables, the requests), which must cover the ``num_rows`` real rows."""
        if hidden.dtype != torch.bfloat16 or not hidden.is_contiguous():
            raise ValueError(f"hidden must be a contiguous bfloat16 tensor; got {hidden.dtype}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != (cos.shape[0], self._head_dim):
                raise ValueError(f"{name} must be a contiguous bfloat16 [len, {self._head_dim}] table; "
                                 f"got {t.dtype} {tuple(t.shape)}")
        cpu_ops.check_step_tensor("positions", positions, torch.int64)
        rows = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self._hidden or positions.shape != (rows,) or step[0].shape != (rows,) or not 0 <= num_rows <= rows:
            raise ValueError(f"hidden {tuple(hidden.shape)}, positions {tuple(positions.shape)}, slot_mapping "
                             f"{tuple(step[0].shape)} and num_rows {num_rows} do not agree")
        addresses, cache_bf16, blocks = self._cache_layout(kv_caches)
        out = torch.empty_like(hidden)
        slots, qsl, seq_lens, tables, reqs = step
        cpu_ops.sync_threads()
        self._rust.forward(
            hidden.data_ptr(), out.data_ptr(), rows, positions.data_ptr(),
            [cos.data_ptr(), sin.data_ptr()], cos.shape[0], addresses, cache_bf16, blocks,
            [t.data_ptr() for t in step], seq_lens.shape[0], tables.shape[1], reqs.shape[0], num_rows, self.scale,
        )
        return out

    def _cache_layout(self, kv_caches: list[torch.Tensor]) -> tuple[list[int], bool, list[int]]:
        """The caches' addresses, dtype and block counts, checked once per list of caches."""
        key = (id(kv_caches), kv_caches[0].data_ptr() if kv_caches else 0)
        if self._caches is None or self._caches[0] != key:
            if len(kv_caches) != self._rust.num_layers:
                raise ValueError(f"{len(kv_caches)} KV caches for {self._rust.num_layers} layers")
            first = kv_caches[0]
            heads = (self._kv_heads, self._head_dim)
            for c in kv_caches:
                if (c.dtype not in cpu_ops.DTYPES or c.dtype != first.dtype or c.shape != first.shape
                        or not c.is_contiguous() or c.device.type != "cpu" or c.dim() != 5 or tuple(c.shape[3:]) != heads):
                    raise ValueError(f"KV caches must be alike contiguous CPU float32/bfloat16 "
                                     f"[2, blocks, block_size, {heads[0]}, {heads[1]}] tensors; "
                                     f"got {c.dtype} {tuple(c.shape)}")
            self._caches = (key, [c.data_ptr() for c in kv_caches], first.dtype == torch.bfloat16,
                            [first.shape[1], first.shape[2]])
        return self._caches[1], self._caches[2], self._caches[3]
