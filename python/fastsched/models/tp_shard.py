"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron's layout).

- column-parallel (output rows split): q/k/v by attention head, gate/up by row;
- row-parallel (input columns split, one all-reduce after): o by head, down by column; their
  bias only on rank 0, so that the all-reduce adds it once;
- vocab-parallel: embedding and lm_head rows, each rank ``ceil(vocab / size)`` of them, the
  last rank's tail zero padding;
- attention by whole GQA groups (the query heads that read one KV head): each rank holds whole
  KV heads with their groups' query heads, the first ``kv % size`` ranks one KV head more
  (SmolLM2's 9 query / 3 KV heads over 2 ranks: query heads 0-5 and KV heads 0-1, then 6-8
  and 2), so q/k/v and o_proj shards may differ in width between ranks; with fewer KV heads
  than ranks, each KV head is replicated on ``size / kv`` ranks, which split its group's
  query heads (:func:`head_ranges`);
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


def head_ranges(config: ModelConfig, rank: int, size: int) -> tuple[range, range]:
    """(query heads, KV heads) rank ``rank`` of ``size`` holds, whole GQA groups on one rank.

    Every KV head lives wholly on the ranks whose query heads read it, so attention needs no
    collective. With at least as many KV heads as ranks any count splits (unevenly if need
    be). With fewer, each KV head is replicated on the same number of ranks, so ``size``
    must be a multiple of the KV heads and each replica needs one of its group's query
    heads at least; anything else is refused naming the numbers."""
    heads, kv = config.num_heads, config.num_kv_heads
    group = heads // kv
    if kv >= size:
        first, last = split_range(kv, rank, size, uneven=True)
        return range(first * group, last * group), range(first, last)
    replicas = size // kv
    if size % kv or group < replicas:
        raise ValueError(
            f"the model's {heads} attention heads and {kv} KV heads do not split over "
            f"tensor_parallel_size {size}: with fewer KV heads than ranks each KV head is replicated "
            f"on the same number of ranks (tensor_parallel_size a multiple of {kv}, at most {heads})"
        )
    head = rank // replicas
    start, end = split_range(group, rank % replicas, replicas, uneven=True)
    return range(head * group + start, head * group + end), range(head, head + 1)


def local_heads(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """How many (query heads, KV heads) one rank holds (they may differ between ranks)."""
    q, kv = head_ranges(config, tp.rank, tp.size)
    return len(q), len(kv)


def describe_head_split(config: ModelConfig, size: int) -> str:
    """Each rank's heads, for the start-up log: ``rank 0 q 0-5 kv 0-1; rank 1 q 6-8 kv 2``."""

    def span(r: range) -> str:
        return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"

    ranks = []
    for rank in range(size):
        q, kv = head_ranges(config, rank, size)
        ranks.append(f"rank {rank} q {span(q)} kv {span(kv)}")
    return "; ".join(ranks)


def _parts(w: Int4Weight | Int8Weight) -> list[torch.Tensor]:
    """A quantized weight's tensors, codes first (then its per-group parameters)."""
    return [w.codes, w.scale] + ([w.zero] if w.zero is not None else [])


def weight_rows(w: Weight, start: int, end: int) -> Weight:
    """Rows ``start:end`` of a dense or quantized weight (a quantized one's groups run along rows)."""
    if isinstance(w, (Int4Weight, Int8Weight)):
        return type(w)(*(t[start:end] for t in _parts(w)))
    return w[start:end]


def _columns(name: str, w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, (Int4Weight, Int8Weight)):
        if start % GROUP_SIZE or end % GROUP_SIZE:
            raise ValueError(
                f"{name}: a row-parallel shard of a quantized weight must be whole groups of "
                f"{GROUP_SIZE} columns; this rank's is [{start}, {end})"
            )
        # a parameter covers K / its columns: scales 32 or 16 columns (Int8Weight), zeros 32
        codes, *groups = _parts(w)
        k = codes.shape[1]
        sliced = (t[:, start * t.shape[1] // k : end * t.shape[1] // k] for t in groups)
        return type(w)(codes[:, start:end], *sliced)
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
    q_heads, kv_heads = head_ranges(config, tp.rank, tp.size)
    if proj == "q_proj":
        return weight_rows(w, q_heads.start * hd, q_heads.stop * hd)
    if proj in ("k_proj", "v_proj"):
        return weight_rows(w, kv_heads.start * hd, kv_heads.stop * hd)
    if proj in ("gate_proj", "up_proj"):
        return weight_rows(w, *split_range(config.intermediate_size, tp.rank, tp.size))
    if proj in ("o_proj", "down_proj"):
        if kind == "bias":
            return w if tp.rank == 0 else torch.zeros_like(w)
        if proj == "o_proj":
            return _columns(name, w, q_heads.start * hd, q_heads.stop * hd)
        return _columns(name, w, *split_range(config.intermediate_size, tp.rank, tp.size))
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, end, per_rank = tp.vocab_range(config.vocab_size)
        return _pad_rows(weight_rows(w, start, end), per_rank)
    return w
