"""The CUDA attention backend built on the project's own Triton kernels.

Two launches per layer: ``reshape_and_cache`` writes this step's K/V, then
``paged_attention`` runs the whole mixed prefill/decode batch in one kernel.
Neither needs per-step planning nor a device-to-host sync, so the backend
keeps no state between steps.
"""

from __future__ import annotations

import torch

from fastsched.attention.base import AttentionMetadata
from fastsched.kernels.paged_attention import paged_attention
from fastsched.kernels.reshape_and_cache import reshape_and_cache


class TritonBackend:
    """Paged attention with Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1)."""

    name = "triton"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to plan: the kernel finds each program's request on the device."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V at ``slot_mapping``, then attend causally over the cache
        (the last ``sliding_window`` keys only; scores soft-capped at ``logits_soft_cap``)."""
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        # Contiguous (the model reshapes it to [T, hidden]); padding rows stay zero.
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        return paged_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            scale,
            out=out,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
