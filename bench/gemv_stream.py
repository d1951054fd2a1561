"""The CPU GEMV of a decode step as it meets the weights: one ``quant_matmul`` per weight of
the embedded SmolLM2 (M = 1, bfloat16 activations), the 120 layer weights in model order (80
MB: more than the L3, so they stream from memory as in a real step), then the tied lm_head.
Prints the median time of a pass over each and the bytes read per second.

bench/quant_kernels.py times one weight again and again (cache-resident, compute); this is
the bandwidth side.

    .venv/bin/python bench/gemv_stream.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch
from torch.utils.dlpack import to_dlpack

from fastsched import _core
from fastsched.kernels.cpu_ops import sync_threads
from fastsched.kernels.quant_matmul_cpu import CpuQuantWeight
from fastsched.model_loader.weights import load_model

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def pass_seconds(weights: list[CpuQuantWeight], xs: list[torch.Tensor], outs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for w, x, out in zip(weights, xs, outs):
        _core.quant_matmul(w.rust, to_dlpack(x), to_dlpack(out))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads (the kernels follow it)"
    )
    parser.add_argument("--passes", type=int, default=30, help="passes timed (the median is printed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sync_threads()
    model = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    groups = {
        "120 layer weights (int4)": [
            layer.get_submodule(p).weight_packed.cpu for layer in model.layers for p in PROJECTIONS
        ],
        "lm_head (int8, tied)": [model.embed_tokens.weight_packed.cpu],
    }
    for name, weights in groups.items():
        xs = [torch.randn(1, w.k, dtype=torch.bfloat16) for w in weights]
        outs = [torch.empty(1, w.n) for w in weights]
        for _ in range(3):
            pass_seconds(weights, xs, outs)
        seconds = statistics.median(pass_seconds(weights, xs, outs) for _ in range(args.passes))
        nbytes = sum(w.nbytes() for w in weights)
        print(
            f"{name}: {nbytes / 1e6:.1f} MB in {seconds * 1e3:.2f} ms = {nbytes / seconds / 1e9:.1f} GB/s "
            f"({args.threads} threads)"
        )


if __name__ == "__main__":
    main()
