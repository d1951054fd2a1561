"""The CPU backend (the Rust paged-attention kernel, SDPA for long chunks) against the dense
oracle and against the torch backend, and its batch invariance: a request's numbers do not
depend on what shares its step, which greedy speculative decoding's equivalence to plain
greedy decoding needs (tests/engine/test_spec_decode.py).

Tolerances: conftest's TOLERANCES against the fp64 oracle; against the torch backend
fp32 within 2e-6 (both accumulate in fp32, in different orders), bf16 within one bf16
rounding of the output (SDPA rounds its probabilities to bf16 before P·V, the kernel
does not).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import STEPS, _run_step

from fastsched.attention import cpu as cpu_backend
from fastsched.attention.base import AttentionOptions
from fastsched.attention.cpu import CpuBackend
from fastsched.attention.torch_native import TorchNativeBackend
from fastsched.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.AVAILABLE, reason="fastsched._core built without paged_attention")

# decodes, draft verifications (4 rows), prefill chunks with context, a long chunk for SDPA
MIXED = ([37, 0, 15, 64, 3, 100, 16], [1, 1, 4, 1, 13, 260, 16])


def _mixed_step(scenario, dtype, seed=0, **shape):
    context_lens, query_lens = MIXED
    spans = [(c, c + q) for c, q in zip(context_lens, query_lens)]
    s = scenario([e for _, e in spans], dtype=dtype, seed=seed, **shape)
    s.write_context(context_lens)
    return s, spans


def _forward(backend, s, spans, **kwargs):
    query, key, value, metadata = s.step(spans, fused_qkv=True, **kwargs)
    backend.prepare(metadata)
    return backend.forward(query, key, value, s.kv_cache, metadata, s.scale)


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_cpu_backend_matches_dense_attention(scenario, close, name, dtype):
    out, expected, n = _run_step(CpuBackend(), scenario, name, dtype)
    close(out[:n], expected, dtype)


@pytest.mark.parametrize(
    "shape",
    [
        {},
        dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16),
        dict(num_heads=6, num_kv_heads=2, head_dim=40, block_size=8),
    ],
    ids=["gqa2", "smollm2_gqa3", "gqa3_head_dim_40_block_8"],
)
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)], ids=["fp32", "bf16"]
)
def test_cpu_backend_matches_torch_native_on_mixed_rows(scenario, shape, dtype, atol):
    s, spans = _mixed_step(scenario, dtype, **shape)
    expected = _forward(TorchNativeBackend(), s, spans)
    out = _forward(CpuBackend(), s, spans)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_request_gets_the_same_bits_alone_or_sharing_the_step(scenario, dtype):
    """Request 4 (13 rows after 3 cached tokens) alone, then beside decodes, verifications
    and prefills: its rows are bit-identical."""
    s, spans = _mixed_step(scenario, dtype, num_heads=9, num_kv_heads=3, head_dim=64)
    shared = _forward(CpuBackend(), s, spans)
    start = sum(e - b for b, e in spans[:4])
    alone_spans = [(b, b) for b, _ in spans[:4]] + [spans[4]] + [(b, b) for b, _ in spans[5:]]
    alone = _forward(CpuBackend(), s, alone_spans)
    assert torch.equal(alone, shared[start : start + 13])


def test_a_verification_row_equals_the_decode_at_its_position(scenario):
    """Verifying 4 drafts then decoding: the row at position p has the same bits either way."""
    s = scenario([20], num_heads=9, num_kv_heads=3, head_dim=64)
    s.write_context([16])
    verify = _forward(CpuBackend(), s, [(16, 20)])
    decode = _forward(CpuBackend(), s, [(17, 18)])
    assert torch.equal(decode[0], verify[1])


def test_long_chunks_go_to_sdpa_and_short_ones_to_the_kernel(scenario, close, monkeypatch):
    """The split depends only on a request's own query length."""
    s, spans = _mixed_step(scenario, torch.float32)
    query, key, value, metadata = s.step(spans)
    plan = cpu_backend._plan_step(metadata, s.block_size, sdpa=True)
    assert [p.end - p.start for p in plan.prefills] == [260]
    assert plan.step[4].tolist() == [0, 1, 2, 3, 4, 6]
    plan = cpu_backend._plan_step(metadata, s.block_size, sdpa=False)  # a windowed or soft-capped layer's
    assert plan.prefills == [] and plan.step[4].tolist() == list(range(7))
    monkeypatch.setattr(cpu_backend, "SDPA_MIN_QUERY_LEN", 1 << 20)  # everything through the kernel
    out = _forward(CpuBackend(), s, spans)
    n = sum(e - b for b, e in spans)
    close(out, s.dense_attention(spans, n), torch.float32)


