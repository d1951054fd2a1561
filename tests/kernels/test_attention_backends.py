"""Attention backends end to end (cache write + attention) against a dense oracle.

The oracle recomputes causal attention from each request's full sequence, so
these tests check the torch backend (the CPU path and the GPU backends'
reference) from scratch, and every backend across steps that feed each other
through the cache.  CUDA-only and FlashInfer-only tests skip here.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from fastsched.attention import select_backend
from fastsched.attention.base import AttentionMetadata
from fastsched.attention.torch_native import TorchNativeBackend
from fastsched.attention.triton import TritonBackend

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET unset)",
)
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
)

# name -> (context_lens, query_lens, PagedScenario keyword arguments)
STEPS = {
    "mixed_batch": ([0, 36, 16, 4], [21, 1, 9, 1], {}),
    "prefix_shared_blocks": ([32, 39, 34], [5, 1, 3], dict(shared_prefix_blocks=2)),
    "gqa3_head_dim_40_block_8": (
        [13, 49, 6],
        [18, 1, 1],
        dict(num_heads=6, num_kv_heads=2, head_dim=40, block_size=8),
    ),
    "decode_only": ([69, 2, 32], [1, 1, 1], {}),
    # seq_len 1: all of a request's padding reads the slot this step just wrote
    "one_token_prompts_beside_a_long_decode": ([0, 47, 0], [1, 1, 1], {}),
    # whole prompts of different lengths, batched into one padded call, beside a chunk with context and a decode
    "fresh_prompts_batched": ([0, 0, 30, 0, 21, 0], [7, 21, 1, 12, 6, 2], {}),
    "fresh_prompts_gqa3_block_8": (
        [0, 0, 0],
        [9, 17, 3],
        dict(num_heads=6, num_kv_heads=2, head_dim=40, block_size=8),
    ),
}


def _run_step(backend, scenario, name, dtype, num_padding_tokens=0):
    """One step of STEPS[name] through ``backend``; returns (output, expected, valid rows)."""
    context_lens, query_lens, shape = STEPS[name]
    spans = [(c, c + q) for c, q in zip(context_lens, query_lens)]
    s = scenario([end for _, end in spans], dtype=dtype, **shape)
    s.write_context(context_lens)
    query, key, value, metadata = s.step(spans, num_padding_tokens=num_padding_tokens, fused_qkv=True)
    backend.prepare(metadata)
    out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale)
    num_tokens = sum(query_lens)
    return out, s.dense_attention(spans, num_tokens), num_tokens


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_torch_native_matches_dense_attention(scenario, close, name, dtype):
    out, expected, n = _run_step(TorchNativeBackend(), scenario, name, dtype)
    close(out[:n], expected, dtype)


def test_torch_native_splits_decodes_past_the_gather_cap(scenario, close, monkeypatch):
    from fastsched.attention import torch_native

    monkeypatch.setattr(torch_native, "DECODE_GATHER_TOKENS", 100)  # one decode of 70 per call
    out, expected, n = _run_step(TorchNativeBackend(), scenario, "decode_only", torch.float32)
    close(out[:n], expected, torch.float32)


def test_torch_native_layers_share_one_step_plan(scenario, close):
    """The plan built at a step's first layer serves the others; each layer reads its own cache."""
    spans = [(0, 21), (36, 37), (16, 25), (4, 5)]
    layers = [scenario([end for _, end in spans], seed=seed) for seed in (0, 1)]
    layers[1].block_tables = layers[0].block_tables  # one block table per step, as the runner has
    backend = TorchNativeBackend()
    metadata = None
    for s in layers:
        s.write_context([start for start, _ in spans])
        query, key, value, step_metadata = s.step(spans)
        metadata = metadata or step_metadata
        if s is layers[0]:
            backend.prepare(metadata)
        out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale)
        close(out, s.dense_attention(spans, query.shape[0]), torch.float32)


