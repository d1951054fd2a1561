"""4-bit weight-only matmul (``fastsched.kernels.quant_matmul``) against dequantize-then-matmul.

Tolerances, and why:
- codes + (scale, zero) from a GGUF Q4_0/Q4_1 tensor dequantize to what the GGUF
  dequantizer gives, up to one fp32 rounding of ``zero = m + 8d`` (rtol 1e-6);
- the CPU kernels (Rust): tests/kernels/test_quant_matmul_cpu.py;
- the Triton kernel (run in the interpreter here, never on a GPU in this project's CI)
  accumulates in fp32 from fp32 inputs: rtol/atol 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastsched.kernels.quant_matmul import GROUP_SIZE, Int4Weight, dequantize_int4
from fastsched.model_loader import default_model_path, open_gguf
from fastsched.model_loader.gguf_quants import dequantize, int4_blocks


def _random_weight(n: int, k: int, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.02 + 0.001
    zero = torch.randn(n, k // GROUP_SIZE, generator=gen) * 0.02
    return Int4Weight(codes, scale, zero)


@pytest.mark.parametrize("gguf_name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight"])
def test_q4_1_codes_scale_and_zero_dequantize_to_the_gguf_weights(gguf_name: str) -> None:
    tensor = next(t for t in open_gguf(default_model_path()).container.tensors if t.name == gguf_name)
    blocks = int4_blocks(tensor)
    assert blocks is not None and blocks.codes.max() <= 15
    ours = dequantize_int4(*(torch.from_numpy(b) for b in blocks)).numpy()
    np.testing.assert_allclose(ours, dequantize(tensor), rtol=1e-6, atol=1e-7)


def test_q4_0_blocks_are_scale_times_code_minus_8() -> None:
    """A hand-built Q4_0 block: d = 0.5, codes 0..15 then 15..0; weight = d·(q − 8)."""
    from gguf.constants import GGMLQuantizationType

    from fastsched.model_loader.gguf_container import GGUFTensor

    codes = np.r_[np.arange(16), np.arange(16)[::-1]].astype(np.uint8)
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), codes[:16] | (codes[16:] << 4)])
    tensor = GGUFTensor(name="w", tensor_type=GGMLQuantizationType.Q4_0, shape=(1, 32), data=block)
    blocks = int4_blocks(tensor)
    assert blocks is not None
    np.testing.assert_array_equal(blocks.codes[0], codes)
    np.testing.assert_array_equal(
        dequantize_int4(*(torch.from_numpy(b) for b in blocks))[0].numpy(),
        0.5 * (codes.astype(np.float32) - 8),
    )


def test_triton_int4_kernel_equals_dequantize_then_matmul() -> None:
    pytest.importorskip("triton")
    from fastsched.kernels.quant_matmul_triton import int4_matmul

    m, n, k = 5, 80, 192  # partial M and N tiles, K of three 64-wide steps
    weight = _random_weight(n, k, seed=2)
    packed = (weight.codes[:, 0::2] | (weight.codes[:, 1::2] << 4)).contiguous()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    out = int4_matmul(x, packed, weight.scale, weight.zero, GROUP_SIZE)
    torch.testing.assert_close(out, x @ weight.dequantize().t(), rtol=1e-4, atol=1e-4)


def test_triton_int4_kernel_rejects_a_weight_that_does_not_fit() -> None:
    pytest.importorskip("triton")
    from fastsched.kernels.quant_matmul_triton import int4_matmul

    weight = _random_weight(64, 128)
    with pytest.raises(ValueError, match="does not fit"):
        int4_matmul(torch.randn(2, 96), weight.codes[:, :64], weight.scale, weight.zero, GROUP_SIZE)


def test_round_to_nearest_quantization_is_within_half_a_step() -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(4))
    q = Int4Weight.quantize(w)
    step = q.scale.repeat_interleave(GROUP_SIZE, dim=1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-6).all())


def test_int4_weight_rejects_scales_that_do_not_cover_its_groups() -> None:
    with pytest.raises(ValueError, match="scales and zeros"):
        Int4Weight(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 3), torch.zeros(4, 3))
