"""Triton int4 and int8 dequantize-matmuls for CUDA (see :mod:`fastsched.kernels.quant_matmul`
for the forms).

Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``: a program walks K in ``BLOCK_K`` steps
(a multiple of the group size, so a step's columns share whole groups), loads the
``[BLOCK_N, BLOCK_K / 2]`` bytes of its codes once, splits their nibbles into even and
odd columns, applies each column's group scale and zero in registers and accumulates
two fp32 ``tl.dot`` (even and odd columns against the matching activation columns).
The weight is read from memory once per M tile, at half a byte a weight.

The int8 kernel (:func:`int8_matmul`) has the same grid and K steps over ``[N, K]`` int8
codes, a scale per ``SCALE_GROUP`` (32 or 16) columns and, with ``HAS_ZERO``, a zero per
group: one ``tl.dot`` a step.

Tested under ``TRITON_INTERPRET=1`` against :func:`dequantize_int4` / :func:`dequantize_int8`
(tests/kernels); not run on a GPU by this project.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    half = tl.arange(0, BLOCK_K // 2)  # byte j of the step holds columns 2j and 2j + 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        byte = start // 2 + half
        byte_mask = byte < K // 2
        codes = tl.load(
            packed_ptr + cols[:, None] * stride_pn + byte[None, :],
            mask=col_mask[:, None] & byte_mask[None, :],
            other=0,
        ).to(tl.int32)
        group = (start + 2 * half) // GROUP  # both columns of a byte are in one group
        s = tl.load(
            scale_ptr + cols[:, None] * stride_sn + group[None, :],
            mask=col_mask[:, None] & byte_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        z = tl.load(
            zero_ptr + cols[:, None] * stride_sn + group[None, :],
            mask=col_mask[:, None] & byte_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w_even = ((codes & 0xF) - 8).to(tl.float32) * s + z  # [BLOCK_N, BLOCK_K / 2]
        w_odd = ((codes >> 4) - 8).to(tl.float32) * s + z
        x_mask = row_mask[:, None] & byte_mask[None, :]
        x_even = tl.load(
            x_ptr + rows[:, None] * stride_xm + (start + 2 * half)[None, :], mask=x_mask, other=0.0
        )
        x_odd = tl.load(
            x_ptr + rows[:, None] * stride_xm + (start + 2 * half + 1)[None, :], mask=x_mask, other=0.0
        )
        acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even))
        acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd))
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x``'s dtype; ``K`` a multiple of ``group_size`` and of 2."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
        raise ValueError(
            f"int4 matmul: x {tuple(x.shape)} does not fit packed {tuple(packed.shape)}, "
            f"scale {tuple(scale.shape)}, zero {tuple(zero.shape)}"
        )
    if BLOCK_K % group_size and group_size % BLOCK_K:
        raise ValueError(f"group size {group_size} must divide or be divided by BLOCK_K {BLOCK_K}")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int4_matmul_kernel[grid](
        x,
        packed,
        scale,
        zero,
        out,
        m,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP=group_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        w_mask = col_mask[:, None] & (k < K)[None, :]
        c = tl.load(codes_ptr + cols[:, None] * stride_cn + k[None, :], mask=w_mask, other=0).to(tl.float32)
        s = tl.load(
            scale_ptr + cols[:, None] * stride_sn + (k // SCALE_GROUP)[None, :], mask=w_mask, other=0.0
        )
        w = c * s  # [BLOCK_N, BLOCK_K]
        if HAS_ZERO:
            w += tl.load(zero_ptr + cols[:, None] * stride_zn + (k // GROUP)[None, :], mask=w_mask, other=0.0)
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=row_mask[:, None] & (k < K)[None, :],
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), tl.trans(w))
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def int8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x``'s dtype for ``w = scale · c (+ zero)``: a scale per
    ``K / scale.shape[1]`` columns (``group_size`` or half of it), a zero per ``group_size``."""
    m, k = x.shape
    n = codes.shape[0]
    groups = k // group_size
    if (
        codes.shape != (n, k)
        or k % group_size
        or scale.shape not in ((n, groups), (n, 2 * groups))
        or (zero is not None and zero.shape != (n, groups))
    ):
        raise ValueError(
            f"int8 matmul: x {tuple(x.shape)} does not fit codes {tuple(codes.shape)}, scale "
            f"{tuple(scale.shape)}, zero {None if zero is None else tuple(zero.shape)}"
        )
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int8_matmul_kernel[grid](
        x,
        codes,
        scale,
        scale if zero is None else zero,
        out,
        m,
        n,
        k,
        x.stride(0),
        codes.stride(0),
        scale.stride(0),
        0 if zero is None else zero.stride(0),
        out.stride(0),
        GROUP=group_size,
        SCALE_GROUP=k // scale.shape[1],
        HAS_ZERO=zero is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out
