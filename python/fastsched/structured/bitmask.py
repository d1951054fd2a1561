"""Applying a step's token bitmask to the logits of the constrained rows, in one batched
operation (no loop over the vocabulary or the rows).

On the CPU the bits are unpacked by numpy (``unpackbits``, ~3× faster than shifting in
torch there); on a GPU the packed mask is copied over (32× smaller than a boolean one)
and unpacked by torch on the device."""

from __future__ import annotations

import numpy as np
import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _BITS[device]


def _forbidden(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """A boolean (rows, vocab) tensor on the logits' device: True where a token is not allowed."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(bits) == 0
    mask = torch.from_numpy(np.ascontiguousarray(bitmask)).to(logits.device, non_blocking=True)
    return (((mask.unsqueeze(-1) >> _bit_positions(logits.device)) & 1) == 0).flatten(1)[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """Set ``logits[rows[i], t]`` to -inf wherever bit ``t`` of ``bitmask[i]`` is 0."""
    n = len(rows)
    if n == 0:
        return
    forbidden = _forbidden(logits, bitmask[:n])
    rows = np.asarray(rows, dtype=np.int64)
    if rows[-1] - rows[0] == n - 1 and np.all(np.diff(rows) == 1):  # a contiguous block: fill in place
        logits[rows[0]:rows[-1] + 1].masked_fill_(forbidden, float("-inf"))
        return
    index = torch.from_numpy(rows).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
