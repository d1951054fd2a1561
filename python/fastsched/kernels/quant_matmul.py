"""Weight-only 4-bit matmul: ``x @ W.T`` with ``W`` kept as 4-bit codes and per-group
scales, read from memory at ~0.56 bytes a weight instead of 4 (fp32) or 2 (bf16).

Decoding a small model is a GEMV per layer, bound by how many weight bytes it reads, so
keeping the GGUF's 4-bit weights quantized is what brings a token's cost down.

One form for every 4-bit source: ``w = scale · (q − 8) + zero`` per group of
``GROUP_SIZE`` consecutive input columns, ``q`` in 0..15. GGUF Q4_0 is ``d·(q − 8)``
(``scale = d``, ``zero = 0``); Q4_1 is ``d·q + m`` = ``d·(q − 8) + (m + 8d)``
(``scale = d``, ``zero = m + 8d``). This is the form torch's CPU int4 kernel
(``aten._weight_int4pack_mm_for_cpu``) computes, so the GGUF codes go into it as they are.

- CPU: the Rust kernels of :mod:`fastsched.kernels.quant_matmul_cpu` (activations
  quantized to int8 per group of 32, integer dot products with AVX-512 VNNI where the CPU
  has it; fp32 scales and zeros; from 16 rows on a bf16 GEMM that decodes the weight in
  cache-sized blocks). They replaced torch's ``_weight_int4pack_mm_for_cpu``,
  which needs bf16 activations and scales and is ~2× slower than a bf16 GEMM from 8 rows
  on (bench/RESULTS.md). The 8-bit form :class:`Int8Weight` runs on the same kernels.
- CUDA: :func:`int4_matmul_triton` / :func:`int8_matmul_triton`, dequantize-in-registers
  matmuls (int4 codes packed two a byte, ``[N, K/2]`` uint8, even column in the low nibble),
  tested in the Triton interpreter (tests/kernels), not run on a GPU by this project's CI.

The 8-bit form ``w = scale · c + zero`` (:class:`Int8Weight`) holds every other GGUF format
exactly: Q8_0 and Q5_0 are scales alone (``c`` = the code, Q5_0's less 16), Q5_1 and Q5_K
add a zero per group, Q6_K has a scale per 16 columns (its sub-blocks: ``d · s``, exact in
float32). A 4-bit weight is one too (``c = q − 8``, same scale and zero), so a fused layer
whose shards differ in format is one :class:`Int8Weight` (:func:`fuse`).

:func:`dequantize_int4` and :func:`dequantize_int8` are the references the kernels are
tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastsched.kernels import quant_matmul_cpu

GROUP_SIZE = quant_matmul_cpu.GROUP_SIZE


@dataclass
class Int4Weight:
    """A ``[N, K]`` weight as codes and per-group affine parameters (module docstring's form)."""

    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K / GROUP_SIZE] float32
    zero: torch.Tensor  # [N, K / GROUP_SIZE] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if k % GROUP_SIZE or self.scale.shape != (n, k // GROUP_SIZE) or self.zero.shape != self.scale.shape:
            raise ValueError(
                f"int4 weight of shape {(n, k)} needs [N, K/{GROUP_SIZE}] scales and zeros; got "
                f"{tuple(self.scale.shape)} and {tuple(self.zero.shape)}"
            )

    @classmethod
    def cat(cls, parts: list[Int4Weight]) -> Int4Weight:
        """Row-wise concatenation: the fused q/k/v or gate/up projection from its shards."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Round-to-nearest asymmetric quantization of a dense ``[N, K]`` weight, per group of
        ``GROUP_SIZE`` (``--quantization int4`` on a checkpoint that is not quantized)."""
        n, k = weight.shape
        groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(codes.reshape(n, k), scale, low + 8 * scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.codes, self.scale, self.zero).to(dtype)

    def nbytes_packed(self) -> int:
        """Bytes of the packed form a matmul reads: half a byte a code plus a scale and a zero a group."""
        return self.codes.numel() // 2 + 2 * self.scale.numel() * 2


