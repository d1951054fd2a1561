"""``--quantization int8`` / ``fp8``: a dense checkpoint's projections quantized at load to
one scale per output channel (``models/channel_quant_linear.py``, issue 23)."""

from __future__ import annotations

import pytest
import torch
from test_models import SingleRequestRunner  # tests/models, on the path as the tests' own directory

from fastsched.config import EngineConfig
from fastsched.model_loader.weights import load_model
from fastsched.models.channel_quant_linear import ChannelQuantLinear, quantize_per_channel
from fastsched.models.quant_linear import copy_weights

KINDS = ("int8", "fp8")


def test_int8_codes_are_within_half_a_step_of_the_weight() -> None:
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize_per_channel(w, "int8")
    assert codes.dtype == torch.int8 and scale.shape == (48,)
    assert codes.abs().amax(1).eq(127).all()  # each row's largest weight is ±127 steps
    assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_fp8_codes_keep_three_mantissa_bits() -> None:
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    codes, scale = quantize_per_channel(w, "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    back = codes.float() * scale[:, None]
    normal = w.abs() / scale[:, None] >= 2.0**-6  # e4m3's smallest normal; below it steps are absolute
    assert ((back - w).abs()[normal] <= 2.0**-4 * w.abs()[normal] + 1e-7).all()
    assert ((back - w).abs()[~normal] <= 2.0**-10 * scale.expand_as(w.t()).t()[~normal]).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_computes_with_its_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(64, 80, bias=True, dtype=dtype)  # a model in ``dtype``
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 64, generator=g))
        linear.bias.copy_(torch.randn(80, generator=g))
    layer = ChannelQuantLinear(linear, kind)
    # On CPU torch's int8 kernel serves bf16 models only (its fp32 path is not vectorised).
    assert layer.kernel == ("int8pack" if kind == "int8" and dtype == torch.bfloat16 else "upcast")
    x = torch.randn(2, 5, 64, generator=g)
    expected = x @ layer.dequantize().t() + linear.bias.float()
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(
        layer(x.to(dtype)).float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_dense_checkpoint_quantized_at_load_stays_close_to_its_fp32_logits(
    tiny_model_dir, kind: str
) -> None:
    """Bound checked: the logits of a 35-token prompt keep a correlation above 0.9995 (int8)
    / 0.998 (fp8) with the fp32 model's, and the greedy (argmax) token agrees at ≥ 90 % of the
    positions (random tiny weights have near-ties, so not at all of them)."""
    dense = load_model(tiny_model_dir)
    quantized = load_model(tiny_model_dir, quantization=kind)
    layers = [m for m in quantized.modules() if isinstance(m, ChannelQuantLinear)]
    assert len(layers) == 4 * quantized.config.num_layers and all(m.kind == kind for m in layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.layers.modules())
    ids = list(range(5, 40))
    ours, reference = SingleRequestRunner(quantized, 64).step(ids), SingleRequestRunner(dense, 64).step(ids)
    correlation = torch.corrcoef(torch.stack([ours.flatten(), reference.flatten()]))[0, 1]
    assert correlation > {"int8": 0.9995, "fp8": 0.998}[kind]
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_a_reload_copies_the_codes_and_scales(tiny_model_dir, tmp_path) -> None:
    """Weight reloads go through the state dict: the 8-bit buffers travel with it."""
    served = load_model(tiny_model_dir, quantization="int8")
    layer = served.layers[0].mlp.down_proj
    layer.codes.zero_()
    copy_weights(served, load_model(tiny_model_dir, quantization="int8"))
    assert layer.codes.abs().amax() == 127


@pytest.mark.parametrize("kind", ["int4", *KINDS])
def test_quantizing_at_load_refuses_a_gguf_naming_the_flag(kind: str) -> None:
    with pytest.raises(ValueError, match=f"--quantization {kind} quantizes a dense checkpoint"):
        EngineConfig(quantization=kind)  # the embedded model is a .gguf
    with pytest.raises(ValueError, match=f"quantization '{kind}' quantizes a dense checkpoint"):
        load_model(None, quantization=kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_on_cuda_the_layer_computes_with_its_dequantized_weight(kind: str) -> None:
    """fp8 on sm89+: ``_scaled_mm`` with activations quantized per token (their own 2⁻⁴)."""
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(128, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(256, 128, generator=g))
    layer = ChannelQuantLinear(linear, kind)
    x = torch.randn(7, 128, generator=g).cuda()
    expected = x @ layer.dequantize().t()
    tolerance = 2**-6 if layer.kernel == "upcast" else 2**-3
    torch.testing.assert_close(
        layer(x.bfloat16()).float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
    )
