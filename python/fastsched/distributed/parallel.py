"""A rank's place in the tensor-parallel group and the collectives the sharded model uses.

The model code asks only this object (``tp.rank``, ``tp.size``, ``tp.all_reduce``...), so
a model built without one (``tp=None``, tensor_parallel_size 1) runs exactly as before.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A collective that waits longer than this for a peer ends the engine (a hung worker).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def split_range(total: int, rank: int, size: int, *, uneven: bool = False) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``total``: equal shares, which ``size`` must
    divide, or with ``uneven`` the first ``total % size`` ranks one more each (whole KV heads
    of a model whose KV heads do not split evenly, e.g. SmolLM2's 3 over 2 ranks: 2 + 1)."""
    if total % size and not uneven:
        raise ValueError(f"{total} does not split over tensor_parallel_size {size}")
    share, extra = divmod(total, size)
    start = rank * share + min(rank, extra)
    return start, start + share + (rank < extra)


def data_parallel_devices(
    device: torch.device, engine_index: int, local_ranks: int, device_count: int
) -> list[torch.device]:
    """The devices data-parallel engine ``engine_index`` takes on this machine, rank 0's first.

    On CUDA engine ``d`` takes the ``local_ranks`` devices from ``d * local_ranks`` on (counted
    from the configured ``cuda:N``), so no two engines share one: ``local_ranks`` is
    tensor_parallel_size with local workers, 1 with Ray (which places the other ranks). More
    devices than are visible is an error naming them. The CPU is every engine's."""
    if device.type != "cuda":
        return [device] * local_ranks
    first = (device.index or 0) + engine_index * local_ranks
    if first + local_ranks > device_count:
        raise ValueError(
            f"data-parallel engine {engine_index} with {local_ranks} local tensor-parallel rank(s) needs "
            f"cuda:{first}..cuda:{first + local_ranks - 1}, but {device_count} CUDA devices are visible"
        )
    return [torch.device("cuda", first + r) for r in range(local_ranks)]


@dataclass
class TensorParallel:
    """One rank of the group. ``group`` carries the model's collectives (NCCL on CUDA);
    ``cpu_group`` (gloo) carries the step's host arrays."""

    rank: int
    size: int
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    device: torch.device

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> TensorParallel:
        """Joins (rank 0: forms) the group that meets at ``store`` (``fastsched.distributed.rendezvous``)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        group = dist.group.WORLD
        cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        assert group is not None
        logger.info("tensor parallel rank %d of %d joined (%s on %s)", rank, size, backend, device)
        return cls(rank, size, group, cpu_group, device)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums a row-parallel layer's partial outputs in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """``[n, vocab/size]`` per rank -> ``[n, vocab]`` on rank 0 (where sampling is); None elsewhere."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """This rank's ``[start, end)`` of the vocabulary and the rows each rank holds
        (``vocab_size`` rounded up to a multiple of ``size``; the last rank's tail is padding)."""
        per_rank = -(-vocab_size // self.size)
        start = self.rank * per_rank
        return start, min(start + per_rank, vocab_size), per_rank