def test_torch_native_plans_a_step_whose_caller_skipped_prepare(scenario, close):
    """New metadata without prepare() gets its own plan, not the previous step's."""
    backend = TorchNativeBackend()
    s = scenario([40, 9])
    for spans in ([(0, 23), (0, 8)], [(23, 40), (8, 9)]):
        query, key, value, metadata = s.step(spans)
        out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale)
        close(out, s.dense_attention(spans, query.shape[0]), torch.float32)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("mixed_batch", torch.float32),
        ("prefix_shared_blocks", torch.bfloat16),
        ("gqa3_head_dim_40_block_8", torch.float16),
    ],
    ids=["mixed_batch-fp32", "prefix_shared_blocks-bf16", "gqa3_head_dim_40_block_8-fp16"],
)
def test_triton_backend_matches_dense_attention(scenario, close, name, dtype):
    out, expected, n = _run_step(TritonBackend(), scenario, name, dtype)
    close(out[:n], expected, dtype)


@pytest.mark.parametrize("backend_cls", [TorchNativeBackend, TritonBackend])
def test_padding_tokens_write_nothing_and_get_zero_rows(scenario, close, backend_cls):
    out, expected, n = _run_step(backend_cls(), scenario, "mixed_batch", torch.float32, num_padding_tokens=3)
    close(out[:n], expected, torch.float32)
    assert out.shape[0] == n + 3 and torch.all(out[n:] == 0)


@pytest.mark.parametrize("backend_cls", [TorchNativeBackend, TritonBackend])
def test_chunked_prefill_reads_what_earlier_steps_wrote(scenario, close, backend_cls):
    """Step 2 sees only the cache the backend itself filled in step 1 (no write_context)."""
    backend = backend_cls()
    s = scenario([40, 9])
    for spans in ([(0, 23), (0, 8)], [(23, 40), (8, 9)]):
        query, key, value, metadata = s.step(spans)
        backend.prepare(metadata)
        out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale)
        close(out, s.dense_attention(spans, query.shape[0]), torch.float32)


def test_select_backend_picks_the_rust_kernel_on_cpu():
    assert select_backend(torch.device("cpu"), None).name == "cpu"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"


def test_select_backend_names_an_unknown_override():
    with pytest.raises(
        ValueError, match="unknown attention backend 'cutlass'.*torch, cpu, triton, flashinfer"
    ):
        select_backend(torch.device("cpu"), "cutlass")


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_select_backend_refuses_gpu_backends_on_cpu(name):
    with pytest.raises(ValueError, match=f"'{name}' needs a CUDA device"):
        select_backend(torch.device("cpu"), name)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_select_backend_says_flashinfer_is_missing():
    with pytest.raises(ValueError, match="'flashinfer' is unavailable"):
        select_backend(torch.device("cuda"), "flashinfer")


