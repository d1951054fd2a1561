"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron's layout).

- column-parallel (output rows split): q/k/v by attention head, gate/up by row;
- row-parallel (input columns split, one all-reduce after): o by head, down by column; their
  bias only on rank 0, so that the all-reduce adds it once;
- vocab-parallel: embedding and lm_head rows, each rank ``ceil(vocab / size)`` of them, the
  last rank's tail zero padding;
- KV heads split like the query heads, or, with fewer KV heads than ranks, the one KV head
  that the rank's query heads read, replicated;
- everything else (norms) whole.

A quantized weight (:class:`Int4Weight`, :class:`Int8Weight`) is sliced before it is packed: by rows, or by columns in whole
groups of ``GROUP_SIZE`` (a row-parallel shard whose width is not a multiple of it is
refused, naming the layer, rather than dequantized behind the user's back).
"""

from __future__ import annotations

import torch

from fastsched.distributed.parallel import TensorParallel, split_range
from fastsched.kernels.quant_matmul import GROUP_SIZE, Int4Weight, Int8Weight
from fastsched.models.config import ModelConfig

Weight = torch.Tensor | Int4Weight | Int8Weight


def local_heads(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds; errors name the head count that does not split."""
    if config.num_heads % tp.size:
        raise ValueError(f"the model's {config.num_heads} attention heads do not split over tensor_parallel_size "
                         f"{tp.size}")
    kv = config.num_kv_heads
    if kv % tp.size and tp.size % kv:
        raise ValueError(f"the model's {kv} KV heads neither split over nor replicate onto tensor_parallel_size "
                         f"{tp.size}")
    return config.num_heads // tp.size, max(kv // tp.size, 1)


def _kv_head_range(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    kv = config.num_kv_heads
    if kv >= tp.size:
        return split_range(kv, tp.rank, tp.size)
    head = tp.rank * kv // tp.size  # the KV head this rank's query heads read (replicated)
    return head, head + 1


def _parts(w: Int4Weight | Int8Weight) -> list[torch.Tensor]:
    """A quantized weight's tensors, codes first (then its per-group parameters)."""
    return [w.codes, w.scale] + ([w.zero] if isinstance(w, Int4Weight) else [])


def _rows(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, (Int4Weight, Int8Weight)):
        return type(w)(*(t[start:end] for t in _parts(w)))
    return w[start:end]


def _columns(name: str, w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, (Int4Weight, Int8Weight)):
        if start % GROUP_SIZE or end % GROUP_SIZE:
            raise ValueError(f"{name}: a row-parallel shard of a quantized weight must be whole groups of "
                             f"{GROUP_SIZE} columns; this rank's is [{start}, {end})")
        g0, g1 = start // GROUP_SIZE, end // GROUP_SIZE
        codes, *groups = _parts(w)
        return type(w)(codes[:, start:end], *(t[:, g0:g1] for t in groups))
    return w[:, start:end]


def _pad_rows(w: Weight, rows: int) -> Weight:
    missing = rows - w.shape[0]
    if missing == 0:
        return w
    if isinstance(w, (Int4Weight, Int8Weight)):  # zero codes and parameters dequantize to 0
        return type(w)(*(torch.cat([t, t.new_zeros(missing, t.shape[1])]) for t in _parts(w)))
    return torch.cat([w, w.new_zeros(missing, *w.shape[1:])])


def shard_weight(name: str, w: Weight, config: ModelConfig, tp: TensorParallel) -> Weight:
    """Rank ``tp.rank``'s part of checkpoint tensor ``name`` (without ``model.``)."""
    parts = name.rsplit(".", 2)
    proj, kind = (parts[-2], parts[-1]) if len(parts) == 3 else ("", name)
    hd = config.head_dim
    if proj == "q_proj":
        start, end = split_range(config.num_heads, tp.rank, tp.size)
        return _rows(w, start * hd, end * hd)
    if proj in ("k_proj", "v_proj"):
        start, end = _kv_head_range(config, tp)
        return _rows(w, start * hd, end * hd)
    if proj in ("gate_proj", "up_proj"):
        return _rows(w, *split_range(config.intermediate_size, tp.rank, tp.size))
    if proj in ("o_proj", "down_proj"):
        if kind == "bias":
            return w if tp.rank == 0 else torch.zeros_like(w)
        width = config.num_heads * hd if proj == "o_proj" else config.intermediate_size
        return _columns(name, w, *split_range(width, tp.rank, tp.size))
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, end, per_rank = tp.vocab_range(config.vocab_size)
        return _pad_rows(_rows(w, start, end), per_rank)
    return w