def test_padding_tokens_write_nothing_and_get_zero_rows(scenario, close):
    out, expected, n = _run_step(CpuBackend(), scenario, "mixed_batch", torch.float32, num_padding_tokens=3)
    close(out[:n], expected, torch.float32)
    assert out.shape[0] == n + 3 and torch.all(out[n:] == 0)


def test_chunked_prefill_reads_what_earlier_steps_wrote(scenario, close):
    backend = CpuBackend()
    s = scenario([40, 9], dtype=torch.bfloat16)
    for spans in ([(0, 23), (0, 8)], [(23, 40), (8, 9)]):
        out = _forward(backend, s, spans)
        close(out, s.dense_attention(spans, out.shape[0]), torch.bfloat16)


def test_the_binding_names_a_bad_block_id(scenario):
    s = scenario([20])
    query, key, value, metadata = s.step([(0, 20)])
    metadata.block_tables = metadata.block_tables.clone()
    metadata.block_tables[0, 0] = s.kv_cache.shape[1]
    with pytest.raises(ValueError, match="block_tables holds"):
        CpuBackend().forward(query, key, value, s.kv_cache, metadata, s.scale)


def _dense_attention(s, spans, options: AttentionOptions) -> torch.Tensor:
    """The fp64 oracle with a sliding window (keys in (p - window, p]) and soft-capped scores."""
    group = s.num_heads // s.num_kv_heads
    rows = []
    for i, (start, end) in enumerate(spans):
        q = s.queries[i][start:end].double()
        k = s.keys[i][:end].double().repeat_interleave(group, dim=1)
        v = s.values[i][:end].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * s.scale
        if options.logits_soft_cap is not None:
            scores = options.logits_soft_cap * torch.tanh(scores / options.logits_soft_cap)
        pos, key = torch.arange(start, end)[:, None], torch.arange(end)[None, :]
        visible = key <= pos
        if options.sliding_window is not None:
            visible &= key > pos - options.sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        rows.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(rows)


@pytest.mark.parametrize(
    "options",
    [
        AttentionOptions(sliding_window=1),
        AttentionOptions(sliding_window=20),
        AttentionOptions(logits_soft_cap=0.5),
        AttentionOptions(sliding_window=7, logits_soft_cap=2.0),
    ],
    ids=["window_1", "window_20", "softcap", "window_and_softcap"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_sliding_window_and_a_soft_cap_match_the_oracle(scenario, close, options, dtype):
    """Decodes, verifications, chunks with context and the long chunk (on the kernel too)."""
    s, spans = _mixed_step(scenario, dtype, num_heads=6, num_kv_heads=2, head_dim=40, block_size=8)
    query, key, value, metadata = s.step(spans, fused_qkv=True)
    backend = CpuBackend()
    backend.prepare(metadata)
    out = backend.forward(
        query, key, value, s.kv_cache, metadata, s.scale, options.sliding_window, options.logits_soft_cap
    )
    close(out, _dense_attention(s, spans, options), dtype)


def test_a_window_covering_every_key_gives_plain_attentions_bits(scenario):
    s, spans = _mixed_step(scenario, torch.bfloat16)
    backend = CpuBackend()
    query, key, value, metadata = s.step(spans, fused_qkv=True)
    backend.prepare(metadata)
    wide = backend.forward(query, key, value, s.kv_cache, metadata, s.scale, sliding_window=1 << 20)
    plain = _forward(CpuBackend(), s, spans)
    short = slice(0, sum(e - b for b, e in spans[:5]))  # the rows before the long (SDPA) chunk
    assert torch.equal(wide[short], plain[short])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"logits_soft_cap": 0.0}, "logits_soft_cap"),
        ({"logits_soft_cap": float("inf")}, "logits_soft_cap"),
    ],
)
def test_attention_options_refuse_what_cannot_work(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AttentionOptions(**kwargs)
