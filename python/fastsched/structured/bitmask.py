"""Applying a step's token bitmask to the logits of the constrained rows, in one batched
tensor operation (no loop over the vocabulary or the rows)."""

from __future__ import annotations

import numpy as np
import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _BITS[device]


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """Set ``logits[rows[i], t]`` to -inf wherever bit ``t`` of ``bitmask[i]`` is 0."""
    if len(rows) == 0:
        return
    vocab = logits.shape[1]
    mask = torch.from_numpy(np.ascontiguousarray(bitmask)).to(logits.device, non_blocking=True)
    allowed = ((mask.unsqueeze(-1) >> _bit_positions(logits.device)) & 1).bool().flatten(1)[:, :vocab]
    index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
