"""Applying a step's token bitmask to the logits of the constrained rows, in one batched
operation (no loop over the vocabulary or the rows).

On the CPU the bits are unpacked by numpy (``unpackbits``, ~3× faster than shifting in
torch there); on a GPU the packed mask is copied over (32× smaller than a boolean one)
and unpacked by torch on the device."""

from __future__ import annotations

from concurrent.futures import Future

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
        bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")[
            :, :vocab
        ]
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
        logits[rows[0] : rows[-1] + 1].masked_fill_(forbidden, float("-inf"))
        return
    index = torch.from_numpy(rows).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


class StepBitmask:
    """The token bitmask of one step's constrained rows, which may be filled after the step
    was launched: with async scheduling step N+1 is prepared before step N's tokens, which
    its masks depend on, are known. The forward thread waits for it (:meth:`apply`) only
    between the forward pass and sampling, so the masks are computed while the pass runs."""

    def __init__(self, rows: np.ndarray, keys: np.ndarray) -> None:
        self.rows = rows  # indices among the step's sampled rows (= rows of its logits)
        self.keys = keys  # the matchers' keys (requests) of those rows
        self._filled: Future[tuple[np.ndarray, np.ndarray]] = Future()

    def fill(self, bitmask: np.ndarray, rows: np.ndarray) -> None:
        """``bitmask[i]`` for logits row ``rows[i]`` (``rows``: the constrained rows still live).
        The array is only read by :meth:`apply`, which runs before the next fill reuses it."""
        self._filled.set_result((bitmask, rows))

    def abandon(self) -> None:
        """The step will never be sampled (a step before it failed): release the forward thread."""
        if not self._filled.done():
            self._filled.set_exception(
                RuntimeError("the step was abandoned before its token bitmask was filled")
            )

    def apply(self, logits: torch.Tensor) -> None:
        bitmask, rows = self._filled.result()
        apply_token_bitmask(logits, bitmask, rows)
