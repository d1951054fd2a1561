"""The 8-bit form's layouts beyond Q8_0 (``fastsched.kernels.quant_matmul.Int8Weight``): a
scale per 16 columns (GGUF Q6_K) and a zero per group (Q5_1, Q5_K), through the Rust CPU
kernels (GEMV below ``DENSE_MIN_ROWS`` rows, the bf16 GEMM from there), the torch custom op,
the Triton kernel (interpreter), and :func:`fuse` of shards that differ in format.

Tolerances (bounds, not fits), as tests/kernels/test_quant_matmul_cpu.py: the GEMV rounds
each activation to int8 per group (half a step, ``max|x|_group / 254``), and that error
meets the code terms ``scale · c`` (the zeros meet the exact ``Σx``), so an output is within
``Σ |scale · c| · max|x|_group / 254 + 1e-5 · Σ |w·x|``; the GEMM rounds weights,
activations and output to bf16: ``2⁻⁷ · Σ |w·x| + 2⁻⁸ · |out|`` (+ 1e-5 · Σ |w·x|).
"""

from __future__ import annotations

import pytest
import torch

from fastsched.kernels import quant_matmul_cpu
from fastsched.kernels.quant_matmul import (
    GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    PackedInt8,
    dequantize_int8,
    fuse,
)

LAYOUTS = [(32, False), (32, True), (16, False), (16, True)]


def _int8(n: int, k: int, seed: int, scale_group: int, with_zero: bool) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // scale_group, generator=gen) * 0.002 + 0.0002
    zero = torch.randn(n, k // GROUP_SIZE, generator=gen) * 0.05 if with_zero else None
    return Int8Weight(codes, scale, zero)


def _check(out: torch.Tensor, x: torch.Tensor, w: Int8Weight) -> None:
    x64, dense = x.double(), w.dequantize().double()
    terms = dequantize_int8(w.codes, w.scale).double()  # the part the rounded activations meet
    exact = x64 @ dense.t()
    magnitude = x64.abs() @ dense.abs().t()
    if x.shape[0] < quant_matmul_cpu.DENSE_MIN_ROWS:
        amax = x64.abs().reshape(x.shape[0], -1, GROUP_SIZE).amax(-1).repeat_interleave(GROUP_SIZE, 1)
        bound = (amax / 254) @ terms.abs().t() + 1e-5 * magnitude
    else:
        bound = 2**-7 * magnitude + 2**-8 * exact.abs() + 1e-5 * magnitude
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(37, 96), (130, 576), (19, 160)])
@pytest.mark.parametrize(("scale_group", "with_zero"), LAYOUTS)
def test_every_layout_equals_dequantize_then_matmul(
    scale_group: int, with_zero: bool, m: int, n: int, k: int
) -> None:
    weight = _int8(n, k, n + k + m, scale_group, with_zero)
    packed = PackedInt8(weight, torch.device("cpu"))
    assert packed.kind == "cpu_rust" and packed.cpu.scale_group == scale_group
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    _check(packed.matmul(x), x, weight)
    xb = x.bfloat16()
    _check(packed.matmul(xb).float(), xb.float(), weight)


@pytest.mark.parametrize(("scale_group", "with_zero"), LAYOUTS)
def test_a_row_has_the_same_bits_alone_or_in_a_batch(scale_group: int, with_zero: bool) -> None:
    """Batch invariance on both paths: 5 rows (GEMV) and 20 rows (GEMM) against each row alone
    at the same path (the GEMV below DENSE_MIN_ROWS rows, the GEMM from there)."""
    weight = _int8(70, 160, 3, scale_group, with_zero)
    packed = PackedInt8(weight, torch.device("cpu"))
    for m in (5, 20):
        x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).bfloat16()
        batch = packed.matmul(x, torch.float32)
        for r in range(m):
            padded = x[r : r + 1].expand(m if m >= quant_matmul_cpu.DENSE_MIN_ROWS else 1, -1)
            assert torch.equal(packed.matmul(padded, torch.float32)[0], batch[r]), (m, r)


def test_the_custom_op_takes_the_zero_and_the_half_group_scales() -> None:
    weight = _int8(70, 96, 4, 16, True)
    packed = PackedInt8(weight, torch.device("cpu"))
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    tensors = packed.cpu.tensors
    assert len(tensors) == 3
    assert torch.equal(torch.ops.fastsched.int8_matmul(x, *tensors), packed.matmul(x))
    torch.library.opcheck(torch.ops.fastsched.int8_matmul, (x, *tensors))


def test_gathered_rows_dequantize_with_their_zero_and_half_group_scales() -> None:
    weight = _int8(40, 64, 6, 16, True)
    packed = PackedInt8(weight, torch.device("cpu"))
    ids = torch.tensor([[3, 0], [39, 3]])
    torch.testing.assert_close(packed.rows(ids, torch.float32), weight.dequantize()[ids], rtol=0, atol=0)


def test_a_weight_whose_parameters_do_not_fit_is_refused() -> None:
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\[N, K/32\] or \[N, K/16\] scales"):
        Int8Weight(codes, torch.ones(4, 8))
    with pytest.raises(ValueError, match=r"zeros or none; got \(4, 2\) and \(4, 4\)"):
        Int8Weight(codes, torch.ones(4, 2), torch.zeros(4, 4))


def test_fusing_shards_of_different_formats_keeps_their_weights_exactly() -> None:
    """q Q4_K-like (int4 with zeros), k Q6_K-like (scale per 16), v Q8_0-like: one 8-bit
    weight in the finest layout whose dequantization is the shards' own, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    q = Int4Weight(
        torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8),
        torch.rand(8, 2, generator=gen),
        torch.randn(8, 2, generator=gen),
    )
    k, v = _int8(4, 64, 8, 16, False), _int8(4, 64, 9, 32, False)
    fused = fuse([q, k, v])
    assert isinstance(fused, Int8Weight) and fused.scale_group == 16 and fused.zero is not None
    expected = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(fused.dequantize(), expected)
    assert isinstance(fuse([q, q]), Int4Weight)
    q4_0 = Int4Weight(q.codes, q.scale, torch.zeros_like(q.zero))
    assert Int8Weight.from_int4(q4_0).zero is None  # nothing to add: no zero stream to read


@pytest.mark.parametrize(("scale_group", "with_zero"), LAYOUTS)
def test_triton_int8_kernel_equals_dequantize_then_matmul(scale_group: int, with_zero: bool) -> None:
    pytest.importorskip("triton")
    from fastsched.kernels.quant_matmul_triton import int8_matmul

    m, n, k = 5, 80, 192  # partial M and N tiles, K of three 64-wide steps
    weight = _int8(n, k, 10, scale_group, with_zero)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11))
    out = int8_matmul(x, weight.codes, weight.scale, weight.zero, GROUP_SIZE)
    torch.testing.assert_close(out, x @ weight.dequantize().t(), rtol=1e-4, atol=1e-4)


def test_a_row_parallel_shard_slices_scales_per_16_and_zeros_with_their_columns() -> None:
    from fastsched.models.tp_shard import _columns, weight_rows

    weight = _int8(8, 128, 12, 16, True)
    shard = _columns("down_proj", weight, 32, 96)
    assert torch.equal(shard.dequantize(), weight.dequantize()[:, 32:96])
    assert torch.equal(weight_rows(weight, 2, 5).dequantize(), weight.dequantize()[2:5])
