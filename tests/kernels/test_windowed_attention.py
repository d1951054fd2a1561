"""Sliding-window attention and logit soft-capping (Gemma 2/3) in every attention backend,
against the dense oracle: prefill chunks whose context reaches past the window, whole
prompts longer than it batched together, and decodes far beyond it, in one step.

The Triton kernel runs under Triton's interpreter here (on CUDA, compiled); FlashInfer
against the fake wrapper of ``test_attention_backends`` (FlashInfer's documented
``window_left`` and ``logits_soft_cap``), so the real library is not exercised here.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import fake_flashinfer  # noqa: F401  (the fixture, tests/kernels on the path)

from fastsched.attention.cpu import CpuBackend
from fastsched.attention.torch_native import TorchNativeBackend
from fastsched.attention.triton import TritonBackend
from fastsched.kernels import cpu_ops

# (context_lens, query_lens): a chunk with context past the window, fresh prompts longer than it
# (batched), a chunk inside it, decodes beyond it and one inside it.
WINDOWED_STEP = ([40, 0, 0, 3, 70, 2, 0], [12, 19, 25, 4, 1, 1, 1])
WINDOW = 7  # not a multiple of the block size (16) or the kernel's key tile (32)


def _backends() -> list:
    backends = [TorchNativeBackend, TritonBackend]
    return backends + ([CpuBackend] if cpu_ops.AVAILABLE else [])


def _step(scenario, dtype=torch.float32, **shape):
    context_lens, query_lens = WINDOWED_STEP
    spans = [(c, c + q) for c, q in zip(context_lens, query_lens)]
    s = scenario([e for _, e in spans], dtype=dtype, **shape)
    s.write_context(context_lens)
    return s, spans


@pytest.mark.parametrize("backend_cls", _backends(), ids=lambda c: c.name)
@pytest.mark.parametrize(
    ("window", "soft_cap"),
    [(WINDOW, None), (None, 2.0), (WINDOW, 2.0), (1, None)],
    ids=["window", "soft_cap", "both", "window_1"],
)
def test_windowed_and_soft_capped_attention_matches_the_dense_oracle(
    scenario, close, backend_cls, window, soft_cap
):
    s, spans = _step(scenario)
    query, key, value, metadata = s.step(spans, num_padding_tokens=3, fused_qkv=True)
    backend = backend_cls()
    backend.prepare(metadata)
    out = backend.forward(
        query, key, value, s.kv_cache, metadata, s.scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    n = sum(e - b for b, e in spans)
    close(out[:n], s.dense_attention(spans, n, window, soft_cap), torch.float32)
    assert torch.all(out[n:] == 0)


@pytest.mark.parametrize("backend_cls", _backends(), ids=lambda c: c.name)
def test_windowed_and_full_layers_of_one_step_each_get_their_own_masks(scenario, close, backend_cls):
    """Gemma's layers alternate: a full layer after a windowed one (same step, one prepare)
    must not reuse the windowed plan, nor the other way round."""
    s, spans = _step(scenario, num_heads=6, num_kv_heads=2, head_dim=40, block_size=8)
    query, key, value, metadata = s.step(spans, fused_qkv=True)
    backend = backend_cls()
    backend.prepare(metadata)
    n = sum(e - b for b, e in spans)
    for window in (WINDOW, None, WINDOW):
        out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale, sliding_window=window)
        close(out, s.dense_attention(spans, n, window), torch.float32)


def test_flashinfer_plans_each_kind_of_layer_once_a_step(scenario, close, fake_flashinfer):  # noqa: F811
    backend = fake_flashinfer.FlashInferBackend(torch.device("cpu"))
    s, spans = _step(scenario, dtype=torch.bfloat16)
    query, key, value, metadata = s.step(spans, num_padding_tokens=2)
    backend.prepare(metadata)
    n = sum(e - b for b, e in spans)
    for window, cap in [(WINDOW, 2.0), (None, None), (WINDOW, 2.0), (None, None)]:
        out = backend.forward(
            query, key, value, s.kv_cache, metadata, s.scale, sliding_window=window, logits_soft_cap=cap
        )
        close(out[:n], s.dense_attention(spans, n, window, cap), torch.bfloat16)
    assert fake_flashinfer.flashinfer.BatchPrefillWithPagedKVCacheWrapper.plans == 2


@pytest.mark.parametrize(
    "backend_cls", [TorchNativeBackend] + ([CpuBackend] if cpu_ops.AVAILABLE else []), ids=lambda c: c.name
)
def test_windowed_layers_read_no_key_before_the_window(scenario, close, backend_cls):
    """Keys that left every query's window are never gathered: poisoned with NaN (which a
    masked read would carry into the output, NaN * 0 = NaN), the output stays exact. Decodes
    read their last ``window`` keys only; a chunk skips the blocks before its first query's window."""
    s, spans = _step(scenario)
    for i, (start, end) in enumerate(spans):
        if start == 0:
            continue
        cut = end - WINDOW if end - start == 1 else max(0, start - WINDOW + 1) // s.block_size * s.block_size
        if cut > 0:
            s.kv_cache.view(2, -1, s.num_kv_heads, s.head_dim)[:, s.slots(i, 0, cut)] = float("nan")
    query, key, value, metadata = s.step(spans, fused_qkv=True)
    backend = backend_cls()
    backend.prepare(metadata)
    out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale, sliding_window=WINDOW)
    n = sum(e - b for b, e in spans)
    close(out, s.dense_attention(spans, n, WINDOW), torch.float32)
