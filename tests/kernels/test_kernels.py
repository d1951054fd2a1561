"""The Triton kernels against their torch references (CPU: Triton's interpreter).

Each case is one step: some context already in the paged cache, this step's
tokens written by ``reshape_and_cache``, then ``paged_attention`` over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from fastsched.kernels.paged_attention import paged_attention
from fastsched.kernels.reference import paged_attention_ref, reshape_and_cache_ref
from fastsched.kernels.reshape_and_cache import reshape_and_cache


@dataclass
class Case:
    context_lens: list[int]  # tokens already in the cache before this step
    query_lens: list[int]  # tokens computed this step
    shape: dict = field(default_factory=dict)  # PagedScenario keyword arguments
    step: dict = field(default_factory=dict)  # PagedScenario.step keyword arguments

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(c, c + q) for c, q in zip(self.context_lens, self.query_lens)]


CASES = {
    # Fresh prefill with a partial last block, two decodes, and a chunk whose
    # context ends exactly on a block boundary.
    "mixed_batch": Case([0, 36, 16, 4], [21, 1, 9, 1]),
    # Requests 1 and 2 reuse request 0's first two physical blocks.
    "prefix_shared_blocks": Case([32, 39, 34], [5, 1, 3], shape=dict(shared_prefix_blocks=2)),
    # Group of 3 query heads per KV head (not a power of two), head_dim
    # padded 40 -> 64, and blocks of 8 so one key tile spans four blocks.
    "gqa3_head_dim_40_block_8": Case(
        [13, 49, 6], [18, 1, 1], shape=dict(num_heads=6, num_kv_heads=2, head_dim=40, block_size=8)
    ),
    # Decode-only step (the small-tile path) with all 8 heads on one KV head.
    "decode_only_mqa": Case([69, 2, 32], [1, 1, 1], shape=dict(num_heads=8, num_kv_heads=1)),
    # A 70-token chunk spans two query blocks of 64 rows.
    "two_query_blocks_mha": Case([10, 0], [70, 3], shape=dict(num_heads=2, num_kv_heads=2)),
    # Rows past the last request (slot -1) and strided q/k/v views.
    "padding_tokens_fused_qkv": Case([5, 20], [12, 1], step=dict(num_padding_tokens=3, fused_qkv=True)),
}

FP32_CASES = [pytest.param(name, torch.float32, id=f"{name}-fp32") for name in CASES]
HALF_CASES = [
    pytest.param(name, dtype, id=f"{name}-{tag}")
    for name in ("mixed_batch", "prefix_shared_blocks")
    for dtype, tag in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"))
]


def _step(scenario, case: Case, dtype: torch.dtype = torch.float32):
    """Scenario with context cached and this step's K/V written; returns (scenario, q, metadata)."""
    seq_lens = [end for _, end in case.spans]
    s = scenario(seq_lens, dtype=dtype, **case.shape)
    s.write_context(case.context_lens)
    query, key, value, metadata = s.step(case.spans, **case.step)
    reshape_and_cache_ref(key, value, s.kv_cache, metadata.slot_mapping)
    return s, query, metadata


def _kernel(s, query, metadata, out=None) -> torch.Tensor:
    return paged_attention(
        query,
        s.kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.max_query_len,
        s.scale,
        out=out,
    )


def _reference(s, query, metadata) -> torch.Tensor:
    return paged_attention_ref(
        query, s.kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, s.scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reshape_and_cache_writes_the_same_slots_as_the_reference(scenario, dtype):
    case = CASES["padding_tokens_fused_qkv"]
    s = scenario([end for _, end in case.spans], dtype=dtype)
    s.write_context(case.context_lens)
    _, key, value, metadata = s.step(case.spans, **case.step)
    expected = s.kv_cache.clone()
    reshape_and_cache_ref(key, value, expected, metadata.slot_mapping)
    reshape_and_cache(key, value, s.kv_cache, metadata.slot_mapping)
    torch.testing.assert_close(s.kv_cache, expected, atol=0, rtol=0, equal_nan=True)


def test_reshape_and_cache_skips_negative_slots(scenario):
    s = scenario([20, 7])
    _, key, value, metadata = s.step([(0, 20), (0, 7)])
    before = s.kv_cache.clone()
    reshape_and_cache(key, value, s.kv_cache, torch.full_like(metadata.slot_mapping, -1))
    torch.testing.assert_close(s.kv_cache, before, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(("case_name", "dtype"), FP32_CASES + HALF_CASES)
def test_paged_attention_matches_reference(scenario, close, case_name, dtype):
    s, query, metadata = _step(scenario, CASES[case_name], dtype)
    num_tokens = int(metadata.query_start_loc[-1])
    out = _kernel(s, query, metadata)
    expected = _reference(s, query, metadata)
    close(out[:num_tokens], expected[:num_tokens], dtype)


def test_paged_attention_leaves_padding_rows_untouched(scenario):
    s, query, metadata = _step(scenario, CASES["padding_tokens_fused_qkv"])
    num_tokens = int(metadata.query_start_loc[-1])
    out = torch.full(query.shape, 7.0, device=query.device)
    _kernel(s, query, metadata, out=out)
    assert num_tokens < query.shape[0]
    assert torch.all(out[num_tokens:] == 7.0)


@pytest.mark.parametrize("case_name", CASES)
def test_reference_matches_dense_causal_attention(scenario, close, case_name):
    case = CASES[case_name]
    s, query, metadata = _step(scenario, case)
    num_tokens = int(metadata.query_start_loc[-1])
    out = _reference(s, query, metadata)
    close(out[:num_tokens], s.dense_attention(case.spans, num_tokens), torch.float32)


def test_paged_attention_rejects_query_and_cache_of_different_dtypes(scenario):
    s, query, metadata = _step(scenario, CASES["mixed_batch"])
    with pytest.raises(ValueError, match="differs from kv_cache dtype"):
        _kernel(s, query.half(), metadata)
