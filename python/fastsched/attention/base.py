"""The contract between the model and an attention backend.

A step's tokens are one flattened batch: ``T`` query tokens from ``B`` requests,
prefill chunks and decodes mixed, request ``i`` owning query rows
``query_start_loc[i]:query_start_loc[i+1]``.  Each request's keys and values live
in a paged KV cache: per layer one tensor of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1 values);
token ``t`` of request ``i`` sits in block ``block_tables[i, t // block_size]`` at
offset ``t % block_size``.  A backend first writes this step's K/V into the cache
at ``slot_mapping`` (``block_id * block_size + offset``), then lets every query
token attend causally to all keys of its request up to and including its own
position, prefix-cached blocks included; a layer's :class:`AttentionOptions` may narrow that
to a sliding window and soft-cap its scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step by the runner)."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each query token's K/V
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (computed + scheduled)
    block_tables: torch.Tensor  # [B, max_blocks_per_req] int32, rows padded with 0
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def from_host(cls, step: Any, on_device: Callable[[Any], torch.Tensor]) -> AttentionMetadata:
        """From a step's host arrays (the runner's prepared step, or a tensor-parallel
        worker's ``StepInputs``), each moved by ``on_device``."""
        return cls(
            on_device(step.slot_mapping),
            on_device(step.query_start_loc),
            on_device(step.seq_lens),
            on_device(step.block_tables),
            step.max_query_len,
            step.max_seq_len,
        )


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's departures from plain causal attention, in vLLM's names (Gemma 2 / 3); the
    default is plain causal attention."""

    # A query at position p attends the keys in (p - sliding_window, p]: sliding_window keys,
    # its own included (transformers' sliding mask, vLLM's window_left = sliding_window - 1).
    sliding_window: int | None = None
    # Scores s = scale * q.k become logits_soft_cap * tanh(s / logits_soft_cap) before the softmax.
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and not 0 < self.logits_soft_cap < float("inf"):
            raise ValueError(f"logits_soft_cap must be positive and finite, got {self.logits_soft_cap}")

    @property
    def plain(self) -> bool:
        """Plain causal attention (no window, no cap)."""
        return self.sliding_window is None and self.logits_soft_cap is None


PLAIN_ATTENTION = AttentionOptions()


class AttentionBackend(Protocol):
    """One implementation per device family (torch, Triton, FlashInfer)."""

    name: str

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Per-step planning shared by all layers (e.g. FlashInfer's plan()); may be a no-op."""

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V at ``slot_mapping``, then attend causally over the cache: a
        query at position p attends the keys in (p - sliding_window, p] when the layer has a
        window, with scores soft-capped at ``logits_soft_cap`` when it has one
        (:class:`AttentionOptions` says the same in one value)."""
        ...
