"""Fixtures for the kernel and attention-backend tests: paged scenarios and a dense oracle.

Without CUDA the Triton kernels run on CPU tensors under Triton's
interpreter.  ``triton.jit`` reads TRITON_INTERPRET when a kernel is
decorated, i.e. when ``fastsched.kernels.*`` is first imported, so the switch
is set here, before any test module of this folder imports them.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastsched.attention.base import AttentionMetadata
from fastsched.kernels.reference import reshape_and_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) against an fp64 oracle fed the same rounded inputs.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

Span = tuple[int, int]  # [start, end) positions of a request computed this step


class PagedScenario:
    """Requests whose every position has a query, key and value, laid out in a paged cache.

    Physical blocks are shuffled, block-table rows carry an extra padding
    column of block 0, and the cache starts as NaN: a kernel that reads a
    slot it should not (past a request's length, a padding entry, a slot not
    yet written) turns its output into NaN instead of passing by luck.  With
    ``shared_prefix_blocks=n`` every request after the first reuses request
    0's first ``n`` physical blocks and their keys/values, as a prefix-cache
    hit does.
    """

    def __init__(
        self,
        seq_lens: list[int],
        *,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 32,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = DEVICE,
        shared_prefix_blocks: int = 0,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.scale = head_dim**-0.5
        self.gen = gen

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

        shared = shared_prefix_blocks * block_size
        self.queries = [randn(n, num_heads, head_dim) for n in seq_lens]
        self.keys = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
        self.values = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
        for i in range(1, len(seq_lens) if shared else 0):
            assert seq_lens[i] > shared and seq_lens[0] >= shared
            self.keys[i][:shared] = self.keys[0][:shared]
            self.values[i][:shared] = self.values[0][:shared]

        blocks_per_req = [-(-n // block_size) for n in seq_lens]
        num_needed = blocks_per_req[0] + sum(n - shared_prefix_blocks for n in blocks_per_req[1:])
        num_blocks = num_needed + 3
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
        for i, n in enumerate(blocks_per_req):
            first_own = shared_prefix_blocks if i > 0 else 0
            self.block_tables[i, :first_own] = self.block_tables[0, :first_own]
            for j in range(first_own, n):
                self.block_tables[i, j] = pool.pop()
        self.block_tables = self.block_tables.to(device)
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, device=self.device)
        return self.block_tables[i].long()[pos // self.block_size] * self.block_size + pos % self.block_size

    def write_context(self, context_lens: list[int]) -> None:
        """Put positions [0, context_len) in the cache, as earlier steps would have."""
        for i, n in enumerate(context_lens):
            reshape_and_cache_ref(self.keys[i][:n], self.values[i][:n], self.kv_cache, self.slots(i, 0, n))

    def step(
        self, spans: list[Span], *, num_padding_tokens: int = 0, fused_qkv: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """This step's query/key/value rows and metadata, with padding tokens appended.

        ``fused_qkv`` returns strided views of one [T, (H + 2 H_kv) * D] tensor,
        as a fused QKV projection produces them.
        """
        q = torch.cat([self.queries[i][s:e] for i, (s, e) in enumerate(spans)])
        k = torch.cat([self.keys[i][s:e] for i, (s, e) in enumerate(spans)])
        v = torch.cat([self.values[i][s:e] for i, (s, e) in enumerate(spans)])
        slot_mapping = torch.cat([self.slots(i, s, e) for i, (s, e) in enumerate(spans)])
        if num_padding_tokens:
            pad = num_padding_tokens
            q = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=self.gen).to(q)])
            k = torch.cat([k, torch.randn(pad, *k.shape[1:], generator=self.gen).to(k)])
            v = torch.cat([v, torch.randn(pad, *v.shape[1:], generator=self.gen).to(v)])
            slot_mapping = torch.cat([slot_mapping, torch.full((pad,), -1, device=self.device)])
        if fused_qkv:
            qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
            q_size, kv_size = q[0].numel(), k[0].numel()
            q = qkv[:, :q_size].view(q.shape)
            k = qkv[:, q_size : q_size + kv_size].view(k.shape)
            v = qkv[:, q_size + kv_size :].view(v.shape)
        query_lens = torch.tensor([e - s for s, e in spans])
        query_start_loc = torch.zeros(len(spans) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(query_lens, 0)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.long(),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=torch.tensor([e for _, e in spans], dtype=torch.int32, device=self.device),
            block_tables=self.block_tables,
            max_query_len=int(query_lens.max()),
            max_seq_len=max(e for _, e in spans),
        )
        return q, k, v, metadata

    def dense_attention(
        self, spans: list[Span], num_tokens: int, window: int | None = None, soft_cap: float | None = None
    ) -> torch.Tensor:
        """The oracle: causal attention from the full sequences in fp64, no cache involved;
        with ``window`` a query sees its last that many keys, with ``soft_cap`` scores are
        ``cap * tanh(s / cap)``."""
        group = self.num_heads // self.num_kv_heads
        out = torch.zeros(num_tokens, self.num_heads, self.head_dim, dtype=torch.float64)
        row = 0
        for i, (start, end) in enumerate(spans):
            q = self.queries[i][start:end].double().cpu()
            k = self.keys[i][:end].double().cpu().repeat_interleave(group, dim=1)
            v = self.values[i][:end].double().cpu().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            key_pos, query_pos = torch.arange(end)[None, :], torch.arange(start, end)[:, None]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[row : row + end - start] = torch.einsum("hqk,khd->qhd", probs, v)
            row += end - start
        return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


@pytest.fixture
def scenario() -> type[PagedScenario]:
    return PagedScenario


@pytest.fixture
def close():
    return assert_close
