"""One decoder for the Llama family: Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2, Qwen3, Phi-3.

They differ only in switches that ``ModelConfig`` carries (q/k/v bias, o_proj bias,
per-head q/k RMSNorm, tied embeddings, RoPE scaling and partial rotation, sliding
windows), so one implementation keeps them numerically identical to ``transformers``
with a single code path to test. Gemma 2/3 (:mod:`fastsched.models.gemma`) reuse its
attention, MLP and loading with their own layer.

Tokens arrive flattened (``[T]``, requests back to back, prefill chunks and decodes
mixed); attention is the backend's job, everything else is position-wise. q/k/v and
gate/up are fused into one matmul each; ``load_weights`` packs the checkpoint's
separate tensors into them (a checkpoint stored fused, Phi-3's, is split first, so
tensor parallelism and quantized layers see the same shards). With LoRA
(``fastsched.lora``) each fused projection's output gets its per-token adapter delta
added, by the fused parameter's name.

Built with a :class:`TensorParallel` (``tp``), each rank holds its shard of every layer
(:mod:`fastsched.models.tp_shard`) and the layers add the collectives: an all-reduce after
o_proj, after down_proj and after the vocab-parallel embedding, a gather of the logits to
rank 0. Without one (``tp=None``) nothing of that runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fastsched.attention.base import AttentionBackend, AttentionMetadata
from fastsched.attention.cpu import CpuBackend
from fastsched.kernels import cpu_ops
from fastsched.kernels.quant_matmul import Int4Weight, Int8Weight, fuse
from fastsched.models.config import ModelConfig
from fastsched.models.llama_cpu import CpuDecoderStack, llama_stack, unsupported_reason
from fastsched.models.quant_linear import QuantEmbedding, QuantLinear, replace_linear
from fastsched.models.rope import Rope, RotaryEmbedding, apply_rope
from fastsched.models.tp_shard import local_heads, shard_weight, weight_rows

__all__ = [
    "Attention",
    "LlamaForCausalLM",
    "MLP",
    "RMSNorm",
    "Rope",
    "RotaryEmbedding",
    "apply_rope",
    "target_parameter",
]

logger = logging.getLogger(__name__)

Weight = torch.Tensor | Int4Weight | Int8Weight

if TYPE_CHECKING:
    from fastsched.distributed.parallel import TensorParallel
    from fastsched.lora.slots import LayerLoRA, LoRAStep


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and scaled after casting back, in transformers' order, so
    low-precision serving rounds the same way as the reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def kernel_weight(self) -> torch.Tensor:
        """The weight as the CPU kernels take it: bfloat16, so they round as :meth:`forward`."""
        return self.weight.detach()


class Attention(nn.Module):
    """Self-attention of layer ``layer``: its sliding window (if any), the config's logit
    soft-cap and attention scale go to the backend; ``norm`` builds the q/k norms."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel | None = None,
        layer: int = 0,
        norm: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = (
            (config.num_heads, config.num_kv_heads) if tp is None else local_heads(config, tp)
        )
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer)
        # Only what is set goes to the backend, so a layer without either calls it as before.
        self._backend_options = {
            k: v
            for k, v in (
                ("sliding_window", self.sliding_window),
                ("logits_soft_cap", config.attn_logit_softcapping),
            )
            if v is not None
        }
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add("qkv_proj", hidden, qkv)
        if rope.positions is not None:  # the CPU kernels, in place on q's and k's heads
            if self.qk_norm:  # bfloat16 only: the table form comes with q/k norms on that path alone
                q_norm, k_norm = self.q_norm, self.k_norm
                cpu_ops.rms_norm_heads_(qkv, self.num_heads, q_norm.kernel_weight(), q_norm.eps)
                cpu_ops.rms_norm_heads_(
                    qkv[:, self.q_size :], self.num_kv_heads, k_norm.kernel_weight(), k_norm.eps
                )
            cpu_ops.rope_(
                qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope.positions, rope.cos, rope.sin
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rope.positions is None:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
        # The CPU backend reads strided rows, k's and v's alike (after q/k norms k is a new
        # tensor, so v is copied too); the others are given v contiguous, as before.
        v = v if backend.name == "cpu" and k.stride(0) == v.stride(0) else v.contiguous()
        out = backend.forward(q, k, v, kv_cache, metadata, self.scale, **self._backend_options)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if lora is not None:
            lora.add("o_proj", out, projected)
        return projected if self.tp is None else self.tp.all_reduce(projected)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size // (1 if tp is None else tp.size)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma); else SwiGLU

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None, cpu_bf16: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add("gate_up_proj", x, gate_up)
        if cpu_bf16:
            activated = cpu_ops.gelu_tanh_mul(gate_up) if self.gelu else cpu_ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            activated = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        out = self.down_proj(activated)
        if lora is not None:
            lora.add("down_proj", activated, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    rope_table = 0  # which of the step's RoPEs rotates this layer (Gemma 3's sliding layers: their own)

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), rope, kv_cache, metadata, backend, lora
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)

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
        """``forward`` with the CPU kernels: adds the previous layer's ``delta`` to the
        residual stream ``hidden`` in place (fused with the norm) and returns this layer's,
        so each residual add rides along with the next RMSNorm."""
        eps = self.input_layernorm.eps
        normed = cpu_ops.add_rms_norm(hidden, delta, self.input_layernorm.weight, eps)
        attn = self.self_attn(normed, rope, kv_cache, metadata, backend, lora)
        normed = cpu_ops.add_rms_norm(hidden, attn, self.post_attention_layernorm.weight, eps)
        return self.mlp(normed, lora, cpu_bf16=True)