@dataclass
class Int8Weight:
    """A ``[N, K]`` weight as int8 codes, a scale per ``scale_group`` columns (32, or 16 for
    GGUF Q6_K) and optionally a zero per group of 32: ``w = scale · c + zero`` (module
    docstring for the GGUF formats it holds); ~1.1–1.3 bytes a weight."""

    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K / scale_group] float32
    zero: torch.Tensor | None = None  # [N, K / GROUP_SIZE] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def scale_group(self) -> int:
        """Columns a scale covers: 32, or 16."""
        return self.codes.shape[1] // self.scale.shape[1]

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        groups = k // GROUP_SIZE
        scales_fit = self.scale.shape in ((n, groups), (n, 2 * groups))
        zero_fits = self.zero is None or self.zero.shape == (n, groups)
        if self.codes.dtype != torch.int8 or k % GROUP_SIZE or not scales_fit or not zero_fits:
            zero = None if self.zero is None else tuple(self.zero.shape)
            raise ValueError(
                f"int8 weight of shape {(n, k)} and dtype {self.codes.dtype} needs int8 codes, "
                f"[N, K/{GROUP_SIZE}] or [N, K/{GROUP_SIZE // 2}] scales and "
                f"[N, K/{GROUP_SIZE}] zeros or none; got {tuple(self.scale.shape)} and {zero}"
            )

    @classmethod
    def from_int4(cls, weight: Int4Weight) -> Int8Weight:
        """The same weights as 8-bit codes ``q − 8``: exactly, scale and zero unchanged."""
        zero = None if not weight.zero.any() else weight.zero  # Q4_0's zeros: nothing to add
        return cls((weight.codes.to(torch.int16) - 8).to(torch.int8), weight.scale, zero)

    def with_layout(self, scale_group: int, zero: bool) -> Int8Weight:
        """The same weights with a scale per ``scale_group`` columns (only 32 → 16 splits,
        each half its group's scale) and zeros (all 0.0 where there were none); exact."""
        scale = self.scale if scale_group == self.scale_group else self.scale.repeat_interleave(2, dim=1)
        zeros = (
            self.zero
            if self.zero is not None or not zero
            else self.scale.new_zeros(self.codes.shape[0], self.codes.shape[1] // GROUP_SIZE)
        )
        return Int8Weight(self.codes, scale, zeros)

    @classmethod
    def cat(cls, parts: list[Int8Weight]) -> Int8Weight:
        """Row-wise concatenation: the fused q/k/v or gate/up projection from its shards, in
        the finest layout among them (:meth:`with_layout`)."""
        scale_group = min(p.scale_group for p in parts)
        zero = any(p.zero is not None for p in parts)
        parts = [p.with_layout(scale_group, zero) for p in parts]
        zeros = torch.cat([p.zero for p in parts]) if zero else None  # type: ignore[misc]
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zeros)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Round-to-nearest symmetric quantization of a dense ``[N, K]`` weight per group of
        ``GROUP_SIZE`` (the Q8_0 rule: ``scale = max|w| / 127``)."""
        n, k = weight.shape
        groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        scale = groups.abs().amax(-1) / 127
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = (groups * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(codes.reshape(n, k), scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.codes, self.scale, self.zero).to(dtype)

    def nbytes_packed(self) -> int:
        """Bytes a matmul reads: a byte a code plus a float32 scale (and zero) a group."""
        zeros = 0 if self.zero is None else self.zero.numel()
        return self.codes.numel() + 4 * (self.scale.numel() + zeros)


def fuse(parts: list[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight:
    """The shards of a fused projection as one weight: 4-bit if all are, else 8-bit
    (:meth:`Int8Weight.from_int4`), exactly the shards' weights either way."""
    if all(isinstance(p, Int4Weight) for p in parts):
        return Int4Weight.cat(parts)  # type: ignore[arg-type]
    return Int8Weight.cat([Int8Weight.from_int4(p) if isinstance(p, Int4Weight) else p for p in parts])


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The reference: ``scale · (q − 8) + zero`` in float32, ``[N, K]``."""
    n, k = codes.shape
    q = codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8
    return (q * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def dequantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: ``scale · c (+ zero)`` in float32, ``[N, K]``, a scale per ``K /
    scale.shape[1]`` columns, a zero per ``GROUP_SIZE``."""
    n, k = codes.shape
    w = (codes.reshape(n, scale.shape[1], -1).float() * scale.float()[..., None]).reshape(n, k)
    if zero is None:
        return w
    return (w.reshape(n, k // GROUP_SIZE, GROUP_SIZE) + zero.float()[..., None]).reshape(n, k)


class PackedInt4:
    """An :class:`Int4Weight` in the layout of the device's kernel, and its matmul."""

    def __init__(self, weight: Int4Weight, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.device = device
        # The Triton kernel takes bf16 activations (and upcasts to fp32 to accumulate); the
        # Rust one takes fp32 or bf16 as they come.
        self.compute_dtype = torch.bfloat16
        if device.type == "cpu" and quant_matmul_cpu.AVAILABLE:
            self.cpu = quant_matmul_cpu.CpuQuantWeight(
                4,
                (
                    quant_matmul_cpu.pack_int4(weight.codes),
                    weight.scale.float().contiguous(),
                    weight.zero.float().contiguous(),
                ),
                *weight.shape,
            )
            self.kind = "cpu_rust"
        elif device.type == "cuda":
            codes = weight.codes.to(device)
            self.packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
            self.scale = weight.scale.to(device, self.compute_dtype).contiguous()
            self.zero = weight.zero.to(device, self.compute_dtype).contiguous()
            self.kind = "triton"
        else:  # no kernel: the weight dequantized once (correct, not compact)
            self.dense = weight.dequantize(self.compute_dtype).to(device)
            self.kind = "dense"

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K] @ W.T -> [M, N]`` in ``out_dtype`` (default ``x``'s dtype)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        out_dtype = out_dtype or x.dtype
        if self.kind == "cpu_rust":
            out = self.cpu.matmul(x2, out_dtype)
        else:
            xc = x2 if x2.dtype == self.compute_dtype else x2.to(self.compute_dtype)
            out = (
                int4_matmul_triton(xc, self.packed, self.scale, self.zero)
                if self.kind == "triton"
                else (xc @ self.dense.t())
            )
        return out.to(out_dtype).reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        if self.kind == "cpu_rust":
            return self.cpu.nbytes()
        tensors = {"triton": ("packed", "scale", "zero"), "dense": ("dense",)}[self.kind]
        return sum(getattr(self, t).numel() * getattr(self, t).element_size() for t in tensors)


class PackedInt8:
    """An :class:`Int8Weight` for the device's kernel (CPU: the Rust one; CUDA: the Triton
    one; elsewhere the weight dequantized once to bf16), with :class:`PackedInt4`'s interface,
    plus the embedding lookup of a tied embedding / lm_head that dequantizes only the
    gathered rows."""

    def __init__(self, weight: Int8Weight, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.device = device
        self.codes = weight.codes.to(device).contiguous()
        self.scale = weight.scale.to(device, torch.float32).contiguous()
        self.zero = None if weight.zero is None else weight.zero.to(device, torch.float32).contiguous()
        params = (self.scale,) if self.zero is None else (self.scale, self.zero)
        if device.type == "cpu" and quant_matmul_cpu.AVAILABLE:
            self.cpu = quant_matmul_cpu.CpuQuantWeight(8, (self.codes, *params), *weight.shape)
            self.kind = "cpu_rust"
        elif device.type == "cuda":
            self.kind = "triton"
        else:
            self.dense = weight.dequantize(torch.bfloat16).to(device)
            self.kind = "dense"

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K] @ W.T -> [M, N]`` in ``out_dtype`` (default ``x``'s dtype)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        out_dtype = out_dtype or x.dtype
        if self.kind == "cpu_rust":
            out = self.cpu.matmul(x2, out_dtype)
        elif self.kind == "triton":
            out = int8_matmul_triton(x2.to(torch.bfloat16), self.codes, self.scale, self.zero)
        else:
            out = x2.to(self.dense.dtype) @ self.dense.t()
        return out.to(out_dtype).reshape(*shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized (an embedding lookup)."""
        flat = ids.reshape(-1)
        zero = None if self.zero is None else self.zero[flat]
        return (
            dequantize_int8(self.codes[flat], self.scale[flat], zero)
            .to(dtype)
            .reshape(*ids.shape, self.in_features)
        )

    def nbytes(self) -> int:
        optional = (self.zero, getattr(self, "dense", None))
        tensors = [self.codes, self.scale] + [t for t in optional if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def int4_matmul_triton(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [N, K / 2] uint8, column 2j in the low nibble of byte j, 2j + 1 in the high
    scale: torch.Tensor,  # [N, K / GROUP_SIZE]
    zero: torch.Tensor,  # [N, K / GROUP_SIZE]
) -> torch.Tensor:  # [M, N] in x's dtype, fp32 accumulation
    from fastsched.kernels import quant_matmul_triton

    return quant_matmul_triton.int4_matmul(x, packed, scale, zero, GROUP_SIZE)


def int8_matmul_triton(
    x: torch.Tensor,  # [M, K]
    codes: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N, K / scale_group], scale_group 32 or 16
    zero: torch.Tensor | None,  # [N, K / GROUP_SIZE] or None
) -> torch.Tensor:  # [M, N] in x's dtype, fp32 accumulation
    from fastsched.kernels import quant_matmul_triton

    return quant_matmul_triton.int8_matmul(x, codes, scale, zero, GROUP_SIZE)
