"""The FlashInfer attention backend (CUDA, fp16/bf16), used when flashinfer is installed.

FlashInfer splits attention into ``plan()`` (host-side scheduling of the
step's work, which copies the page table to the host) and ``run()`` (the
kernel).  Planning is per step, not per layer: the first ``forward()`` after
``prepare()`` plans, because only then are the head counts, head dim, block
size, dtypes and scale known (the backend is built before the model), and
every later layer of the step reuses that plan.

Our cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, so
``(kv_cache[0], kv_cache[1])`` is exactly FlashInfer's "NHD" pair of
``[num_pages, page_size, num_kv_heads, head_dim]`` tensors: no copy.  The
block tables become FlashInfer's CSR form (``paged_kv_indptr``,
``paged_kv_indices``, ``paged_kv_last_page_len``), and ``causal=True`` aligns
the causal mask to the end of each request's keys, which is our rule that
query row j sits at position ``seq_len - query_len + j``.

Layers with a sliding window or logit soft-capping (Gemma) are planned apart: one wrapper
(sharing the workspace) per ``(window, soft cap)`` the step's layers use, planned with
FlashInfer's ``window_left`` (the keys before the query's own: ``window - 1``) and
``logits_soft_cap``.

The import is guarded so that importing ``fastsched.attention`` never needs
flashinfer; ``select_backend`` only builds this backend when it is available.
"""

from __future__ import annotations

import torch

from fastsched.attention.base import AttentionMetadata
from fastsched.kernels.reshape_and_cache import reshape_and_cache

try:
    import flashinfer
except ImportError:
    flashinfer = None

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    return flashinfer is not None


class FlashInferBackend:
    """Paged attention through FlashInfer's batch prefill wrapper (prefill and decode alike)."""

    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if flashinfer is None:
            raise ImportError("the flashinfer attention backend needs the flashinfer package")
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # One wrapper per (sliding window, soft cap) a layer uses, each with this step's plan key.
        self._wrappers: dict[tuple[int | None, float | None], object] = {}
        self._plan_keys: dict[tuple[int | None, float | None], tuple] = {}
        self._metadata: AttentionMetadata | None = None
        self._num_tokens = 0

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Start a step: the next forward() of each kind of layer plans for this metadata."""
        self._metadata = metadata
        self._plan_keys = {}

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
        if metadata is not self._metadata:
            raise RuntimeError("FlashInferBackend.prepare() was not called with this step's metadata")
        if query.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the flashinfer backend supports fp16 and bf16, got {query.dtype}; "
                "use the triton backend for fp32"
            )
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        kind = (sliding_window, logits_soft_cap)
        wrapper = self._wrappers.get(kind)
        if wrapper is None:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._wrappers[kind] = wrapper
        plan_key = (query.shape[1:], kv_cache.shape[2:], query.dtype, kv_cache.dtype, scale)
        if plan_key != self._plan_keys.get(kind):
            self._plan(wrapper, query, kv_cache, metadata, scale, sliding_window, logits_soft_cap)
            self._plan_keys[kind] = plan_key
        # Contiguous (the model reshapes it to [T, hidden]); padding rows stay zero.
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        n = self._num_tokens  # rows past query_start_loc[-1] are batch padding
        if n > 0:
            wrapper.run(query[:n].contiguous(), (kv_cache[0], kv_cache[1]), out=out[:n])
        return out

    def _plan(
        self,
        wrapper: object,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
    ) -> None:
        block_size = kv_cache.shape[2]
        qo_indptr = metadata.query_start_loc.to("cpu", torch.int32)
        seq_lens = metadata.seq_lens.to("cpu", torch.int32)
        # Requests with no query rows (batch padding) own no pages, which
        # FlashInfer's page table cannot express (every request has a last
        # page of 1..page_size entries); leaving them out moves no row.
        keep = qo_indptr[1:] > qo_indptr[:-1]
        self._num_tokens = int(qo_indptr[-1])
        if self._num_tokens == 0:
            return
        qo_indptr = torch.cat([qo_indptr[:1], qo_indptr[1:][keep]])
        seq_lens = seq_lens[keep]
        num_pages = (seq_lens + block_size - 1) // block_size
        kv_indptr = torch.zeros(num_pages.shape[0] + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(num_pages, 0)
        last_page_len = seq_lens - (num_pages - 1) * block_size
        block_tables = metadata.block_tables[keep.to(metadata.block_tables.device)]
        page_index = torch.arange(block_tables.shape[1], device=block_tables.device)
        in_use = page_index[None, :] < num_pages.to(block_tables.device)[:, None]
        kv_indices = block_tables[in_use].to(torch.int32)  # row-major: request by request
        wrapper.plan(  # type: ignore[attr-defined]
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            query.shape[1],  # num_qo_heads
            kv_cache.shape[3],  # num_kv_heads
            query.shape[2],  # head_dim
            block_size,
            causal=True,
            sm_scale=scale,
            window_left=-1 if sliding_window is None else sliding_window - 1,
            logits_soft_cap=logits_soft_cap or 0.0,
            q_data_type=query.dtype,
            kv_data_type=kv_cache.dtype,
        )
