"""The cost of one call into the CPU kernels' binding on tiny inputs, where the kernel's own
work is next to nothing: what a layer-by-layer step pays per call for the wrapper, the DLPack
capsules and the binding's checks (issue 37 moved the checks from Python into Rust). Also the
decoder stack's cost outside its kernels: ``CpuDecoderStack.forward`` on a step of 0 rows of
the embedded SmolLM2 (30 layers), every tensor taken and checked, no layer run.

    .venv/bin/python bench/kernel_call_cost.py            # µs a call, the best of 5 timings
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch

from fastsched.kernels import cpu_ops
from fastsched.kernels.quant_matmul_cpu import CpuQuantWeight
from fastsched.model_loader.weights import load_model
from fastsched.models.llama_cpu import llama_stack


def best_us(f: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(f, number=number, repeat=5)) / number * 1e6


def tiny_calls() -> dict[str, Callable[[], object]]:
    """One token of a layer with 2 query heads and 1 KV head of 16, hidden 64."""
    i32 = torch.int32
    gate_up = torch.randn(1, 128).bfloat16()
    hidden, delta = torch.randn(1, 64).bfloat16(), torch.randn(1, 64).bfloat16()
    weight, table = torch.randn(64).bfloat16(), torch.randn(8, 16).bfloat16()
    qkv, positions = torch.randn(1, 64).bfloat16(), torch.zeros(1, dtype=torch.int64)
    q, k, v = (qkv[:, a:b].view(1, -1, 16) for a, b in ((0, 32), (32, 48), (48, 64)))
    cache = torch.zeros(2, 4, 4, 1, 16, dtype=torch.bfloat16)
    out = torch.empty(1, 2, 16, dtype=torch.bfloat16)
    step = (
        torch.tensor([0]),
        torch.tensor([0, 1], dtype=i32),
        torch.tensor([1], dtype=i32),
        torch.tensor([[0]], dtype=i32),
        torch.tensor([0], dtype=i32),
    )
    w8 = CpuQuantWeight(8, (torch.zeros(64, 64, dtype=torch.int8), torch.rand(64, 2)), 64, 64)
    x = torch.randn(1, 64).bfloat16()
    return {
        "silu_mul [1, 2x64]": lambda: cpu_ops.silu_mul(gate_up),
        "add_rms_norm [1, 64]": lambda: cpu_ops.add_rms_norm(hidden, delta, weight, 1e-6),
        "rms_norm_heads_ [1, 2x16]": lambda: cpu_ops.rms_norm_heads_(qkv, 2, table[0], 1e-6),
        "rope_ [1, 3x16]": lambda: cpu_ops.rope_(qkv, 3, 16, positions, table, table),
        "paged_attention, 1 token": lambda: cpu_ops.paged_attention(q, k, v, out, cache, step, 0.25),
        "CpuQuantWeight.matmul [1, 64] x [64, 64]": lambda: w8.matmul(x),
    }


def stack_call() -> Callable[[], object]:
    model = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    stack = llama_stack(model)
    attn = model.layers[0].self_attn
    caches = [
        torch.zeros(2, 64, 16, attn.num_kv_heads, attn.head_dim, dtype=torch.bfloat16) for _ in model.layers
    ]
    table = torch.randn(256, attn.head_dim).bfloat16()
    i32 = torch.int32
    step = (
        torch.empty(0, dtype=torch.int64),
        torch.zeros(1, dtype=i32),
        torch.empty(0, dtype=i32),
        torch.empty(0, 1, dtype=i32),
        torch.empty(0, dtype=i32),
    )
    hidden = torch.empty(0, model.norm.weight.shape[0]).bfloat16()
    positions = torch.empty(0, dtype=torch.int64)
    return lambda: stack.forward(hidden, positions, [(table, table)], caches, step, 0)


def main() -> None:
    torch.set_num_threads(1)
    for name, call in tiny_calls().items():
        print(f"{name}: {best_us(call, 20000):.2f} µs")
    print(f"CpuDecoderStack.forward, 0 rows, 30 layers: {best_us(stack_call(), 2000):.1f} µs")


if __name__ == "__main__":
    main()
