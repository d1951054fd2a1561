"""CPU kernels of fastsched's Rust crate (rust/fastsched-kernels) for the parts of a decoder
layer around the matmuls: paged attention with its KV-cache write, and fused elementwise ops.

At one decode token a layer's attention and elementwise work is a few microseconds of
arithmetic, but as torch ops it is dozens of calls of 2–200 µs each (dispatch, temporaries,
SDPA's set-up for a one-row query): bench/RESULTS.md, "CPU decode: Rust attention and fused
elementwise kernels". Each function here is one call into the crate with the GIL released.

Tensors cross as addresses: these wrappers check dtype, device and layout and then trust
them, so the binding never sees a tensor it cannot read. float32 and bfloat16 only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastsched import _core

AVAILABLE = hasattr(_core, "paged_attention")
DTYPES = (torch.float32, torch.bfloat16)

_threads = 0


def sync_threads() -> None:
    """Keeps the kernels' pool at torch's thread count (the cores the engine may use)."""
    global _threads
    wanted = torch.get_num_threads()
    if wanted != _threads:
        _core.set_kernel_threads(wanted)
        _threads = wanted


def _rows(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Checks ``t`` is ``[T, *shape]`` of ``dtype`` on the CPU with each row contiguous;
    returns the elements from one row to the next."""
    if t.dtype != dtype or t.device.type != "cpu" or tuple(t.shape[1:]) != shape:
        raise ValueError(f"{name} must be a CPU {dtype} tensor [T, {', '.join(map(str, shape))}]; "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    row = t[0] if t.shape[0] else t
    if t.shape[0] and not row.is_contiguous():
        raise ValueError(f"{name}'s rows must be contiguous; got strides {t.stride()}")
    return t.stride(0) if t.dim() and t.shape[0] > 1 else row.numel()


def check_step_tensor(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """A metadata tensor the binding reads by address: contiguous, on the CPU, of ``dtype``."""
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor; got {t.dtype} on {t.device}")


def paged_attention(
    query: torch.Tensor,  # [T, H, D], rows contiguous
    key: torch.Tensor,  # [T, H_kv, D], query's dtype
    value: torch.Tensor,
    out: torch.Tensor,  # [T, H, D] contiguous, query's dtype
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D] contiguous
    step: tuple[torch.Tensor, ...],  # slot_mapping int64, query_start_loc, seq_lens, block_tables, reqs int32
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """Writes the step's K/V at ``slot_mapping`` (negative: not written), then fills the rows
    of ``out`` of the requests in ``reqs`` (the crate's ``attention`` module docs): scores
    ``scale * q.k``, soft-capped to ``softcap * tanh(s / softcap)`` if given, a query at
    position ``p`` attending the keys in ``(p - window, p]`` if ``window`` is given. The step
    tensors must have passed :func:`check_step_tensor`."""
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    q_stride = _rows("query", query, query.dtype, (num_heads, head_dim))
    kv_stride = _rows("key", key, query.dtype, (num_kv_heads, head_dim))
    if _rows("value", value, query.dtype, (num_kv_heads, head_dim)) != kv_stride:
        raise ValueError(f"key and value must have the same row stride; got {key.stride()} and {value.stride()}")
    if query.dtype not in DTYPES or kv_cache.dtype not in DTYPES or not kv_cache.is_contiguous():
        raise ValueError(f"query and kv_cache must be float32 or bfloat16 (cache contiguous); "
                         f"got {query.dtype} and {kv_cache.dtype}")
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {query.dtype} tensor {tuple(query.shape)}")
    if key.shape[0] != num_tokens or value.shape[0] != num_tokens or step[0].shape[0] != num_tokens:
        raise ValueError(f"key, value and slot_mapping must have {num_tokens} rows")
    slots, qsl, seq_lens, tables, reqs = step
    sync_threads()
    _core.paged_attention(
        [query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), kv_cache.data_ptr()],
        [q_stride, kv_stride], query.dtype == torch.bfloat16, kv_cache.dtype == torch.bfloat16,
        [num_blocks, block_size, num_kv_heads, head_dim], num_tokens, num_heads,
        [t.data_ptr() for t in step], seq_lens.shape[0], tables.shape[1], reqs.shape[0], scale, softcap,
        window,
    )


def _norm_weight(weight: torch.Tensor, n: int) -> torch.Tensor:
    """A norm weight the binding reads: ``[n]`` bfloat16 (Llama's rounding) or float32 (Gemma's
    ``1 + w``, one rounding), contiguous, on the CPU."""
    if (weight.dtype not in (torch.bfloat16, torch.float32) or weight.shape != (n,)
            or weight.device.type != "cpu"):
        raise ValueError(f"weight must be a CPU bfloat16 or float32 [{n}] tensor; got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    return weight.contiguous()


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``hidden += delta`` in place (bfloat16 rounding, as torch's add), then RMSNorm of it:
    ``[M, N]`` bfloat16, contiguous. A bfloat16 ``weight`` rounds as
    ``fastsched.models.llama.RMSNorm`` (``w * bf16(x_hat)``); a float32 one is Gemma's, given
    as ``1 + w``, and rounds once (``bf16(x_hat * w)``, transformers' Gemma RMSNorm)."""
    n = weight.shape[0]
    if (hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu"
            or not hidden.is_contiguous() or hidden.dim() != 2 or hidden.shape[1] != n):
        raise ValueError(f"hidden must be a contiguous CPU bfloat16 [M, {n}] tensor; "
                         f"got {hidden.dtype} {tuple(hidden.shape)}")
    weight = _norm_weight(weight, n)
    if delta is not None:
        if delta.shape != hidden.shape or delta.dtype != hidden.dtype:
            raise ValueError(f"delta must be bfloat16 {tuple(hidden.shape)}; got {delta.dtype} {tuple(delta.shape)}")
        delta = delta.contiguous()
    out = torch.empty_like(hidden)
    _core.add_rms_norm_bf16(hidden.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                            weight.dtype == torch.float32, out.data_ptr(), hidden.shape[0], n, eps)
    return out


def rms_norm_heads_(x: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm in place on each of the first ``heads`` heads of ``weight.shape[0]`` columns of
    each row of the bfloat16 ``x [T, W]`` (q's or k's heads in a fused q/k/v row: pass the view
    starting at them); ``weight`` as :func:`add_rms_norm`'s."""
    head_dim = weight.shape[0]
    if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1
            or x.shape[1] < heads * head_dim):
        raise ValueError(f"x must be a CPU bfloat16 [T, >= {heads * head_dim}] tensor with contiguous rows; "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    weight = _norm_weight(weight, head_dim)
    _core.rms_norm_heads_bf16(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, weight.data_ptr(),
                              weight.dtype == torch.float32, eps)


def rope_(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first ``heads * head_dim`` columns of each row of
    ``x [T, W]`` (q's heads then k's, as a fused QKV projection lays them out), row ``t`` by
    row ``positions[t]`` of the ``[len, head_dim]`` tables (``x``'s dtype)."""
    if (x.dtype not in DTYPES or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1
            or x.shape[1] < heads * head_dim):
        raise ValueError(f"x must be a CPU float32/bfloat16 [T, >= {heads * head_dim}] tensor with contiguous rows; "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != x.dtype or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != head_dim:
            raise ValueError(f"{name} must be a contiguous {x.dtype} [len, {head_dim}] table; got {t.dtype} "
                             f"{tuple(t.shape)}")
    check_step_tensor("positions", positions, torch.int64)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} rows, x {x.shape[0]}")
    _core.rope(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), heads, head_dim, positions.data_ptr(),
               x.shape[0], [cos.data_ptr(), sin.data_ptr()], cos.shape[0])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for bfloat16 ``gate_up [M, 2I]`` (gate first), in torch's rounding."""
    return _act_mul(gate_up, _core.silu_mul_bf16)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's GeGLU) for bfloat16 ``gate_up [M, 2I]``
    (gate first), in torch's rounding."""
    return _act_mul(gate_up, _core.gelu_tanh_mul_bf16)


def _act_mul(gate_up: torch.Tensor, kernel: Callable[[int, int, int, int], None]) -> torch.Tensor:
    if gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be a CPU bfloat16 [M, 2I] tensor; got {gate_up.dtype} {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    inner = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inner, dtype=torch.bfloat16)
    kernel(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inner)
    return out
