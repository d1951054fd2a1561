"""Whole KV blocks in and out of the KV cache, for the KV connector, with or without tensor parallelism.

A tensor-parallel rank's cache holds only its KV heads of each block. The connector's store
holds whole blocks, as a single-rank engine reads them: a save gathers the ranks' heads onto
rank 0, a load scatters them from there (:class:`BlockShards`). Rank 0 alone looks up, reads
and writes the store. Chosen over each rank storing its own heads keyed by rank because:

- one lookup, one file and one load result per block: the ranks cannot disagree on which
  blocks were loaded (one rank's missing or corrupt file would leave a block half loaded);
- the store does not depend on the layout (:class:`StoreIdentity` is the model's), so engines
  of one model with different ``tensor_parallel_size`` share it, and a restart may change it;
- its cost is the copy over the group: ``(N - 1) / N`` of each saved or loaded block's bytes
  reach or leave rank 0 (docs/deploy.md gives the figures), where a store per rank would move
  none; the bytes written to the store are the same either way.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastsched.distributed.parallel import TensorParallel
from fastsched.models.config import ModelConfig
from fastsched.models.tp_shard import shard_weight


def read_blocks(kv_caches: list[torch.Tensor], block_ids: np.ndarray) -> torch.Tensor:
    """Blocks of this rank's cache, copied to the CPU: [n, layers, 2 (K, V), block_size, kv_heads, head_dim]."""
    first = kv_caches[0]
    index = torch.from_numpy(block_ids.astype(np.int64)).to(first.device)
    blocks = torch.empty(
        (len(block_ids), len(kv_caches), 2, *first.shape[2:]), dtype=first.dtype, device=first.device
    )
    for layer, kv in enumerate(kv_caches):
        # Gather, then one strided copy: ~5x faster on CPU than stacking and permuting.
        blocks[:, layer].copy_(kv[:, index].transpose(0, 1))
    return blocks.cpu()


def write_blocks(kv_caches: list[torch.Tensor], block_ids: np.ndarray, blocks: torch.Tensor) -> None:
    """Fills blocks of this rank's cache with ``blocks`` as :func:`read_blocks` returns them."""
    device = kv_caches[0].device
    index = torch.from_numpy(block_ids.astype(np.int64)).to(device)
    data = blocks.to(device, non_blocking=True)
    for layer, kv in enumerate(kv_caches):
        kv[:, index] = data[:, layer].transpose(0, 1)


def kv_heads_of(config: ModelConfig, rank: int, size: int) -> list[int]:
    """The model's KV heads rank ``rank`` of ``size`` holds, in its cache's order: those of its
    ``k_proj`` shard, so they follow the model's own split (replicated heads included)."""
    hd = config.head_dim
    heads = torch.arange(config.num_kv_heads).repeat_interleave(hd)[:, None]
    tp = TensorParallel(rank, size, group=None, cpu_group=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    return shard_weight("layers.0.self_attn.k_proj.weight", heads, config, tp)[::hd, 0].tolist()


class BlockShards:
    """Moves blocks between the ranks' caches (their heads) and rank 0 (whole blocks)."""

    def __init__(self, tp: TensorParallel, config: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        self.tp = tp
        self.num_kv_heads = config.num_kv_heads
        self.heads = [kv_heads_of(config, r, tp.size) for r in range(tp.size)]
        self.width = max(
            map(len, self.heads)
        )  # every rank's part is padded to it (collectives need one shape)
        self.dtype = dtype
        self.part_shape = (config.num_layers, 2, block_size, self.width, config.head_dim)  # one block's part
        self.bytes_moved = 0  # bytes that crossed the group to or from rank 0

    def _padded(self, local: torch.Tensor) -> torch.Tensor:
        missing = self.width - local.shape[-2]
        return F.pad(local, (0, 0, 0, missing)) if missing else local.contiguous()

    def gather(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's :func:`read_blocks` -> whole blocks on rank 0 (None on the others)."""
        local = self._padded(local)
        if self.tp.rank != 0:
            dist.gather(local, None, dst=0, group=self.tp.cpu_group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.gather(local, parts, dst=0, group=self.tp.cpu_group)
        whole = local.new_empty((*local.shape[:-2], self.num_kv_heads, local.shape[-1]))
        for heads, part in zip(self.heads, parts):
            whole[..., heads, :] = part[..., : len(heads), :]
        self.bytes_moved += local.nbytes * (self.tp.size - 1)
        return whole

    def scatter(self, whole: torch.Tensor | None, num_blocks: int) -> torch.Tensor:
        """Whole blocks on rank 0 (None on the others) -> each rank's heads of them, for :func:`write_blocks`."""
        local = torch.empty((num_blocks, *self.part_shape), dtype=self.dtype)
        parts = None
        if self.tp.rank == 0:
            assert whole is not None
            parts = [self._padded(whole[..., heads, :].to(self.dtype)) for heads in self.heads]
            self.bytes_moved += local.nbytes * (self.tp.size - 1)
        dist.scatter(local, parts, src=0, group=self.tp.cpu_group)
        return local[..., : len(self.heads[self.tp.rank]), :]
