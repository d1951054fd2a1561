"""Reading a llama.cpp GGUF file: hyperparameters, tokenizer and (dequantized) weights.

Weights are dequantized once at load time to the serving dtype and renamed to the
Hugging Face layout, so the model code is the same for GGUF and safetensors. llama.cpp's
converter reorders the rows of q/k projections for the ``llama`` architecture (it wants
RoPE on adjacent pairs; Hugging Face rotates halves), and we undo that here.
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
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFFile:
    """A GGUF file opened once (memory-mapped); metadata parsed to plain Python values."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        self.path = path
        self.container = GGUFContainer(path)
        self.metadata: dict[str, Any] = self.container.metadata
        self.tensor_names = {tensor.name for tensor in self.container.tensors}

    def config(self) -> ModelConfig:
        check_gguf_metadata(self.metadata, self.container.tensors)  # before the model is sized from it
        return ModelConfig.from_gguf_metadata(self.metadata, self.tensor_names)

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
        return {_hf_name(t.name): KEPT_BITS[t.tensor_type] for t in self.container.tensors
                if t.tensor_type in KEPT_BITS and len(t.shape) == 2}

    def iter_weights(
        self, config: ModelConfig, keep_quantized: bool = False
    ) -> Iterator[tuple[str, np.ndarray | Int4Blocks | Int8Blocks]]:
        """Every tensor as (Hugging Face name, float32 array), with a progress bar; with
        ``keep_quantized``, the Q4_0/Q4_1/Q4_K matrices come as :class:`Int4Blocks` and the
        Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 ones as :class:`Int8Blocks` instead. Each array is a copy, not a view of
        the file; once the last is taken (or the iteration is abandoned) the file's pages are
        released from this process's resident memory."""
        unpermute = self.metadata["general.architecture"] == "llama"
        try:
            for tensor in tqdm(self.container.tensors, desc=f"Loading {self.path.name}", unit="tensor"):
                name = _hf_name(tensor.name)
                quantized = quantized_blocks(tensor) if keep_quantized else None
                parts = list(quantized) if quantized is not None else [dequantize(tensor)]
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


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name} has no place in a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
