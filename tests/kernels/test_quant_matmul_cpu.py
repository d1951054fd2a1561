"""The Rust CPU int4 / int8 kernels (``fastsched.kernels.quant_matmul_cpu``) against
dequantize-then-matmul in float64, for odd shapes (N not a multiple of a task's rows, an
odd number of groups per row) and M = 1, 3, 8, 33 (integer kernel) and 70 (dequantize + GEMM).

Tolerances, and why (bounds, not fits):
- fewer than ``DENSE_MIN_ROWS`` rows: the integer kernel quantizes each activation to int8
  per group of 32, off by at most half a step (``max|x|_group / 254``), so an output is
  within ``Σ |w| · max|x|_group / 254`` of the exact one, plus 1e-5 of ``Σ |w·x|`` for
  float32 accumulation;
- from ``DENSE_MIN_ROWS`` rows on: the weight dequantized to bf16 and a bf16 GEMM, so
  weights, activations and the output are each rounded to bf16 (2⁻⁸ relative each):
  within ``2⁻⁷ · Σ |w·x| + 2⁻⁸ · |out|`` (+ 1e-5 · Σ |w·x| for accumulation).
"""

from __future__ import annotations

import pytest
import torch

from fastsched import _core
from fastsched.kernels import quant_matmul_cpu
from fastsched.kernels.quant_matmul import GROUP_SIZE, Int4Weight, Int8Weight, PackedInt4, PackedInt8


def _int4(n: int, k: int, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.02 + 0.001
    zero = torch.randn(n, k // GROUP_SIZE, generator=gen) * 0.02
    return Int4Weight(codes, scale, zero)


def _int8(n: int, k: int, seed: int) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    return Int8Weight.quantize(torch.randn(n, k, generator=gen) * 0.05)


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.t()
    magnitude = x64.abs() @ w64.abs().t()
    if x.shape[0] < quant_matmul_cpu.DENSE_MIN_ROWS:
        amax = x64.abs().reshape(x.shape[0], -1, GROUP_SIZE).amax(-1).repeat_interleave(GROUP_SIZE, 1)
        bound = (amax / 254) @ w64.abs().t() + 1e-5 * magnitude
    else:
        bound = 2**-7 * magnitude + 2**-8 * exact.abs() + 1e-5 * magnitude
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("m", [1, 3, 8, 33, 70])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (37, 96), (130, 576), (19, 160)])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_equals_dequantize_then_matmul(bits: int, m: int, n: int, k: int) -> None:
    weight = _int4(n, k, seed=n + k) if bits == 4 else _int8(n, k, seed=n + k)
    packed = (PackedInt4 if bits == 4 else PackedInt8)(weight, torch.device("cpu"))
    assert packed.kind == "cpu_rust"
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = packed.matmul(x)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    _check(out, x, weight.dequantize())
    # bf16 activations are read as their values; the output comes back in bf16
    xb = x.bfloat16()
    outb = packed.matmul(xb)
    assert outb.dtype == torch.bfloat16
    _check(outb.float(), xb.float(), weight.dequantize())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_gives_the_same_numbers(threads: int) -> None:
    """The pool splits N into tasks; each output is computed whole by one task."""
    weight = _int8(1000, 576, seed=5)
    packed = PackedInt8(weight, torch.device("cpu"))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = packed.matmul(x)
        torch.set_num_threads(threads)
        assert torch.equal(packed.matmul(x), reference)
        assert _core.kernel_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_custom_ops_match_the_eager_path_and_have_a_fake() -> None:
    weight = _int4(70, 96, seed=7)
    packed = PackedInt4(weight, torch.device("cpu"))
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(8))
    tensors = packed.cpu.tensors
    assert torch.equal(torch.ops.fastsched.int4_matmul(x, *tensors), packed.matmul(x))
    torch.library.opcheck(torch.ops.fastsched.int4_matmul, (x, *tensors))
    w8 = PackedInt8(_int8(70, 96, seed=9), torch.device("cpu"))
    torch.library.opcheck(torch.ops.fastsched.int8_matmul, (x, *w8.cpu.tensors))
    with torch.device("meta"):
        out = torch.ops.fastsched.int8_matmul(
            torch.empty(5, 96), torch.empty(70, 96, dtype=torch.int8), torch.empty(70, 3)
        )
    assert out.shape == (5, 70)


def test_the_binding_refuses_tensors_that_do_not_fit_naming_them() -> None:
    w = _int8(16, 64, seed=10)
    with pytest.raises(
        ValueError, match="scale must be a contiguous CPU torch.float32 tensor of shape \\(16, 2\\)"
    ):
        quant_matmul_cpu.CpuQuantWeight(8, (w.codes, w.scale[:, :1].contiguous()), 16, 64)
    with pytest.raises(ValueError, match="x must be a CPU \\[M, 64\\] tensor"):
        torch.ops.fastsched.int8_matmul(torch.randn(2, 32), w.codes, w.scale)


def test_int8_weight_round_trip_and_gathered_rows() -> None:
    dense = torch.randn(40, 64, generator=torch.Generator().manual_seed(11))
    w = Int8Weight.quantize(dense)
    step = w.scale.repeat_interleave(GROUP_SIZE, dim=1)
    assert bool(((w.dequantize() - dense).abs() <= step / 2 + 1e-6).all())
    assert Int8Weight.cat([w, w]).shape == (80, 64)
    packed = PackedInt8(w, torch.device("cpu"))
    ids = torch.tensor([[3, 0], [39, 3]])
    torch.testing.assert_close(packed.rows(ids, torch.float32), w.dequantize()[ids], rtol=0, atol=0)
    with pytest.raises(ValueError, match="int8 codes"):
        Int8Weight(w.codes.to(torch.int16), w.scale)
