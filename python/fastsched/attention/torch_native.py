"""The CPU attention backend: plain torch ops, vectorised per request.

Each prefill chunk gathers its own keys and values from the paged cache with
its block table and runs one ``scaled_dot_product_attention`` with a causal
mask offset by the context already in the cache.  Decodes (one query token,
which sees every key) are the common case at high concurrency, so they are
batched: their key/value rows are gathered into one padded tensor and run
through a single SDPA call with a length mask, instead of one call each.
Runs on any device, which also makes it the oracle for the GPU backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastsched.attention.base import AttentionMetadata
from fastsched.kernels.reference import reshape_and_cache_ref

# Cap on key positions gathered per batched-decode SDPA call (requests x
# padded length), so a large batch of long decodes does not allocate the
# padded K/V for all of them at once.
DECODE_GATHER_TOKENS = 1 << 16


class TorchNativeBackend:
    """Attention with torch ops; a Python loop over prefill requests, none over tokens."""

    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to plan: every layer reads the metadata directly."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V at ``slot_mapping``, then attend causally over the cache."""
        reshape_and_cache_ref(key, value, kv_cache, metadata.slot_mapping)
        # Contiguous (the model reshapes it to [T, hidden]); padding rows stay zero.
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        decodes = []
        for i, seq_len in enumerate(seq_lens):
            query_len = starts[i + 1] - starts[i]
            if query_len == 1:
                decodes.append(i)
            elif query_len > 1:
                out[starts[i] : starts[i + 1]] = _prefill(
                    query[starts[i] : starts[i + 1]],
                    kv_cache,
                    metadata.block_tables[i],
                    seq_len,
                    scale,
                )
        if decodes:
            max_decode_len = max(seq_lens[i] for i in decodes)
            chunk = max(1, DECODE_GATHER_TOKENS // max_decode_len)
            for first in range(0, len(decodes), chunk):
                reqs = torch.tensor(decodes[first : first + chunk], device=query.device)
                rows = metadata.query_start_loc[reqs].long()
                out[rows] = _decode(
                    query[rows], kv_cache, metadata.block_tables[reqs], metadata.seq_lens[reqs], scale
                )
        return out


def _prefill(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks_per_req]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """One request's chunk: its query row j sits at position seq_len - query_len + j."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
    values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    query_len = query.shape[0]
    context_len = seq_len - query_len
    if context_len == 0:
        mask = None
    else:
        key_pos = torch.arange(seq_len, device=query.device)
        query_pos = context_len + torch.arange(query_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [num_heads, query_len, head_dim]
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _decode(
    query: torch.Tensor,  # [n, num_heads, head_dim], one token per request
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks_per_req]
    seq_lens: torch.Tensor,  # [n]
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """Single-token requests in one SDPA call over keys padded to the longest of them."""
    block_size = kv_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()  # [n, num_blocks]
    keys = kv_cache[0, blocks].flatten(1, 2)[:, :max_len]  # [n, max_len, num_kv_heads, head_dim]
    values = kv_cache[1, blocks].flatten(1, 2)[:, :max_len]
    valid = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [n, max_len]
    # Rows past a request's length come from padding or stale slots and may
    # hold NaN, which neither the mask nor a zero weight cancels: clear them.
    pad = ~valid[:, :, None, None]
    keys.masked_fill_(pad, 0.0)  # in place: keys/values are views of fresh gathers
    values.masked_fill_(pad, 0.0)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [n, num_heads, 1, head_dim]
        keys.transpose(1, 2),  # [n, num_kv_heads, max_len, head_dim]
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]
