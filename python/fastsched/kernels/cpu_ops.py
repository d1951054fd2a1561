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
) -> None:
    """Writes the step's K/V at ``slot_mapping`` (negative: not written), then fills the rows
    of ``out`` of the requests in ``reqs`` (the crate's ``attention`` module docs). The step
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
        [t.data_ptr() for t in step], seq_lens.shape[0], tables.shape[1], reqs.shape[0], scale,
    )
