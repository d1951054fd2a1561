"""The Rust elementwise kernels (fastsched-kernels' elementwise.rs) against the torch ops of
``fastsched.models.llama`` they replace on the CPU, and against transformers' Gemma RMSNorm
and torch's tanh GELU for the Gemma ones.

RoPE must give the same bits in float32 and bfloat16 (it runs in the fp32 parity path).
RMSNorm, SiLU·up and GELU-tanh·up are bfloat16 only; their float32 mean of squares, exp and
tanh may differ in the last float32 bit, so a bf16 result may sit one bf16 step away, rarely:
tolerated at one bf16 ulp on at most 1 % of elements. The residual add must be exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastsched.kernels import cpu_ops
from fastsched.models.config import ModelConfig
from fastsched.models.llama import RMSNorm, RotaryEmbedding, apply_rope

pytestmark = pytest.mark.skipif(not cpu_ops.AVAILABLE, reason="fastsched._core built without the CPU kernels")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (same-sign values; enough for these checks)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_kernel_gives_apply_ropes_bits_from_a_grown_table(dtype):
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    )
    rotary = RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (9 + 2 * 3) * 64, generator=gen).to(dtype)
    for positions in (
        torch.tensor([0, 1, 2, 3, 100, 1023, 5]),
        torch.tensor([4000, 7, 2047, 1, 3999, 0, 64]),
    ):
        rope = rotary.table(positions, dtype)  # the second set grows the table past 1024
        assert rope.cos.shape[0] > int(positions.max())
        cos, sin = rotary(positions, dtype)
        q, k = qkv[:, : 9 * 64].view(7, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(7, 3, 64)
        want_q, want_k, want_v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), qkv[:, 12 * 64 :].clone()
        got = qkv.clone()
        cpu_ops.rope_(got, 12, 64, rope.positions, rope.cos, rope.sin)
        assert torch.equal(got[:, : 9 * 64], want_q.flatten(1))
        assert torch.equal(got[:, 9 * 64 : 12 * 64], want_k.flatten(1))
        assert torch.equal(got[:, 12 * 64 :], want_v)  # v untouched


def test_add_rms_norm_matches_the_residual_add_and_rmsnorm():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(576, generator=gen) * 2).to(torch.bfloat16)
    hidden = (torch.randn(33, 576, generator=gen) * 3).to(torch.bfloat16)
    delta = torch.randn(33, 576, generator=gen).to(torch.bfloat16)
    want_hidden = hidden + delta
    want = norm(want_hidden)
    got = cpu_ops.add_rms_norm(hidden, delta, norm.weight.data, norm.eps)
    assert torch.equal(hidden, want_hidden)
    apart = _ulps_apart(got, want)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01


def test_rms_norm_without_delta_leaves_the_stream_alone():
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    before = hidden.clone()
    out = cpu_ops.add_rms_norm(hidden, None, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(hidden, before)
    apart = _ulps_apart(out, RMSNorm(64, 1e-6).to(torch.bfloat16)(hidden))
    assert int(apart.max()) <= 1


def test_silu_mul_matches_torch_within_one_bf16_step():
    gate_up = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    gate, up = gate_up.split(1536, dim=-1)
    want = F.silu(gate) * up
    got = cpu_ops.silu_mul(gate_up)
    apart = _ulps_apart(got, want)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01


def test_kernels_name_a_bad_argument():
    with pytest.raises(TypeError, match="hidden must be bfloat16; got float32"):
        cpu_ops.add_rms_norm(torch.zeros(2, 8), None, torch.ones(8), 1e-6)
    table = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="positions holds 9"):
        cpu_ops.rope_(torch.zeros(1, 8), 1, 8, torch.tensor([9]), table, table)


def _gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: float32 throughout, ``1 + w``, one rounding."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def test_a_float32_weight_norms_as_gemma_with_one_rounding():
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(640, generator=gen) * 0.5).to(torch.bfloat16)  # the checkpoint's w
    hidden = (torch.randn(17, 640, generator=gen) * 3).to(torch.bfloat16)
    got = cpu_ops.add_rms_norm(hidden, None, 1.0 + weight.float(), 1e-6)
    apart = _ulps_apart(got, _gemma_rms_norm(hidden, weight, 1e-6))
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01
    # and not Llama's double rounding: that one differs on many elements
    llama = cpu_ops.add_rms_norm(hidden, None, (1.0 + weight.float()).to(torch.bfloat16), 1e-6)
    assert float((_ulps_apart(llama, got) > 0).float().mean()) > 0.05


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3_bf16_weight", "gemma_f32_weight"])
def test_head_norms_norm_each_head_of_q_or_k_in_place(gemma):
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = (torch.randn(9, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(torch.bfloat16)
    w = (torch.rand(head_dim, generator=gen) + 0.5).to(torch.bfloat16)
    weight = 1.0 + w.float() if gemma else w
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(9, kv_heads, head_dim)
    if gemma:
        want_k = _gemma_rms_norm(k, w, 1e-6)
    else:
        norm = RMSNorm(head_dim, 1e-6).to(torch.bfloat16)
        norm.weight.data = w
        want_k = norm(k)
    got = qkv.clone()
    cpu_ops.rms_norm_heads_(got[:, heads * head_dim :], kv_heads, weight, 1e-6)
    apart = _ulps_apart(got[:, heads * head_dim : (heads + kv_heads) * head_dim], want_k.flatten(1))
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01
    k_cols = slice(heads * head_dim, (heads + kv_heads) * head_dim)
    got[:, k_cols] = qkv[:, k_cols]
    assert torch.equal(got, qkv)  # q and v untouched


def test_gelu_tanh_mul_matches_torch_within_one_bf16_step():
    gate_up = (torch.randn(9, 2 * 2048, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    gate, up = gate_up.split(2048, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = cpu_ops.gelu_tanh_mul(gate_up)
    apart = _ulps_apart(got, want)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.01