# Checkpoint projection name -> (fused parameter, index of its shard in the fused output).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoint minus its ``model.`` prefix."""

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        vocab_rows = config.vocab_size if tp is None else tp.vocab_range(config.vocab_size)[2]
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, tp, i) for i in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, vocab_rows, bias=False)
        )
        # What this rank's KV cache holds per layer (all the model's KV heads without tp).
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.rotary = RotaryEmbedding(config)
        # The CPU decoder stack (_cpu_stack): not built yet, built, or why it cannot be.
        self._stack: CpuDecoderStack | str | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, position of each token within its request
        kv_caches: list[torch.Tensor],  # one per layer, see fastsched.attention.base
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRAStep | None = None,  # the step's adapters, None: the base model for every token
    ) -> torch.Tensor:  # [T, hidden_size], final-normed
        hidden = self.embed_tokens(input_ids) if self.tp is None else self._embed_vocab_parallel(input_ids)
        cpu = hidden.device.type == "cpu" and cpu_ops.AVAILABLE and hidden.dtype in cpu_ops.DTYPES
        cpu_bf16 = cpu and hidden.dtype == torch.bfloat16 and self.norm.weight.dtype == torch.bfloat16
        # On the CPU the Rust kernels replace the elementwise torch ops: RoPE (same bits in
        # float32 and bfloat16) whenever there is no q/k norm and it rotates whole heads; norms (q/k
        # norms too), residual adds and SiLU (bfloat16 only, see fastsched-kernels' elementwise docs)
        # in bfloat16.
        cpu_bf16 = cpu_bf16 and self.config.hidden_act == "silu" and self.rotary.full_width
        rope = (
            self.rotary.table(positions, hidden.dtype)
            if self.rotary.full_width and (cpu_bf16 or (cpu and not self.config.qk_norm))
            else Rope(*self.rotary(positions, hidden.dtype))
        )
        if cpu_bf16:
            return self._forward_cpu_bf16(hidden, [rope], kv_caches, metadata, backend, lora)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, rope, kv_cache, metadata, backend, None if lora is None else lora.layer(i))
        return self.norm(hidden)

    def _forward_cpu_bf16(
        self,
        hidden: torch.Tensor,
        ropes: list[Rope],
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRAStep | None,
    ) -> torch.Tensor:
        """The layers on the CPU kernels (bfloat16, RoPE tables: ``ropes[layer.rope_table]``
        rotates a layer), as one stack call where the model and the step allow."""
        hidden = hidden.clone(memory_format=torch.contiguous_format)  # the residual stream, updated in place
        stack = self._cpu_stack() if lora is None and isinstance(backend, CpuBackend) else None
        kernel_step = None if stack is None else backend.kernel_step(metadata, kv_caches[0].shape[2])
        if stack is not None and kernel_step is not None:
            positions = ropes[0].positions
            assert positions is not None  # the table form, as on every CPU bfloat16 path
            return stack.forward(hidden, positions, [(r.cos, r.sin) for r in ropes], kv_caches, *kernel_step)
        delta = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            delta = layer.forward_cpu_bf16(
                hidden,
                delta,
                ropes[layer.rope_table],
                kv_cache,
                metadata,
                backend,
                None if lora is None else lora.layer(i),
            )
        return cpu_ops.add_rms_norm(hidden, delta, self.norm.kernel_weight(), self.norm.eps)

    def _build_cpu_stack(self) -> CpuDecoderStack:
        """The stack of a model :func:`unsupported_reason` accepts."""
        return llama_stack(self)

    def _cpu_stack(self) -> CpuDecoderStack | None:
        """The layers as one Rust call (:mod:`fastsched.models.llama_cpu`), built on first use;
        None where the model does not qualify (the reason is logged once)."""
        if self._stack is None:
            reason = unsupported_reason(self)
            self._stack = reason or self._build_cpu_stack()
            if reason:
                logger.info("CPU decoder: layer by layer (%s)", reason)
            else:
                logger.info("CPU decoder: the %d layers run as one Rust call a step", len(self.layers))
        return None if isinstance(self._stack, str) else self._stack

    def weights_replaced(self) -> None:
        """Called after the weights' tensors were swapped for new ones (a weight reload):
        what was built from the old ones is dropped."""
        self._stack = None

    def _embed_vocab_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the ids in its vocabulary range, zeros for the rest; the
        all-reduce adds one exact row per token."""
        assert self.tp is not None
        start, end, _ = self.tp.vocab_range(self.config.vocab_size)
        outside = (input_ids < start) | (input_ids >= end)
        hidden = self.embed_tokens(torch.where(outside, 0, input_ids - start))
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]``; the runner passes only the rows it samples from.
        With tensor parallelism every rank calls it and rank 0 alone gets the logits
        (the other ranks get an empty tensor)."""
        if isinstance(self.lm_head, QuantLinear):
            logits = self.lm_head(hidden)
        elif self.lm_head is None and isinstance(self.embed_tokens, QuantEmbedding):
            logits = self.embed_tokens.logits(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight.to(hidden.dtype) if weight.dtype != hidden.dtype else weight)
        if self.tp is not None:
            gathered = self.tp.gather_vocab(logits, self.config.vocab_size)
            logits = logits[:, :0] if gathered is None else gathered
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Copy Hugging Face-named tensors in, packing q/k/v and gate/up into the fused
        parameters; fails naming any tensor without a place and any tensor never given.

        An :class:`Int4Weight` or :class:`Int8Weight` for a linear layer's weight (a GGUF
        kept quantized) replaces that layer by a :class:`QuantLinear` once every shard of it
        is in (shards of different formats fused by :func:`fuse`); a quantized token
        embedding replaces it by a :class:`QuantEmbedding`, 8-bit (also the lm_head when
        tied); anything else quantized, and the quantized shards of a layer with a dense
        one, is dequantized into the dense parameter."""
        params = dict(self.named_parameters())
        device = self.norm.weight.device
        loaded: set[str] = set()
        quantized_shards: dict[str, dict[int, Int4Weight | Int8Weight]] = {}
        for hf_name, tensor in self._unfused(weights):
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue  # recomputed / shared with embed_tokens
            if self.tp is not None:
                tensor = shard_weight(name, tensor, self.config, self.tp)
            parts = name.rsplit(".", 2)  # e.g. ["layers.0.self_attn", "q_proj", "weight"]
            if len(parts) == 3 and parts[1] in _FUSED:
                fused, shard = _FUSED[parts[1]]
                target = f"{parts[0]}.{fused}.{parts[2]}"
                start, size = self._shard_range(fused, shard)
            else:
                target, start, size = name, 0, None
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in {self.config.architecture}")
            if isinstance(tensor, (Int4Weight, Int8Weight)) and target == "embed_tokens.weight":
                if tensor.shape != tuple(params[target].shape):
                    raise ValueError(
                        f"checkpoint tensor {hf_name} has shape {tensor.shape}, "
                        f"expected {tuple(params[target].shape)}"
                    )
                weight = Int8Weight.from_int4(tensor) if isinstance(tensor, Int4Weight) else tensor
                self.embed_tokens = QuantEmbedding(weight, params[target].dtype, device)
                loaded.add(name)
                continue
            if isinstance(tensor, (Int4Weight, Int8Weight)):
                if target.endswith("proj.weight") or target == "lm_head.weight":
                    expected = params[target].shape if size is None else (size, params[target].shape[1])
                    if tuple(expected) != tensor.shape:
                        raise ValueError(
                            f"checkpoint tensor {hf_name} has shape {tensor.shape}, "
                            f"expected {tuple(expected)}"
                        )
                    quantized_shards.setdefault(target, {})[0 if size is None else _FUSED[parts[1]][1]] = (
                        tensor
                    )
                    loaded.add(name)
                    continue
                tensor = tensor.dequantize()
            dest = params[target].data
            dest = dest if size is None else dest[start : start + size]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(name)
        missing = [_hf_name(n) for n in _checkpoint_names(params) if n not in loaded]
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"checkpoint is missing tensors for {self.config.architecture}: {missing[:8]}{more}"
            )
        for target, shards in quantized_shards.items():
            fused = target.rsplit(".", 2)[1]
            num_shards = sum(f == fused for f, _ in _FUSED.values()) or 1
            if len(shards) == num_shards:
                weight = fuse([shards[i] for i in range(num_shards)])
                replace_linear(self, target.removesuffix(".weight"), weight, device)
                continue
            # Some shards of this fused layer are dense: the quantized ones go in dense too.
            for shard, weight in shards.items():
                start, size = self._shard_range(fused, shard)
                params[target].data[start : start + size].copy_(weight.dequantize())

    def _unfused(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """The checkpoint's tensors with fused ``qkv_proj`` / ``gate_up_proj`` ones (Phi-3)
        split into the separate projections (by the full model's sizes, before any sharding)."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        splits = {
            "qkv_proj": (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
            "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)),
        }
        for name, tensor in weights:
            prefix, proj, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", name, "")
            if proj not in splits:
                yield name, tensor
                continue
            for part, start, end in splits[proj]:
                yield f"{prefix}.{part}.{kind}", weight_rows(tensor, start, end)

    def _shard_range(self, fused: str, shard: int) -> tuple[int, int]:
        """Rows of checkpoint shard ``shard`` in fused parameter ``fused`` (this rank's sizes)."""
        if fused == "gate_up_proj":
            size = self.layers[0].mlp.intermediate_size
            return shard * size, size
        attn = self.layers[0].self_attn
        q_size, kv_size = attn.q_size, attn.kv_size
        return (0, q_size) if shard == 0 else (q_size + (shard - 1) * kv_size, kv_size)


def target_parameter(hf_name: str) -> str:
    """The parameter a checkpoint tensor goes into (q/k/v and gate/up: their fused one)."""
    parts = hf_name.removeprefix("model.").rsplit(".", 2)
    if len(parts) == 3 and parts[1] in _FUSED:
        return f"{parts[0]}.{_FUSED[parts[1]][0]}.{parts[2]}"
    return ".".join(parts)


def _checkpoint_names(params: dict[str, nn.Parameter]) -> list[str]:
    """The checkpoint tensors (without ``model.``) that fill ``params``, fused ones unpacked."""
    names = []
    for name in params:
        prefix, proj, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", name, "")
        parts = [p for p, (fused, _) in _FUSED.items() if fused == proj]
        names += [f"{prefix}.{p}.{kind}" for p in parts] if parts else [name]
    return names


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"
