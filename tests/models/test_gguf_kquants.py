"""GGUF block formats read as codes and per-group parameters (``model_loader/gguf_kquants.py``,
``gguf_quants.int4_blocks`` / ``int8_blocks``) against the ``gguf`` package's own
``gguf.quants.dequantize``, on small GGUF files written here with the ``gguf`` writer; and a
tiny Llama GGUF whose projections are Q4_K, served 4-bit (issue 23)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as gguf_quantize

from fastsched.model_loader.gguf_container import GGUFContainer
from fastsched.model_loader.gguf_quants import int4_blocks, int8_blocks
from fastsched.model_loader.weights import load_model
from fastsched.models.quant_linear import QuantLinear

Q = GGMLQuantizationType
# Byte offsets of each block's fp16 parameters, for blocks made from random bytes (the
# K-quants, which gguf can only dequantize).
FP16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Formats gguf.quants can quantize: their blocks come from random floats.
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def _random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, bytes a row]`` of valid ``qtype`` blocks."""
    if qtype in QUANTIZABLE:
        return gguf_quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for at in FP16_AT[qtype]:  # finite, positive scales of a realistic size
        blocks[:, at:at + 2] = rng.uniform(1e-3, 0.1, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _paired_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks whose 16-weight sub-blocks share their scale in pairs (groups of 32 exist)."""
    scales = blocks.reshape(-1, 210)[:, 192:208].copy()
    scales[:, 1::2] = scales[:, 0::2]
    out = blocks.reshape(-1, 210).copy()
    out[:, 192:208] = scales
    return out.reshape(blocks.shape)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]], arch: str = "llama",
           metadata: dict | None = None) -> Path:
    writer = GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _expected(tensor) -> np.ndarray:
    return np.asarray(reference_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(tensor.shape)


def _groups(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, centre: int) -> np.ndarray:
    rows, cols = codes.shape
    q = codes.reshape(rows, cols // 32, 32).astype(np.float32) - centre
    w = q * scale[..., None] + (0 if zero is None else zero[..., None])
    return w.reshape(rows, cols)


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory: pytest.TempPathFactory) -> dict:
    rng = np.random.default_rng(23)
    rows, cols = 6, 512
    tensors = {t.name: (_random_blocks(t, rows, cols, rng), t) for t in (*QUANTIZABLE, Q.Q4_K, Q.Q5_K, Q.Q6_K)}
    tensors["Q6_K_paired"] = (_paired_q6_k(tensors["Q6_K"][0]), Q.Q6_K)
    path = _write(tmp_path_factory.mktemp("kquants") / "blocks.gguf", tensors)
    return {t.name: t for t in GGUFContainer(path).tensors}


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_formats_convert_to_the_int4_form_of_the_same_weights(blocks_file, name) -> None:
    tensor = blocks_file[name]
    converted = int4_blocks(tensor)
    assert converted is not None and converted.codes.dtype == np.uint8 and converted.codes.max() <= 15
    assert converted.scale.shape == (6, 512 // 32)
    # scale = d·sc is exact in float32; zero subtracts two exact products and may round once.
    np.testing.assert_allclose(_groups(*converted, centre=8), _expected(tensor), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q5_K", "Q6_K_paired", "Q8_0"])
def test_5_6_8_bit_formats_convert_to_the_int8_form_of_the_same_weights(blocks_file, name) -> None:
    tensor = blocks_file[name]
    converted = int8_blocks(tensor)
    assert converted is not None and converted.codes.dtype == np.int8
    assert converted.scale.shape == (6, 512 // 32)
    has_zero = name in ("Q5_1", "Q5_K")
    assert (converted.zero is not None) == has_zero
    ours = _groups(*converted, centre=0)
    if has_zero:
        np.testing.assert_allclose(ours, _expected(tensor), rtol=1e-6, atol=1e-6)
    else:  # w = scale·c: one exact product, gguf's own arithmetic
        np.testing.assert_array_equal(ours, _expected(tensor))


def test_q6_k_with_unpaired_sub_block_scales_is_left_to_dequantization(blocks_file) -> None:
    assert int8_blocks(blocks_file["Q6_K"]) is None
    assert int4_blocks(blocks_file["Q5_K"]) is None and int8_blocks(blocks_file["Q4_K"]) is None


def test_a_llama_gguf_with_q4_k_projections_is_served_4bit_close_to_its_dequantized_weights(tmp_path) -> None:
    """Every projection Q4_K (K = 256, one super-block a row): the loader keeps all four per
    layer 4-bit, and the logits match the same file dequantized to float32 up to the int4
    kernel's bf16 arithmetic."""
    rng = np.random.default_rng(4)
    hidden, inter, vocab, heads = 256, 512, 96, 4

    def dense(rows: int, cols: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, Q.F32)

    def q4_k(rows: int, cols: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return (_random_blocks(Q.Q4_K, rows, cols, rng), Q.Q4_K)

    tensors = {"token_embd.weight": dense(vocab, hidden), "output_norm.weight": (np.ones(hidden, np.float32), Q.F32)}
    for layer in range(2):
        blk = f"blk.{layer}."
        tensors |= {
            blk + "attn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
            blk + "ffn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
            blk + "attn_q.weight": q4_k(hidden, hidden), blk + "attn_k.weight": q4_k(hidden // 2, hidden),
            blk + "attn_v.weight": q4_k(hidden // 2, hidden), blk + "attn_output.weight": q4_k(hidden, hidden),
            blk + "ffn_gate.weight": q4_k(inter, hidden), blk + "ffn_up.weight": q4_k(inter, hidden),
            blk + "ffn_down.weight": q4_k(hidden, inter),
        }
    metadata = {"llama.embedding_length": hidden, "llama.feed_forward_length": inter, "llama.block_count": 2,
                "llama.attention.head_count": heads, "llama.attention.head_count_kv": heads // 2,
                "llama.vocab_size": vocab, "llama.context_length": 128,
                "llama.attention.layer_norm_rms_epsilon": 1e-5}
    path = _write(tmp_path / "tiny-q4_k.gguf", tensors, metadata=metadata)

    kept = load_model(path, quantization="gguf", dtype=torch.float32)
    reference = load_model(path, quantization="none", dtype=torch.float32)
    assert sum(isinstance(m, QuantLinear) for m in kept.modules()) == 4 * 2
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        packed = kept.layers[1].get_submodule(name)
        expected = reference.layers[1].get_submodule(name).weight
        # x = I reads the packed weight back: the file's weight up to bf16 scale/zero and output
        # rounding (2⁻⁸ relative to the terms, which may cancel: bounded by the largest weight).
        got = packed(torch.eye(packed.in_features)).t()
        torch.testing.assert_close(got, expected, rtol=0, atol=2**-7 * expected.abs().max().item())
