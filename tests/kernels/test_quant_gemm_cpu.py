"""The many-row path of the CPU int4 / int8 kernels (``DENSE_MIN_ROWS`` rows and more): the
crate's bf16 GEMM, which decodes the weight to bf16 in cache-sized blocks instead of
dequantizing it into a ``[N, K]`` temporary for torch's GEMM.

- Numerics: the same bf16 operands as "dequantize to bf16, then a bf16 GEMM" (weights by
  the crate's dequantization rule, activations rounded to bf16), products summed in fp32,
  the output rounded to bf16. Against the float64 product of those bf16 operands an output
  is within half a bf16 step of its value (``2⁻⁸ · |exact|``) plus fp32 accumulation
  (1e-5 of ``Σ |w·x|``), and within the accumulation bound alone as float32 (logits);
  against the old dense path it is within one bf16 step of it.
- Batch invariance: a row's output does not depend on the other rows of the call nor on
  how many there are (bit-exact), nor on the thread count.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from fastsched import _core
from fastsched.kernels import quant_matmul_cpu
from fastsched.kernels.quant_matmul import GROUP_SIZE, Int4Weight, Int8Weight, PackedInt4, PackedInt8

pytestmark = pytest.mark.skipif(not quant_matmul_cpu.AVAILABLE, reason="the Rust kernels are not built")


def _packed(bits: int, n: int, k: int, seed: int) -> PackedInt4 | PackedInt8:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.02 + 0.001
        zero = torch.randn(n, k // GROUP_SIZE, generator=gen) * 0.02
        return PackedInt4(Int4Weight(codes, scale, zero), torch.device("cpu"))
    return PackedInt8(Int8Weight.quantize(torch.randn(n, k, generator=gen) * 0.05), torch.device("cpu"))


def _dense_bf16(packed: PackedInt4 | PackedInt8) -> torch.Tensor:
    """The weight as the crate dequantizes it to bf16 (what the old many-row path multiplied)."""
    cpu = packed.cpu
    dense = torch.empty(cpu.n, cpu.k, dtype=torch.bfloat16)
    _core.quant_dequantize_bf16(cpu.rust, to_dlpack(dense))
    return dense


@pytest.mark.parametrize("m", [16, 33, 70])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (37, 96), (130, 576), (19, 160), (70, 1536)])
@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_equal_the_bf16_dequantize_then_matmul(bits: int, m: int, n: int, k: int) -> None:
    packed = _packed(bits, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    out = packed.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    w64, x64 = _dense_bf16(packed).double(), x.double()
    exact = x64 @ w64.t()
    magnitude = x64.abs() @ w64.abs().t()
    err = (out.double() - exact).abs()
    assert bool((err <= 2**-8 * exact.abs() + 1e-5 * magnitude).all()), f"max error {err.max().item():.3g}"
    # the old path (bf16 temporary + torch's GEMM) within one bf16 step
    old = (x @ _dense_bf16(packed).t()).double()
    assert bool(((out.double() - old).abs() <= 2**-7 * exact.abs() + 2e-5 * magnitude).all())
    # float32 out (logits): the same float32 sums, not rounded to bf16
    out32 = packed.matmul(x, torch.float32)
    assert out32.dtype == torch.float32 and torch.equal(out32.bfloat16(), out)
    assert bool(((out32.double() - exact).abs() <= 1e-5 * magnitude).all())
    # float32 activations are rounded to bf16 on the way in
    assert torch.equal(packed.matmul(x.float()), out32)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_bit_equal_in_any_batch_and_thread_count(bits: int) -> None:
    """What test_spec_decode relies on from 16 rows on: a sequence's logits do not depend on
    what shares the step (``m`` itself and the other rows' values)."""
    n, k = 300, 576
    packed = _packed(bits, n, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(70, k, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = packed.matmul(x)
        for m in (16, 17, 33):
            assert torch.equal(packed.matmul(x[:m]), full[:m]), m
        others = torch.randn(15, k, generator=gen).bfloat16()
        for r in (0, 5, 69):
            mixed = packed.matmul(torch.cat([others[:7], x[r : r + 1], others[7:]]))
            assert torch.equal(mixed[7], full[r]), r
        torch.set_num_threads(1)
        assert torch.equal(packed.matmul(x), full)
    finally:
        torch.set_num_threads(before)