class _FakePrefillWrapper:
    """FlashInfer's documented paged-prefill semantics in torch: CSR pages, bottom-right causal."""

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout == "NHD"

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        causal,
        sm_scale,
        window_left,
        logits_soft_cap,
        q_data_type,
        kv_data_type,
    ):
        assert causal and qo_indptr.dtype == kv_indptr.dtype == kv_indices.dtype == torch.int32
        assert bool(torch.all((1 <= last_page_len) & (last_page_len <= page_size)))
        assert bool(torch.all(kv_indptr[1:] > kv_indptr[:-1])), "every request has a page"
        _FakePrefillWrapper.plans += 1
        self.qo, self.kv, self.pages = qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.cpu()
        self.last, self.page_size, self.scale = last_page_len.tolist(), page_size, sm_scale
        self.window_left, self.soft_cap = window_left, logits_soft_cap
        self.shape = (num_qo_heads, num_kv_heads, head_dim, q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache, *, out):
        k_cache, v_cache = paged_kv_cache
        assert out.shape == q.shape and q.shape[0] == self.qo[-1]
        assert self.shape == (q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, k_cache.dtype)
        for b in range(len(self.qo) - 1):
            pages = self.pages[self.kv[b] : self.kv[b + 1]]
            kv_len = (len(pages) - 1) * self.page_size + self.last[b]
            k = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
            v = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
            rows = slice(self.qo[b], self.qo[b + 1])
            q_len = self.qo[b + 1] - self.qo[b]
            key_pos, query_pos = torch.arange(kv_len)[None, :], torch.arange(kv_len - q_len, kv_len)[:, None]
            visible = key_pos <= query_pos
            if self.window_left >= 0:  # window_left keys before the query's own
                visible &= key_pos >= query_pos - self.window_left
            group = q.shape[1] // k.shape[0]
            scores = q[rows].transpose(0, 1).float() @ k.float().repeat_interleave(group, 0).transpose(1, 2)
            scores = scores * self.scale
            if self.soft_cap > 0:
                scores = self.soft_cap * torch.tanh(scores / self.soft_cap)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            attn = probs @ v.float().repeat_interleave(group, 0)
            out[rows] = attn.transpose(0, 1).to(out.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The FlashInfer backend module, wired to the fake wrapper with a tiny workspace."""
    from fastsched.attention import flashinfer as flashinfer_backend

    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakePrefillWrapper)
    monkeypatch.setattr(flashinfer_backend, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(_FakePrefillWrapper, "plans", 0)
    return flashinfer_backend


def test_flashinfer_backend_passes_our_page_table_in_flashinfer_form(scenario, close, fake_flashinfer):
    """CPU check of the FlashInfer backend's translation, against a fake with FlashInfer's semantics.

    Two layers share one plan; an empty (padding) request and padding tokens
    are left out of it.
    """
    backend = fake_flashinfer.FlashInferBackend(torch.device("cpu"))
    s = scenario([30, 20, 40, 17], dtype=torch.bfloat16, shared_prefix_blocks=1)
    s.write_context([16, 16, 39, 16])
    spans = [(16, 30), (0, 0), (39, 40), (16, 17)]  # request 1: no tokens this step
    query, key, value, metadata = s.step(spans, num_padding_tokens=2)
    backend.prepare(metadata)
    for _layer in range(2):
        out = backend.forward(query, key, value, s.kv_cache, metadata, s.scale)
    n = sum(e - b for b, e in spans)
    close(out[:n], s.dense_attention(spans, n), torch.bfloat16)
    assert _FakePrefillWrapper.plans == 1 and torch.all(out[n:] == 0)


def test_flashinfer_backend_requires_prepare_for_the_step(scenario, fake_flashinfer):
    backend = fake_flashinfer.FlashInferBackend(torch.device("cpu"))
    s = scenario([5], dtype=torch.float16)
    query, key, value, metadata = s.step([(0, 5)])
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(query, key, value, s.kv_cache, metadata, s.scale)


def _large_step(scenario, dtype: torch.dtype, head_dim: int):
    """A realistic mixed step: long prefill chunks with cached context, many decodes, GQA 4."""
    gen = torch.Generator().manual_seed(head_dim)
    context_lens = [0, 300, 1024, 77] + torch.randint(1, 2000, (28,), generator=gen).tolist()
    query_lens = [512, 200, 96, 33] + [1] * 28
    spans = [(c, c + q) for c, q in zip(context_lens, query_lens)]
    s = scenario([e for _, e in spans], num_heads=32, num_kv_heads=8, head_dim=head_dim, dtype=dtype)
    s.write_context(context_lens)
    return s, spans


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_triton_backend_matches_torch_native_on_cuda(scenario, close, dtype, head_dim):
    s, spans = _large_step(scenario, dtype, head_dim)
    query, key, value, metadata = s.step(spans, num_padding_tokens=5, fused_qkv=True)
    expected = _forward(TorchNativeBackend(), s, query, key, value, metadata)
    out = _forward(TritonBackend(), s, query, key, value, metadata)
    close(out, expected, dtype)


@needs_cuda
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flashinfer_backend_matches_torch_native_on_cuda(scenario, close, dtype):
    s, spans = _large_step(scenario, dtype, 128)
    query, key, value, metadata = s.step(spans, num_padding_tokens=5, fused_qkv=True)
    expected = _forward(TorchNativeBackend(), s, query, key, value, metadata)
    out = _forward(select_backend(torch.device("cuda"), "flashinfer"), s, query, key, value, metadata)
    close(out, expected, dtype)


def _forward(backend, s, query, key, value, metadata: AttentionMetadata) -> torch.Tensor:
    backend.prepare(metadata)
    return backend.forward(query, key, value, s.kv_cache, metadata, s.scale)
