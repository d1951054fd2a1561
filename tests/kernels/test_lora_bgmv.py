"""The Triton BGMV kernel against the torch formulation (CPU: Triton's interpreter,
switched on by this folder's conftest before the kernel is imported)."""

from __future__ import annotations

import pytest
import torch

from fastsched.lora.punica import bgmv_dense
from fastsched.lora.triton_bgmv import bgmv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (atol relative to the output's scale, rtol) against an fp32 computation of the same inputs.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "out_features", "rank"), [(64, 96, 8), (100, 70, 12)])
def test_bgmv_triton_adds_each_tokens_own_slot_and_skips_the_base_model(
    dtype: torch.dtype, in_features: int, out_features: int, rank: int
) -> None:
    g = torch.Generator().manual_seed(0)
    num_slots = 3
    a = torch.randn(in_features, num_slots * rank, generator=g).to(DEVICE, dtype)
    b = torch.randn(num_slots * rank, out_features, generator=g).to(DEVICE, dtype)
    x = torch.randn(9, in_features, generator=g).to(DEVICE, dtype)
    base = torch.randn(9, out_features, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([0, 2, -1, 1, 1, -1, 2, 0, 0], device=DEVICE)
    mask = torch.zeros(9, num_slots * rank, device=DEVICE, dtype=dtype)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            mask[t, s * rank : (s + 1) * rank] = 1
    expected = base.float().clone()
    bgmv_dense(x.float(), a.float(), b.float(), mask.float(), expected)
    out = base.clone()
    bgmv_triton(x, a, b, rank, slots, out)
    atol, rtol = TOLERANCES[dtype]
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=atol * scale, rtol=rtol)
    assert torch.equal(out[slots < 0], base[slots < 0]), "base-model rows are not written"


def test_a_step_planned_for_the_triton_kernel_adds_what_the_torch_one_does(tmp_path) -> None:
    """The manager's wiring (plan -> activate -> LayerLoRA.add) with either kernel, on a
    mix of two adapters and the base model."""
    import numpy as np

    from fastsched.lora import LoRARequest
    from fastsched.lora.slots import LoRAManager
    from fastsched.model_loader import load_model_config
    from fastsched.tools.tiny_lora import make_tiny_lora
    from fastsched.tools.tiny_model import make_tiny_model

    base = make_tiny_model(tmp_path / "model", vocab_size=300)
    config = load_model_config(base)
    requests = [
        LoRARequest(f"a{i}", i, str(make_tiny_lora(base, tmp_path / f"a{i}", rank=2 * i, seed=i)))
        for i in (1, 2)
    ]
    g = torch.Generator().manual_seed(0)
    x = {
        "qkv_proj": torch.randn(5, config.hidden_size, generator=g),
        "down_proj": torch.randn(5, config.intermediate_size, generator=g),
    }
    results = []
    for kernel in ("torch", "triton"):
        manager = LoRAManager(
            config,
            max_loras=2,
            max_lora_rank=4,
            max_cpu_loras=2,
            device=torch.device(DEVICE),
            dtype=torch.float32,
            kernel=kernel,
        )
        for r in requests:
            manager.register(r)
        mapping = manager.plan(np.array([2, 0, 1]), np.array([2, 1, 2]))
        layer = manager.activate(mapping).layer(1)
        outs = {}
        for projection, width in (("qkv_proj", 2 * config.num_kv_heads + config.num_heads), ("down_proj", 0)):
            out_features = config.hidden_size if projection == "down_proj" else width * config.head_dim
            outs[projection] = torch.zeros(5, out_features, device=DEVICE)
            layer.add(projection, x[projection].to(DEVICE), outs[projection])
        results.append(outs)
    for projection in x:
        torch.testing.assert_close(results[1][projection], results[0][projection], atol=1e-4, rtol=1e-4)
        assert torch.count_nonzero(results[0][projection][2]) == 0, "the base-model token gets no delta"
