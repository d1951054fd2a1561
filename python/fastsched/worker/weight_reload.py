"""A weight reload that every tensor-parallel rank makes, or none does (S13's RL use).

A checkpoint is outside input: a truncated file, a missing tensor or a shard that does not
fit fails with whatever the loader raises (``SafetensorError``, ``OSError``, ``KeyError``...).
So each rank first loads its shards beside the served weights and checks them against the
served model, all ranks then exchange their verdicts, and only when every rank has its
shards ready does each copy them in. A failure anywhere leaves every rank serving the old
weights, and the engine running; rank 0 reports the cause of each failed rank.
"""

from __future__ import annotations

import torch
from torch import nn

from fastsched.distributed.parallel import TensorParallel
from fastsched.distributed.step_channel import StepChannel
from fastsched.model_loader.weights import load_model
from fastsched.models.quant_linear import check_weights_fit, copy_weights


def load_checked(
    path: str,
    served: nn.Module,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None,
    tp: TensorParallel | None,
) -> tuple[nn.Module | None, str | None]:
    """This rank's shards of checkpoint ``path``, checked to fit ``served``; or (None, why not)."""
    try:
        new = load_model(path, dtype=dtype, device=device, quantization=quantization, tp=tp)
        check_weights_fit(served, new)
    except Exception as e:  # any failure of an outside file is the checkpoint's, not the engine's
        return None, f"{type(e).__name__}: {e}"
    return new, None


def swap_in(
    served: nn.Module, new: nn.Module | None, error: str | None, channel: StepChannel | None
) -> str | None:
    """Copies ``new`` into ``served`` if every rank loaded its shards (``error`` is this rank's
    reason why not); returns None then, else each failed rank's reason. Every rank calls it
    once per reload, after :meth:`StepChannel.send_reload` reached it."""
    errors = [error] if channel is None else channel.reload_vote(error)
    failed = [
        e if channel is None else f"tensor parallel rank {rank}: {e}"
        for rank, e in enumerate(errors)
        if e is not None
    ]
    if not failed:
        assert new is not None
        copy_weights(served, new)
    if channel is not None:
        channel.reloaded()
    return "; ".join(failed) or None
