"""CPU kernels of fastsched's Rust crate (rust/fastsched-kernels) for the parts of a decoder
layer around the matmuls: paged attention with its KV-cache write, and fused elementwise ops.

At one decode token a layer's attention and elementwise work is a few microseconds of
arithmetic, but as torch ops it is dozens of calls of 2–200 µs each (dispatch, temporaries,
SDPA's set-up for a one-row query): bench/RESULTS.md, "CPU decode: Rust attention and fused
elementwise kernels". Each function here is one call into the crate with the GIL released.

Tensors cross as DLPack capsules (``torch.utils.dlpack.to_dlpack``, ~0.5 µs a tensor): the
binding checks dtype, device, layout, alignment and aliasing itself and the crate lengths and
ranges, so a bad tensor raises ValueError or TypeError naming it. These wrappers allocate the
outputs. float32 and bfloat16 only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.dlpack import to_dlpack

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


def check_step_tensor(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Checks a step's metadata tensor once where the step is planned (the binding checks it
    again on every call): contiguous, on the CPU, of ``dtype``."""
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
    tensors as :func:`check_step_tensor` checks them."""
    sync_threads()
    _core.paged_attention(*map(to_dlpack, (query, key, value, out, kv_cache, *step)), scale, softcap, window)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``hidden += delta`` in place (bfloat16 rounding, as torch's add), then RMSNorm of it:
    ``[M, N]`` bfloat16, contiguous. A bfloat16 ``weight`` rounds as
    ``fastsched.models.llama.RMSNorm`` (``w * bf16(x_hat)``); a float32 one is Gemma's, given
    as ``1 + w``, and rounds once (``bf16(x_hat * w)``, transformers' Gemma RMSNorm)."""
    out = torch.empty_like(hidden)
    _core.add_rms_norm_bf16(
        to_dlpack(hidden),
        None if delta is None else to_dlpack(delta.contiguous()),
        to_dlpack(weight),
        to_dlpack(out),
        eps,
    )
    return out


def rms_norm_heads_(x: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm in place on each of the first ``heads`` heads of ``weight.shape[0]`` columns of
    each row of the bfloat16 ``x [T, W]`` (rows contiguous; q's or k's heads in a fused q/k/v
    row: pass the view starting at them); ``weight`` as :func:`add_rms_norm`'s."""
    _core.rms_norm_heads_bf16(to_dlpack(x), heads, to_dlpack(weight), eps)


def rope_(
    x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate-half RoPE in place on the first ``heads * head_dim`` columns of each row of
    ``x [T, W]`` (rows contiguous; q's heads then k's, as a fused QKV projection lays them
    out), row ``t`` by row ``positions[t]`` (int64) of the ``[len, head_dim]`` tables (``x``'s
    dtype)."""
    _core.rope(to_dlpack(x), heads, head_dim, to_dlpack(positions), to_dlpack(cos), to_dlpack(sin))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for bfloat16 ``gate_up [M, 2I]`` (gate first), in torch's rounding."""
    return _act_mul(gate_up, _core.silu_mul_bf16)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's GeGLU) for bfloat16 ``gate_up [M, 2I]``
    (gate first), in torch's rounding."""
    return _act_mul(gate_up, _core.gelu_tanh_mul_bf16)


def _act_mul(gate_up: torch.Tensor, kernel: Callable[..., None]) -> torch.Tensor:
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be [M, 2I]; got {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    kernel(to_dlpack(gate_up), to_dlpack(out))
    return out
