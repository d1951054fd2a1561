"""A GGUF's metadata, bounded against its own tensor table before anything is built from it.

The model is built (and its memory allocated) from the metadata, the tensors are read only
afterwards, so a file whose metadata lies is caught here or not at all: ``block_count =
100000`` had ``LLM(path)`` allocate toward a terabyte for a minute before any tensor was
missed, ``head_count = 0`` was a ``ZeroDivisionError``. Every size must be a positive
integer of sane magnitude, the heads must divide, the layer count must be that of the
``blk.N`` tensors the file holds (each layer with the tensors of layer 0), and the layer-0
projections and the token embedding must have the shapes the metadata implies. Messages
name the field and its value, never other bytes of the file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastsched.model_loader.gguf_container import GGUFTensor

# No dimension of a model this server runs comes near this; it also keeps every product of
# a few of them far inside int64.
MAX_DIMENSION = 2**24
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)$")
# layer-0 tensor -> (its rows, its columns) as metadata sizes (numpy order: out, in).
_SHAPES = {
    "attn_q.weight": ("q", "hidden"),
    "attn_k.weight": ("kv", "hidden"),
    "attn_v.weight": ("kv", "hidden"),
    "attn_output.weight": ("hidden", "q"),
    "ffn_gate.weight": ("ffn", "hidden"),
    "ffn_up.weight": ("ffn", "hidden"),
    "ffn_down.weight": ("hidden", "ffn"),
}


def check_gguf_metadata(metadata: dict[str, Any], tensors: Sequence[GGUFTensor]) -> None:
    """``ValueError`` naming the first metadata field the file's tensors contradict; the
    architecture and missing keys are the model config's to report (``ModelConfig.from_gguf_metadata``)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return

    def size(name: str, default: int | None = None) -> int | None:
        full = f"{arch}.{name}"
        value = metadata.get(full, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DIMENSION:
            raise ValueError(
                f"GGUF metadata {full} = {_short(value)} must be an integer in [1, {MAX_DIMENSION}]"
            )
        return value

    layers, hidden, ffn = size("block_count"), size("embedding_length"), size("feed_forward_length")
    heads = size("attention.head_count")
    kv_heads = size("attention.head_count_kv", heads)
    size("context_length")
    size("vocab_size")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"GGUF metadata {arch}.attention.head_count_kv = {kv_heads} does not divide "
            f"{arch}.attention.head_count = {heads}"
        )
    head_dim = size("attention.key_length")
    if head_dim is None and heads is not None and hidden is not None:
        if hidden % heads:
            raise ValueError(
                f"GGUF metadata {arch}.embedding_length = {hidden} is not a multiple of "
                f"{arch}.attention.head_count = {heads} (and no attention.key_length says "
                "the head size)"
            )
        head_dim = hidden // heads
    if layers is not None:
        _check_layers(f"{arch}.block_count", layers, tensors)
    by_name = {t.name: t for t in tensors}
    expected = {
        "hidden": hidden,
        "ffn": ffn,
        "q": heads and head_dim and heads * head_dim,
        "kv": kv_heads and head_dim and kv_heads * head_dim,
    }
    fused_gate_up = "blk.0.ffn_gate.weight" not in by_name  # Phi-3: ffn_up holds gate and up
    for suffix, dims in _SHAPES.items():
        tensor = by_name.get(f"blk.0.{suffix}")
        want = tuple(expected[d] for d in dims)
        if suffix == "ffn_up.weight" and fused_gate_up and ffn is not None:
            want = (2 * ffn, *want[1:])
        if tensor is not None and None not in want and tuple(tensor.shape) != want:
            raise ValueError(
                f"GGUF tensor blk.0.{suffix} has shape {tuple(tensor.shape)}, but the metadata "
                f"({arch}.embedding_length, feed_forward_length, attention.*) implies {want}"
            )
    embedding = by_name.get("token_embd.weight")
    if embedding is not None and hidden is not None and embedding.shape[-1] != hidden:
        raise ValueError(
            f"GGUF tensor token_embd.weight has {embedding.shape[-1]} columns, but "
            f"{arch}.embedding_length = {hidden}"
        )


def _check_layers(field: str, layers: int, tensors: Sequence[GGUFTensor]) -> None:
    """Layers ``0..layers-1`` each hold the tensors of layer 0, and no other layer exists."""
    per_layer: dict[int, set[str]] = {}
    for tensor in tensors:
        match = _LAYER_TENSOR.match(tensor.name)
        if match is not None:
            per_layer.setdefault(int(match[1]), set()).add(match[2])
    if set(per_layer) != set(range(layers)):
        raise ValueError(
            f"GGUF metadata {field} = {layers}, but the file's tensors are of "
            f"{len(per_layer)} layers (blk.0 .. blk.{max(per_layer, default=-1)})"
        )
    first = per_layer.get(0, set())
    for index, names in per_layer.items():
        if names != first:
            missing = sorted(first - names) or sorted(names - first)
            raise ValueError(
                f"GGUF layer blk.{index} does not hold the tensors of blk.0 (differs in {missing[:4]})"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
