"""The batched LoRA delta of a mixed batch, in punica's two formulations (torch).

Every token of a step carries the device slot of its request's adapter (``-1``: none).
Slot weights are stacked, ``a [S, K, in]`` and ``b [S, out, K]``, with one extra
all-zero slot last so that ``-1`` indexes it: a base-model token gets a zero delta
without a branch.

- :func:`bgmv` (batched gather matrix-vector): gathers each token's A and B and does
  two batched products. One pair of kernels whatever the number of adapters, but the
  gathered weights grow with the tokens: the decode shape (a token per request).
- :func:`sgmv` (segmented): one pair of matmuls per adapter over its tokens. The cost
  grows with the adapters in the step (at most ``max_loras``), not with the tokens'
  weight copies: the prefill shape.
"""

from __future__ import annotations

import torch

# Above this many tokens a step uses sgmv: the gathered weights of bgmv would be
# tokens x (K x in + out x K) elements.
BGMV_MAX_TOKENS = 128


def bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``[T, in] -> [T, out]``: row t is ``b[s] @ (a[s] @ x[t])`` with ``s = token_slots[t]``."""
    shrunk = torch.bmm(a[token_slots], x.unsqueeze(-1))  # [T, K, 1]
    return torch.bmm(b[token_slots], shrunk).squeeze(-1)


def sgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Like :func:`bgmv`, with the tokens given as ``(slot, token indices)`` groups; tokens
    in no group (the base model's) get zeros."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    for slot, rows in groups:
        out[rows] = (x[rows] @ a[slot].T) @ b[slot].T
    return out
