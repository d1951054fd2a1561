"""Pure-torch references for the Triton kernels: slow, simple, obviously correct.

They read the same paged layout as the kernels (``kv_cache`` of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]``) but gather every key
position explicitly and do the softmax in fp32, one request at a time, so a
reader can check them line by line against the contract in
``fastsched.attention.base``.  Tests compare the kernels and the CPU
backend against these.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int, negative = padding token
) -> None:
    """Write each token's K/V row at its cache slot; padding tokens write nothing."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # .view (not .reshape) so that a cache that cannot be flattened without a
    # copy fails loudly instead of silently writing into a temporary.
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    key_slots[slots] = key[valid].to(kv_cache.dtype)
    value_slots[slots] = value[valid].to(kv_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks_per_req]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]; rows of no request are zero
    """Causal attention of each request's query rows over its paged keys."""
    block_size = kv_cache.shape[2]
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        offsets = positions % block_size
        keys = kv_cache[0, blocks, offsets].float()  # [seq_len, num_kv_heads, head_dim]
        values = kv_cache[1, blocks, offsets].float()
        keys = keys.repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [query_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        # Query row j sits at absolute position seq_len - query_len + j.
        query_pos = seq_len - query_len + torch.arange(query_len, device=query.device)
        causal = positions[None, :] <= query_pos[:, None]  # [query_len, seq_len]
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out
