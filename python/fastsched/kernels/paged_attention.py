"""Triton kernel: causal attention over a paged KV cache for mixed prefill/decode batches.

One kernel serves the whole step, whatever its mix of prefill chunks and
decodes.  A program owns one *query block* of one request for one KV head:
``BLOCK_Q`` consecutive query tokens times the ``num_heads // num_kv_heads``
query heads that share that KV head (GQA), flattened into ``BLOCK_M`` rows.
Packing the head group into rows keeps ``tl.dot``'s M dimension >= 16 even
for a decode (one token) and loads every K/V tile once for the whole group.

The program walks the request's keys in tiles of ``BLOCK_N`` token positions,
looking each position's physical block up in ``block_tables`` (so a tile may
span several cache blocks and any ``block_size`` works), and keeps an online
softmax in fp32 (running max ``m``, running sum ``l``, accumulator ``acc``).
It stops at the last key its query rows can see, so cost is causal.

Grid: ``(T // BLOCK_Q + B, num_kv_heads)``.  Request ``i``'s query blocks are
numbered from ``query_start_loc[i] // BLOCK_Q + i``; that start is monotone in
``i`` and leaves room for ``cdiv(query_len_i, BLOCK_Q)`` blocks, so the total
needs no device-to-host sync, and a program finds its request by binary search.
Programs past a request's last query block exit at once.

With a sliding window (``WINDOW`` > 0, a query sees its last ``WINDOW`` keys) the walk
starts at the tile holding the first key the block's earliest query sees, and the mask
also drops keys older than each row's window; a row can then meet a tile in which it
sees nothing, so the running max is kept finite (a fully masked tile adds zero). With
logit soft-capping (``SOFT_CAP`` > 0) each score becomes ``cap * tanh(score / cap)``
before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_TILE = 32  # BLOCK_N: key positions per inner-loop tile
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block_id, BLOCK_Q: tl.constexpr):
    """Largest request index i with query_start_loc[i] // BLOCK_Q + i <= q_block_id."""
    lo = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        is_left = mid_start <= q_block_id
        lo = tl.where(is_left, mid, lo)
        hi = tl.where(is_left, hi, mid)
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    num_reqs,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_table,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = _find_request(query_start_loc_ptr, num_reqs, q_block_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # query index within the request
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (token < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    io_mask = row_valid[:, None] & dim_valid[None, :]

    q_token = (q_start + token).to(tl.int64)
    q = tl.load(
        query_ptr + q_token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    # Padding rows keep an in-range position too, so every row sees key 0 in
    # the first tile and the running max is finite from then on (no NaN).
    query_pos = context_len + token

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp

    kv_end = context_len + tl.minimum(query_len, (q_block + 1) * BLOCK_Q)
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(context_len + q_block * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < kv_end
        block = tl.load(
            block_tables_ptr + req * stride_block_table + kv_pos // BLOCK_SIZE,
            mask=kv_valid,
            other=0,
        ).to(tl.int64)
        kv_offsets = (
            block * stride_cache_block
            + (kv_pos % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        k = tl.load(  # [HEAD_DIM_PAD, BLOCK_N], already transposed for q @ k
            key_cache_ptr + kv_offsets[None, :] + dims[:, None],
            mask=kv_valid[None, :] & dim_valid[:, None],
            other=0.0,
        ).to(DOT_DTYPE)
        if SOFT_CAP > 0:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
            s = SOFT_CAP * (2.0 * tl.sigmoid(2.0 * s / SOFT_CAP) - 1.0)  # cap * tanh(s / cap)
            s = s * 1.4426950408889634
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        causal = (kv_pos[None, :] <= query_pos[:, None]) & kv_valid[None, :]
        if WINDOW > 0:
            causal = causal & (kv_pos[None, :] > query_pos[:, None] - WINDOW)
        s = tl.where(causal, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        if WINDOW > 0:  # a row that has seen no key yet: subtract 0, so exp2(-inf) = 0, not NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + kv_offsets[:, None] + dims[None, :],
            mask=kv_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    if WINDOW > 0:  # padding rows past the request's end may have seen no key (l = 0); not stored
        l = tl.where(l == 0.0, 1.0, l)
    acc = acc / l[:, None]
    tl.store(
        out_ptr + q_token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention for every request of the step; returns ``out``. With
    ``sliding_window`` a query sees only its last that many keys; with ``logits_soft_cap``
    scores are soft-capped (``cap * tanh(s / cap)``).

    ``query`` and ``kv_cache`` must share a dtype (fp32, fp16 or bf16); the
    softmax and accumulation are fp32 either way, and fp32 dots run in IEEE
    precision (no TF32) so fp32 results match the reference tightly.  Rows of
    ``out`` that belong to no request (padding past ``query_start_loc[-1]``)
    are left untouched.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if query.dtype not in _DOT_DTYPES:
        raise ValueError(f"paged_attention supports {list(_DOT_DTYPES)}, got {query.dtype}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("kv_cache and out must be contiguous in their last (head_dim) dimension")
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = _block_m(group, head_dim, max_query_len)
    block_q = block_m // group
    dot_dtype = _DOT_DTYPES[query.dtype]
    if query.device.type == "cpu" and query.dtype == torch.bfloat16:
        # Only Triton's interpreter runs on CPU tensors, and it multiplies the
        # raw bit patterns in a bf16 tl.dot (triton-lang/triton#11584).
        dot_dtype = tl.float32
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=KV_TILE,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        WINDOW=sliding_window or 0,
        SOFT_CAP=float(logits_soft_cap or 0.0),
        # Gathered K/V tiles carry a 64-bit address per element; with 4 warps
        # the larger tiles spill registers (ptxas, sm_80 and sm_90).
        num_warps=8 if block_m * head_dim_pad >= 4096 else 4,
    )
    return out


def _block_m(group: int, head_dim: int, max_query_len: int) -> int:
    """Rows per program: >= 16 for tl.dot, >= the head group, larger for prefill.

    A decode-only step gets the smallest tile (one token per request wastes the
    rest); prefill gets 64 rows, or 32 when head_dim > 128 to bound registers.
    """
    if max_query_len <= 1:
        rows = 16
    else:
        rows = 64 if head_dim <= 128 else 32
    return max(rows, triton.next_power_of_2(group))
