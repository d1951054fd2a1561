"""The batched LoRA delta of a mixed batch, where every token may use its own adapter.

Slot weights are stored side by side: ``a [in, S*K]`` and ``b [S*K, out]``, slot ``s``
owning columns (rows of ``b``) ``[s*K, (s+1)*K)``. Two formulations of punica's kernels:

- :func:`bgmv_dense` (batched gather matrix-vector, for few tokens: decodes). Each token
  is shrunk against every slot in one matmul, a per-token mask keeps its own slot's
  ``K`` columns (zeros for the base model), and one matmul expands them. Three ops
  whatever the adapters' mix. The gathered form (each token's ``A``/``B`` copied,
  then batched matrix-vector products) is what punica does on a GPU; on a CPU, for 64
  decode tokens of the tiny model, it took 1.7 ms per projection against 0.14 ms for
  this one (bench/RESULTS.md, "Multi-LoRA throughput").
- :func:`sgmv` (segmented, for many tokens: prefills). One pair of matmuls per adapter
  over its own tokens: the cost grows with the adapters in the step (at most
  ``max_loras``), where the dense form would multiply every token by every slot.
"""

from __future__ import annotations

import torch

# Up to this many tokens a step uses bgmv_dense, above it sgmv.
DENSE_MAX_TOKENS = 128


def bgmv_dense(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[t] += x[t] @ a_s @ b_s`` for each token's slot ``s``, selected by ``mask [T, S*K]``
    (ones on the token's slot's columns, zeros elsewhere)."""
    out.addmm_((x @ a).mul_(mask), b)


def sgmv(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rank: int,
    groups: list[tuple[int, torch.Tensor]],
    out: torch.Tensor,
) -> None:
    """Like :func:`bgmv_dense`, with the tokens given as ``(slot, token indices)`` groups
    (``rank``: the ``K`` columns of a slot); tokens in no group (the base model's) are left alone."""
    for slot, rows in groups:
        cols = slice(slot * rank, (slot + 1) * rank)
        out.index_add_(0, rows, (x[rows] @ a[:, cols]) @ b[cols])
