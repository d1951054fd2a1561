"""The CPU decoder stack's Gemma-style per-layer options (fastsched.models.llama_cpu's
StackLayer): float32 ``1 + w`` norms, per-head q/k norms, norms on the attention's and the
MLP's outputs, GeGLU-tanh, a sliding-window layer on its own RoPE table and a soft-capped
layer with a non-default scale, against a float64 torch model written from the definition,
over prefill, chunked prefill and decode steps on one cache.

Bound: a row's relative L2 error after two layers of bfloat16 (and int8 activation)
roundings, as in the crate's decoder tests; the same stack output is also checked to be far
from the reference with the window or the soft-cap left out, so the bound cannot pass a
stack that ignores them.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastsched.attention.base import AttentionMetadata, AttentionOptions
from fastsched.attention.cpu import CpuBackend
from fastsched.kernels import quant_matmul_cpu
from fastsched.kernels.quant_matmul import Int4Weight
from fastsched.models.llama_cpu import CpuDecoderStack, StackLayer, layers_unsupported_reason
from fastsched.models.quant_linear import QuantLinear

pytestmark = pytest.mark.skipif(not quant_matmul_cpu.GEMM_SIMD, reason="the stack needs AVX-512 BF16")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
EPS, SCALE, BLOCK_SIZE, BOUND = 1e-6, 0.2, 4, 0.05
# per layer: attention options, RoPE table
OPTIONS = [(AttentionOptions(sliding_window=3), 1), (AttentionOptions(logits_soft_cap=1.5), 0)]
BASES = (10000.0, 10.0)


def _model(seed: int) -> tuple[list[StackLayer], torch.Tensor, list[list[torch.Tensor]]]:
    """Two layers of int4 projections and float32 norms; also the dequantized weights."""
    gen = torch.Generator().manual_seed(seed)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.3 * torch.rand(n, generator=gen)

    layers, dense = [], []
    for options, table in OPTIONS:
        shapes = [
            ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            (HIDDEN, HEADS * HEAD_DIM),
            (2 * INTER, HIDDEN),
            (HIDDEN, INTER),
        ]
        weights = [Int4Weight.quantize(torch.randn(n, k, generator=gen) / k**0.5) for n, k in shapes]
        dense.append([w.dequantize(torch.float64) for w in weights])
        layers.append(
            StackLayer(
                input_norm=norm(HIDDEN),
                post_norm=norm(HIDDEN),
                projections=tuple(QuantLinear(w, None, torch.device("cpu")) for w in weights),  # type: ignore
                scale=SCALE,
                q_norm=norm(HEAD_DIM),
                k_norm=norm(HEAD_DIM),
                attn_out_norm=norm(HIDDEN),
                mlp_out_norm=norm(HIDDEN),
                activation="gelu_tanh",
                attention=options,
                rope_table=table,
            )
        )
    return layers, norm(HIDDEN), dense


def _stack(layers: list[StackLayer], final_norm: torch.Tensor) -> CpuDecoderStack:
    return CpuDecoderStack(layers, final_norm, EPS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def _tables(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """bfloat16 ``[length, head_dim]`` cos/sin tables (``cat(freqs, freqs)``) per RoPE base."""
    tables = []
    for base in BASES:
        inv_freq = base ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        freqs = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        tables.append((emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)))
    return tables


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = HEAD_DIM // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


def _reference(layers, final_norm, dense, tables, embedded: torch.Tensor, drop: str = "") -> torch.Tensor:
    """One request's tokens (positions 0..) through the layers in float64; ``drop`` leaves
    out "sliding_window" or "logits_soft_cap"."""
    h = embedded.double()
    n = h.shape[0]
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer, (wqkv, wo, wgu, wd) in zip(layers, dense):
        qkv = _rms(h, layer.input_norm) @ wqkv.T
        q = _rms(qkv[:, :q_size].view(n, HEADS, HEAD_DIM), layer.q_norm)
        k = _rms(qkv[:, q_size : q_size + kv_size].view(n, KV_HEADS, HEAD_DIM), layer.k_norm)
        v = qkv[:, q_size + kv_size :].view(n, KV_HEADS, HEAD_DIM)
        cos, sin = (t[:n].double() for t in tables[layer.rope_table])
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
        cap, window = layer.attention.logits_soft_cap, layer.attention.sliding_window
        if cap is not None and drop != "logits_soft_cap":
            scores = cap * torch.tanh(scores / cap)
        pos, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = key <= pos
        if window is not None and drop != "sliding_window":
            visible &= key > pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, q_size)
        h = h + _rms(attn @ wo.T, layer.attn_out_norm)
        gate, up = (_rms(h, layer.post_norm) @ wgu.T).split(INTER, dim=-1)
        gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
        h = h + _rms((gelu * up) @ wd.T, layer.mlp_out_norm)
    return _rms(h, final_norm)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.double() - want).norm(dim=-1) / want.norm(dim=-1)


def test_gemma_style_options_match_a_float64_reference_over_steps() -> None:
    layers, final_norm, dense = _model(0)
    assert layers_unsupported_reason(layers, final_norm) is None
    stack = _stack(layers, final_norm)
    embedded = (torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    caches = [torch.zeros(2, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in layers]
    tables = _tables(32)
    # request i owns blocks 1 + 4i ..; steps of (cached, query rows) per request: a prefill and
    # a shorter one, a chunk next to a decode, then two decodes
    steps = [[(0, 7), (0, 3)], [(7, 4), (3, 1)], [(11, 1), (4, 1)]]
    got = {0: [], 1: []}
    for step in steps:
        slots, positions, qsl, seq_lens = [], [], [0], []
        for i, (cached, rows) in enumerate(step):
            for p in range(cached, cached + rows):
                slots.append((1 + 4 * i + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE)
                positions.append(p)
            qsl.append(qsl[-1] + rows)
            seq_lens.append(cached + rows)
        int32 = torch.int32
        metadata = AttentionMetadata(
            torch.tensor(slots),
            torch.tensor(qsl, dtype=int32),
            torch.tensor(seq_lens, dtype=int32),
            torch.tensor([list(range(1 + 4 * i, 5 + 4 * i)) for i in range(2)], dtype=int32),
            max(r for _, r in step),
            max(seq_lens),
        )
        backend = CpuBackend()
        backend.prepare(metadata)
        kernel_step = backend.kernel_step(metadata, BLOCK_SIZE)
        assert kernel_step is not None
        hidden = torch.cat([embedded[i, c : c + r] for i, (c, r) in enumerate(step)])
        out = stack.forward(hidden, torch.tensor(positions), tables, caches, *kernel_step)
        for i, part in enumerate(out.split([r for _, r in step])):
            got[i].append(part)
    for i in range(2):
        rows = torch.cat(got[i])
        want = _reference(layers, final_norm, dense, tables, embedded[i, : rows.shape[0]])
        assert float(_rel_error(rows, want).max()) <= BOUND, f"request {i}"
        for drop in ("sliding_window", "logits_soft_cap"):
            without = _reference(layers, final_norm, dense, tables, embedded[i, : rows.shape[0]], drop)
            assert float(_rel_error(rows, without).max()) > 2 * BOUND, f"request {i}: {drop} changes nothing"


def test_mixed_norm_dtypes_and_an_unknown_activation_are_refused() -> None:
    layers, final_norm, _ = _model(1)
    assert "all bfloat16 or all float32" in layers_unsupported_reason(layers, final_norm.to(torch.bfloat16))
    layers[1].activation = "relu"
    with pytest.raises(ValueError, match="layer 1: activation"):
        _stack(layers, final_norm)
