"""Triton BGMV for CUDA: each token's LoRA delta from its own slot's weights, gathered.

Same layout as :mod:`fastsched.lora.punica` (``a [in, S*K]``, ``b [S*K, out]``, slot
``s`` owning columns ``[s*K, (s+1)*K)``), but where ``bgmv_dense`` shrinks every token
against every slot and masks, this kernel reads only the token's own slot, punica's
gathered form: on a GPU the gather is cheap and the dense shrink's ``S``-fold work is not.

Grid ``(T, cdiv(out, BLOCK_OUT))``: a program shrinks its token against its slot's ``A``
(``[in, K]``, in ``BLOCK_IN`` chunks, fp32 accumulation), then expands into
``BLOCK_OUT`` output columns and adds them to ``out`` in place. The programs of one token
recompute the small shrink rather than share it, so no two programs write the same
element. A token of slot ``-1`` (the base model) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_IN = 64
BLOCK_OUT = 64


@triton.jit
def _bgmv_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    in_features,
    out_features,
    rank_k,
    stride_x,
    stride_a,
    stride_b,
    stride_out,
    BLOCK_IN: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    out_block = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    ks = tl.arange(0, K_PAD)
    k_mask = ks < rank_k
    cols = slot * rank_k + ks
    shrunk = tl.zeros([K_PAD], dtype=tl.float32)
    for start in range(0, in_features, BLOCK_IN):
        ins = start + tl.arange(0, BLOCK_IN)
        in_mask = ins < in_features
        x = tl.load(x_ptr + token * stride_x + ins, mask=in_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + ins[:, None] * stride_a + cols[None, :],
            mask=in_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        shrunk += tl.sum(x[:, None] * a, axis=0)
    outs = out_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = outs < out_features
    b = tl.load(
        b_ptr + cols[:, None] * stride_b + outs[None, :], mask=k_mask[:, None] & out_mask[None, :], other=0.0
    ).to(tl.float32)
    delta = tl.sum(shrunk[:, None] * b, axis=0)
    out_offsets = out_ptr + token * stride_out + outs
    previous = tl.load(out_offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_offsets, (previous + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


def bgmv_triton(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[t] += x[t] @ a[:, s*K:(s+1)*K] @ b[s*K:(s+1)*K]`` for ``s = token_slots[t] >= 0``
    (``rank`` is ``K``), in place. ``x``, ``a``, ``b`` and ``out`` need a contiguous last dimension."""
    num_tokens, in_features = x.shape
    out_features = out.shape[1]
    if num_tokens == 0:
        return
    for name, t in (("x", x), ("a", a), ("b", b), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"bgmv_triton: {name} must have a contiguous last dimension")
    grid = (num_tokens, triton.cdiv(out_features, BLOCK_OUT))
    _bgmv_kernel[grid](
        x,
        a,
        b,
        token_slots,
        out,
        in_features,
        out_features,
        rank,
        x.stride(0),
        a.stride(0),
        b.stride(0),
        out.stride(0),
        BLOCK_IN=BLOCK_IN,
        K_PAD=triton.next_power_of_2(rank),
        BLOCK_OUT=BLOCK_OUT,
    )
