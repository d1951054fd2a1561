"""Microbenchmark of the CPU weight-only matmuls on SmolLM2-135M's layer shapes: torch's
``_weight_int4pack_mm_for_cpu`` (bf16, what the CPU int4 path used before), the Rust int4
and int8 kernels (``fastsched.kernels.quant_matmul_cpu``: the integer GEMV below
``DENSE_MIN_ROWS`` rows, the bf16 GEMM from it on), the many-row path before the crate's bf16
GEMM (the weight dequantized per call to a bf16 temporary, then torch's GEMM) and a dense bf16
GEMM on an already-dequantized weight, best of 5 in µs. The same weight is reused, so the layer-sized ones sit in cache (compute, not
bandwidth); the 49152 × 576 lm_head does not.

    .venv/bin/python bench/quant_kernels.py --threads 1 --rows 1,4,8,16,32,512
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.utils.dlpack import to_dlpack

from fastsched import _core
from fastsched.kernels import quant_matmul_cpu
from fastsched.kernels.quant_matmul import GROUP_SIZE, Int4Weight, Int8Weight

SHAPES = [(3072, 576), (576, 1536), (49152, 576)]


def best_us(f: Callable[[], object], inner: int) -> float:
    f()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(inner):
            f()
        times.append((time.perf_counter() - start) / inner * 1e6)
    return min(times)


def dequant_gemm(w: quant_matmul_cpu.CpuQuantWeight, x: torch.Tensor) -> torch.Tensor:
    """The many-row path before the crate's bf16 GEMM: a bf16 temporary per call, torch's GEMM."""
    dense = torch.empty(w.n, w.k, dtype=torch.bfloat16)
    _core.quant_dequantize_bf16(w.rust, to_dlpack(dense))
    return x @ dense.t()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (the kernels follow it)"
    )
    parser.add_argument("--rows", default="1,4,8,16,32,512", help="comma-separated activation row counts M")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"| M | N × K | torch int4pack | Rust int4 | Rust int8 | int4 dequant+GEMM | int8 dequant+GEMM "
        f"| bf16 dense |  ({args.threads} thread(s), µs)"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        w4, w8 = Int4Weight.quantize(w), Int8Weight.quantize(w)
        int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.codes.to(torch.int32), 1)
        scale_zeros = torch.stack([w4.scale, w4.zero], -1).transpose(0, 1).contiguous().bfloat16()
        r4 = quant_matmul_cpu.CpuQuantWeight(
            4, (quant_matmul_cpu.pack_int4(w4.codes), w4.scale, w4.zero), n, k
        )
        r8 = quant_matmul_cpu.CpuQuantWeight(8, (w8.codes, w8.scale), n, k)
        dense = w4.dequantize(torch.bfloat16)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            inner = 2 if n * m > 3e6 else 20
            row = [
                best_us(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack, GROUP_SIZE, scale_zeros),
                    inner,
                ),
                best_us(lambda: r4.matmul(x), inner),
                best_us(lambda: r8.matmul(x), inner),
                best_us(lambda: dequant_gemm(r4, x), inner),
                best_us(lambda: dequant_gemm(r8, x), inner),
                best_us(lambda: x @ dense.t(), inner),
            ]
            print(f"| {m} | {n} × {k} | " + " | ".join(f"{v:.0f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
