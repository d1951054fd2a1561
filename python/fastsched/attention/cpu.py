"""The CPU attention backend: the Rust paged-attention kernel of ``fastsched.kernels.cpu_ops``.

One call a layer writes the step's keys and values into the cache and attends for every
request whose query is short (decodes, draft verifications, small prefill chunks), straight
from the paged cache: no gather, no padding, no mask. On SmolLM2-135M a one-token decode
took ~200 µs a layer through SDPA and takes a few µs here (bench/RESULTS.md).

Each query row's numbers depend only on its own position and the cache (the kernel's
docs), so a request gets the same logits whatever shares its step — what speculative
decoding's greedy equivalence needs. Prefill chunks of ``SDPA_MIN_QUERY_LEN`` rows or more
go to torch's SDPA instead (:mod:`fastsched.attention.torch_native`'s per-request path),
whose blocked GEMMs beat the kernel's per-row loop there; which path a request takes
depends only on its own query length, so the invariance holds. A layer with a sliding window
or a logit soft-cap (:class:`AttentionOptions`) runs every request on the kernel, which
implements both. Query dtypes other than float32 and bfloat16 run entirely on the torch
backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastsched.attention.base import AttentionMetadata, AttentionOptions
from fastsched.attention.torch_native import TorchNativeBackend, _plan_prefill, _Prefill, _prefill
from fastsched.kernels import cpu_ops

# Query rows from which a request's chunk goes to SDPA: the kernel was faster up to 128 rows and
# close at 512 (bench/RESULTS.md, measured on a loaded machine); SDPA's blocked GEMMs keep long prompts.
SDPA_MIN_QUERY_LEN = 256


@dataclass
class _CpuPlan:
    metadata: AttentionMetadata
    step: tuple[torch.Tensor, ...]  # slot_mapping, query_start_loc, seq_lens, block_tables, kernel requests
    prefills: list[_Prefill]  # long chunks, one SDPA call each
    num_rows: int  # query rows of real requests; the rest are padding


class CpuBackend:
    """Rust paged attention for short queries, SDPA for long prefill chunks."""

    name = "cpu"

    def __init__(self) -> None:
        # This step's plans: with long chunks on SDPA (True), all on the kernel (False).
        self._plans: dict[bool, _CpuPlan] = {}
        self._torch = TorchNativeBackend()

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Drop the previous step's plans; the next forward builds this step's."""
        self._plans = {}
        self._torch.prepare(metadata)

    def kernel_step(
        self, metadata: AttentionMetadata, block_size: int
    ) -> tuple[tuple[torch.Tensor, ...], int] | None:
        """This step's checked tensors for the Rust kernel and its number of real query rows,
        if the kernel attends for every request (no prefill chunk goes to SDPA); else None.
        What a caller running the layers in Rust (``fastsched.models.llama_cpu``) passes on."""
        plan = self._step_plan(metadata, block_size, sdpa=True)
        return None if plan.prefills else (plan.step, plan.num_rows)

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
        (within the layer's ``sliding_window``, scores soft-capped at ``logits_soft_cap``)."""
        options = AttentionOptions(sliding_window, logits_soft_cap)
        if query.dtype not in cpu_ops.DTYPES or kv_cache.dtype not in cpu_ops.DTYPES:
            return self._torch.forward(
                query, key, value, kv_cache, metadata, scale, sliding_window, logits_soft_cap
            )
        plan = self._step_plan(metadata, kv_cache.shape[2], sdpa=options.plain)
        out = torch.empty(query.shape, dtype=query.dtype)
        if plan.num_rows < out.shape[0]:
            out[plan.num_rows :].zero_()  # padding rows (the contract: zero)
        cpu_ops.paged_attention(
            query,
            key,
            value,
            out,
            kv_cache,
            plan.step,
            scale,
            options.logits_soft_cap,
            options.sliding_window,
        )
        for p in plan.prefills:
            rows = slice(p.start, p.end)
            out[rows] = _prefill(query[rows], key[rows], value[rows], kv_cache, p, scale)
        return out

    def _step_plan(self, metadata: AttentionMetadata, block_size: int, sdpa: bool) -> _CpuPlan:
        """This step's plan, built by the first layer (or ``kernel_step``) that asks."""
        plan = self._plans.get(sdpa)
        if plan is None or plan.metadata is not metadata:
            plan = self._plans[sdpa] = _plan_step(metadata, block_size, sdpa)
        return plan


def _plan_step(metadata: AttentionMetadata, block_size: int, sdpa: bool) -> _CpuPlan:
    """Split the requests into the kernel's and (if ``sdpa``) SDPA's by query length; check
    the step's tensors once for the binding."""
    qsl = metadata.query_start_loc
    query_lens = qsl.diff()
    long = query_lens >= SDPA_MIN_QUERY_LEN if sdpa else torch.zeros(query_lens.shape, dtype=torch.bool)
    reqs = torch.nonzero(~long).flatten().to(torch.int32)
    starts = qsl.tolist() if bool(long.any()) else []
    prefills = [
        _plan_prefill(
            starts[i], starts[i + 1], int(metadata.seq_lens[i]), metadata.block_tables[i], block_size
        )
        for i in torch.nonzero(long).flatten().tolist()
    ]
    step = (
        metadata.slot_mapping.contiguous(),
        qsl.contiguous(),
        metadata.seq_lens.contiguous(),
        metadata.block_tables.contiguous(),
        reqs,
    )
    for name, t, dtype in zip(
        ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "reqs"),
        step,
        (torch.int64,) + (torch.int32,) * 4,
    ):
        cpu_ops.check_step_tensor(name, t, dtype)
    if step[3].dim() != 2 or step[3].shape[0] != step[2].shape[0]:
        raise ValueError(f"block_tables must be [num_reqs, max_blocks]; got {tuple(step[3].shape)}")
    return _CpuPlan(metadata, step, prefills, int(qsl[-1]) if qsl.numel() else 0)
