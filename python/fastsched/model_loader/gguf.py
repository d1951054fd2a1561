"""Reading a llama.cpp GGUF file: hyperparameters, tokenizer and (dequantized) weights.

Weights are dequantized once at load time to the serving dtype and renamed to the
Hugging Face layout, so the model code is the same for GGUF and safetensors. llama.cpp's
converter reorders the rows of q/k projections for the ``llama`` architecture (it wants
RoPE on adjacent pairs; Hugging Face rotates halves), and we undo that here. For Gemma
it stores each RMSNorm weight as ``1 + w``; we subtract the one again (exact in fp32 for
weights near one), since the model scales by ``1 + w`` as the Hugging Face checkpoint reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fastsched.model_loader.gguf_checks import check_gguf_metadata
from fastsched.model_loader.gguf_container import GGUFContainer
from fastsched.model_loader.gguf_quants import KEPT_BITS, Int4Blocks, Int8Blocks, dequantize, quantized_blocks
from fastsched.model_loader.gguf_tokenizer import gguf_tokenizer
from fastsched.model_loader.tokenizer import Tokenizer
from fastsched.models.config import ModelConfig

# GGUF tensor names -> Hugging Face names; ``{}`` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's layer tensors differ from the Llama family's: Gemma's ffn_norm is the
# norm before the MLP (Llama's post_attention_layernorm), with a norm after attention and one after
# the MLP; Phi-3 stores q/k/v and gate/up fused.
_ARCH_LAYER_NAMES = {
    "gemma2": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_GEMMA = ("gemma2", "gemma3")
# Phi-3's LongRoPE factors are tensors in a GGUF file: config, not weights.
ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def layer_names(arch: str) -> dict[str, str]:
    """llama.cpp layer tensor name -> Hugging Face module path (after ``model.layers.N.``) for ``arch``."""
    return {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}


class GGUFFile:
    """A GGUF file opened once (memory-mapped); metadata parsed to plain Python values."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        self.path = path
        self.container = GGUFContainer(path)
        self.metadata: dict[str, Any] = self.container.metadata
        self.tensor_names = {tensor.name for tensor in self.container.tensors}
        self.arch = str(self.metadata.get("general.architecture"))

    def config(self) -> ModelConfig:
        check_gguf_metadata(self.metadata, self.container.tensors)  # before the model is sized from it
        factors = {
            ROPE_FACTOR_TENSORS[t.name]: dequantize(t).reshape(-1).tolist()
            for t in self.container.tensors
            if t.name in ROPE_FACTOR_TENSORS
        }
        return ModelConfig.from_gguf_metadata(self.metadata, self.tensor_names, factors)

    def hf_name(self, gguf_name: str) -> str:
        """The Hugging Face name of weight tensor ``gguf_name`` in this file's architecture."""
        return _hf_name(gguf_name, self.arch)

    def weight_tensors(self) -> list[Any]:
        """The tensors that are weights (not Phi-3's RoPE factors), in file order."""
        return [t for t in self.container.tensors if t.name not in ROPE_FACTOR_TENSORS]

    def tokenizer(self) -> Tokenizer:
        return gguf_tokenizer(self.metadata)

    def quantization_types(self) -> dict[str, int]:
        """How many tensors the file holds of each GGML type (``{"Q4_1": 210, ...}``), for the log."""
        counts: dict[str, int] = {}
        for tensor in self.container.tensors:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts

    def quantized_tensor_names(self) -> dict[str, int]:
        """Hugging Face names of the tensors ``iter_weights(keep_quantized=True)`` keeps
        quantized, with their bits (:data:`gguf_quants.KEPT_BITS`). Reads only the headers' types."""
        return {
            self.hf_name(t.name): KEPT_BITS[t.tensor_type]
            for t in self.weight_tensors()
            if t.tensor_type in KEPT_BITS and len(t.shape) == 2
        }

    def iter_weights(
        self, config: ModelConfig, keep_quantized: bool = False
    ) -> Iterator[tuple[str, np.ndarray | Int4Blocks | Int8Blocks]]:
        """Every tensor as (Hugging Face name, float32 array), with a progress bar; with
        ``keep_quantized``, the Q4_0/Q4_1/Q4_K matrices come as :class:`Int4Blocks` and the
        Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 ones as :class:`Int8Blocks` instead. Each array is a copy, not a view of
        the file; once the last is taken (or the iteration is abandoned) the file's pages are
        released from this process's resident memory."""
        unpermute = self.arch == "llama"
        try:
            for tensor in tqdm(self.weight_tensors(), desc=f"Loading {self.path.name}", unit="tensor"):
                name = self.hf_name(tensor.name)
                quantized = quantized_blocks(tensor) if keep_quantized else None
                parts = list(quantized) if quantized is not None else [dequantize(tensor)]
                if quantized is None and self.arch in _GEMMA and name.endswith("norm.weight"):
                    parts = [parts[0] - np.float32(1.0)]
                heads = None
                if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
                    heads = config.num_heads
                elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
                    heads = config.num_kv_heads
                if heads is not None:  # rows move whole: codes, scales and zeros alike
                    parts = [None if p is None else _unpermute_rope_rows(p, heads) for p in parts]
                yield name, type(quantized)(*parts) if quantized is not None else parts[0]
        finally:
            self.container.release_pages()


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: within each head its converter moved row
    ``half * head_dim/2 + i`` to ``2 * i + half``; put the rows back in rotate-half order."""
    head_dim = weights.shape[0] // num_heads
    w = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weights.shape))


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    names = layer_names(arch)
    if match is None or match[2] not in names:
        raise ValueError(f"GGUF tensor {gguf_name} has no place in a {arch} model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"
