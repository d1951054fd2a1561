"""The CPU int4 / int8 weight-only matmuls of fastsched's Rust kernels crate
(rust/fastsched-kernels), as torch custom ops so ``torch.compile`` traces through them.

Method (the crate's docs): each activation row is quantized to int8 per group of 32 once a
call, then meets the weight's 4- or 8-bit codes in integer dot products (AVX-512 VNNI where
the CPU has it, detected at run time; a scalar loop otherwise), read from memory at 0.56 or
1.06 bytes a weight. That makes the M = 1 GEMV of decoding memory-bound. For many rows
(prefill, large batches) the integer kernel's per-row work stops paying, so from
``DENSE_MIN_ROWS`` rows on the crate's bf16 GEMM takes over: bf16 activations, each block of
output columns decoded once a call to bf16 into an L1-sized buffer (by the same rule as a
dequantization) and multiplied with AVX-512 BF16 ``vdpbf16ps`` and fp32 accumulation, i.e.
the numerics of "dequantize to bf16, then a bf16 GEMM" without the ``[N, K]`` temporary (and
batch-invariant: a row's value does not depend on the others). Measured in bench/RESULTS.md.

Threads: a call uses ``torch.get_num_threads()`` cores, the calling thread plus a persistent
pool whose workers spin briefly and then sleep, so they do not hold cores away from torch's
OpenMP regions between calls.

Layouts (what :func:`pack_int4` and :class:`fastsched.kernels.quant_matmul.Int8Weight` give):
int4 ``packed [N, K/2]`` uint8, each 64 columns from ``c`` as 32 bytes, byte ``j`` holding
column ``c + j`` in its low nibble and ``c + 32 + j`` in its high one (an odd last group of 32:
``c + j`` and ``c + 16 + j``), scales and zeros ``[N, K/32]`` float32; int8 ``codes [N, K]``,
scales ``[N, K/32]`` or ``[N, K/16]`` (GGUF Q6_K's sub-blocks) float32 and optionally zeros
``[N, K/32]`` float32 (GGUF Q5_1, Q5_K).
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from fastsched import _core
from fastsched.kernels.cpu_ops import sync_threads

GROUP_SIZE = 32
# From this many activation rows on (prefill chunks, big batches), a bf16 GEMM (the crate's;
# before it, dequantize-to-bf16 + torch's) beats the integer kernel (bench/RESULTS.md, "Rust
# int4/int8 kernels"; from ~8 rows on a layer-sized weight). Below it every row takes the integer kernel, whose rows do not depend on
# each other, so small decode batches and speculative verifications give a sequence the same
# logits whatever shares the step (tests/engine/test_spec_decode.py fails with 8). Measured
# on the tests only: 8 breaks that invariance, 64 sends short prompts through the int8
# activations and flips test_smollm2's greedy chat answer; 16 passes both.
DENSE_MIN_ROWS = 16
AVAILABLE = hasattr(_core, "quant_matmul")
# The many-row GEMM's AVX-512 BF16 kernel; without it (older x86, other ISAs) the weight is
# dequantized to a bf16 temporary for torch's GEMM instead.
GEMM_SIMD = AVAILABLE and _core.quant_gemm_simd()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` (0..15) in the kernels' packed layout (module docstring), ``[N, K/2]`` uint8."""
    n, k = codes.shape
    codes = codes.to(torch.uint8)
    pairs = k // (2 * GROUP_SIZE)
    head = codes[:, : pairs * 64].reshape(n, pairs, 2, 32)
    parts = [(head[:, :, 0] | (head[:, :, 1] << 4)).reshape(n, pairs * 32)]
    if (k // GROUP_SIZE) % 2:
        tail = codes[:, pairs * 64 :]
        parts.append(tail[:, :16] | (tail[:, 16:] << 4))
    return torch.cat(parts, 1).contiguous()


# The columns an int8 weight's scale may cover: a group, or half of one (GGUF Q6_K).
SCALE_GROUPS = (GROUP_SIZE, GROUP_SIZE // 2)


class CpuQuantWeight:
    """A weight's tensors as the binding's ``QuantWeight`` (which checks them against the
    shape and holds them), and its matmul: the Rust call directly when eager (a custom op's
    dispatch costs more than a layer's GEMV), the custom op while ``torch.compile`` traces.

    ``tensors``: int4 (packed, scale, zero); int8 (codes, scale) or (codes, scale, zero),
    the scale's shape saying the columns each covers (module docstring)."""

    def __init__(self, bits: int, tensors: tuple[torch.Tensor, ...], n: int, k: int) -> None:
        kb = k // GROUP_SIZE
        if bits not in (4, 8) or k % GROUP_SIZE:
            raise ValueError(
                f"int{bits} weight [{n}, {k}]: bits must be 4 or 8 and K a multiple of {GROUP_SIZE}"
            )
        scale_group = GROUP_SIZE
        if bits == 8 and len(tensors) >= 2 and tensors[1].dim() == 2 and tensors[1].shape[1] == 2 * kb:
            scale_group = GROUP_SIZE // 2
        shapes = {"packed": (torch.uint8, (n, k // 2))} if bits == 4 else {"codes": (torch.int8, (n, k))}
        shapes |= {"scale": (torch.float32, (n, k // scale_group)), "zero": (torch.float32, (n, kb))}
        if not (len(tensors) == 3 or (bits == 8 and len(tensors) == 2)):
            raise ValueError(
                f"int{bits} weight [{n}, {k}]: {len(tensors)} tensors, expected "
                f"{'3' if bits == 4 else '2 or 3'} ({', '.join(shapes)})"
            )
        for t, (name, (dtype, shape)) in zip(tensors, shapes.items()):
            _check_tensor(name, t, dtype, shape)
        self.bits, self.tensors, self.n, self.k = bits, tensors, n, k
        self.scale_group = scale_group
        self.rust = _core.QuantWeight(bits, scale_group, n, k, *map(to_dlpack, tensors))

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K] @ Wᵀ -> [M, N]`` in ``out_dtype`` (default ``x``'s). The kernels sum in
        float32, so a float32 ``out_dtype`` keeps what bf16 would round away (logits)."""
        if torch.compiler.is_compiling():
            if self.bits == 4:
                return torch.ops.fastsched.int4_matmul(x, *self.tensors).to(out_dtype or x.dtype)
            codes, scale, *zero = self.tensors
            return torch.ops.fastsched.int8_matmul(x, codes, scale, *zero).to(out_dtype or x.dtype)
        return _matmul(self.rust, x).to(out_dtype or x.dtype)  # the binding checks x's shape

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _matmul(weight: _core.QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` as float32 (the dense fallback's bf16 result widened)."""
    sync_threads()
    m, (n, k) = x.shape[0], weight.shape
    if m >= DENSE_MIN_ROWS:
        xb = x.to(torch.bfloat16).contiguous()
        if not GEMM_SIMD:
            dense = torch.empty(n, k, dtype=torch.bfloat16)
            _core.quant_dequantize_bf16(weight, to_dlpack(dense))
            return (xb @ dense.t()).float()
        out = torch.empty(m, n, dtype=torch.float32)
        _core.quant_gemm_bf16(weight, to_dlpack(xb), to_dlpack(out))
        return out
    xc = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    out = torch.empty(m, n, dtype=torch.float32)
    _core.quant_matmul(weight, to_dlpack(xc.contiguous()), to_dlpack(out))
    return out


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a contiguous CPU {dtype} tensor of shape {shape}; got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU [M, {k}] tensor; got {tuple(x.shape)} on {x.device}")


@torch.library.custom_op("fastsched::int4_matmul", mutates_args=())
def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] @ Wᵀ -> [M, N]`` in ``x``'s dtype for an int4 weight."""
    weight = CpuQuantWeight(4, (packed, scale, zero), packed.shape[0], packed.shape[1] * 2)
    _check_x(x, weight.k)
    return _matmul(weight.rust, x).to(x.dtype)


@int4_matmul.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return _fake(x, packed.shape[0])


@torch.library.custom_op("fastsched::int8_matmul", mutates_args=())
def int8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] @ Wᵀ -> [M, N]`` in ``x``'s dtype for an int8 weight."""
    weight = CpuQuantWeight(8, (codes, scale) if zero is None else (codes, scale, zero), *codes.shape)
    _check_x(x, weight.k)
    return _matmul(weight.rust, x).to(x.dtype)


@int8_matmul.register_fake
def _(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    return _fake(x, codes.shape[0])


def _fake(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)
