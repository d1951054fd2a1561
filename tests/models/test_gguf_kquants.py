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

from fastsched.kernels import quant_matmul_cpu
from fastsched.kernels.quant_matmul import PackedInt4, PackedInt8, dequantize_int8
from fastsched.model_loader.gguf_container import GGUFContainer
from fastsched.model_loader.gguf_quants import int4_blocks, int8_blocks
from fastsched.model_loader.weights import load_model
from fastsched.models.quant_linear import QuantEmbedding, QuantLinear

Q = GGMLQuantizationType
# Byte offsets of each block's fp16 parameters, for blocks made from random bytes (the
# K-quants, which gguf can only dequantize).
FP16_AT = {Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Formats gguf.quants can quantize: their blocks come from random floats.
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def _random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, bytes a row]`` of valid ``qtype`` blocks."""
    if qtype in QUANTIZABLE:
        return gguf_quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for at in FP16_AT[qtype]:  # finite, positive scales of a realistic size
        blocks[:, at : at + 2] = (
            rng.uniform(1e-3, 0.1, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
        )
    return blocks.reshape(rows, -1)


def _paired_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks whose 16-weight sub-blocks share their scale in pairs (groups of 32 exist)."""
    scales = blocks.reshape(-1, 210)[:, 192:208].copy()
    scales[:, 1::2] = scales[:, 0::2]
    out = blocks.reshape(-1, 210).copy()
    out[:, 192:208] = scales
    return out.reshape(blocks.shape)


def _write(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
    arch: str = "llama",
    metadata: dict | None = None,
) -> Path:
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
    return np.asarray(reference_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(
        tensor.shape
    )


def _groups(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, centre: int) -> np.ndarray:
    """``scale · (q − centre) + zero``, a scale per ``cols / scale.shape[1]`` columns, a zero per 32."""
    rows, cols = codes.shape
    q = codes.reshape(rows, scale.shape[1], -1).astype(np.float32) - centre
    w = (q * scale[..., None]).reshape(rows, cols // 32, 32) + (0 if zero is None else zero[..., None])
    return w.reshape(rows, cols)


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory: pytest.TempPathFactory) -> dict:
    rng = np.random.default_rng(23)
    rows, cols = 6, 512
    tensors = {
        t.name: (_random_blocks(t, rows, cols, rng), t) for t in (*QUANTIZABLE, Q.Q4_K, Q.Q5_K, Q.Q6_K)
    }
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


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q6_K_paired", "Q8_0"])
def test_5_6_8_bit_formats_convert_to_the_int8_form_of_the_same_weights(blocks_file, name) -> None:
    tensor = blocks_file[name]
    converted = int8_blocks(tensor)
    assert converted is not None and converted.codes.dtype == np.int8
    # Q6_K: a scale d·s per sub-block of 16, whether or not neighbours share it
    assert converted.scale.shape == (6, 512 // (16 if name.startswith("Q6_K") else 32))
    has_zero = name in ("Q5_1", "Q5_K")
    assert (converted.zero is not None) == has_zero
    ours = _groups(*converted, centre=0)
    if has_zero:
        np.testing.assert_allclose(ours, _expected(tensor), rtol=1e-6, atol=1e-6)
    else:  # w = scale·c: one exact product, gguf's own arithmetic
        np.testing.assert_array_equal(ours, _expected(tensor))


def test_each_format_converts_to_one_width_only(blocks_file) -> None:
    assert int4_blocks(blocks_file["Q5_K"]) is None and int8_blocks(blocks_file["Q4_K"]) is None
    assert int4_blocks(blocks_file["Q6_K"]) is None


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

    tensors = {
        "token_embd.weight": dense(vocab, hidden),
        "output_norm.weight": (np.ones(hidden, np.float32), Q.F32),
    }
    for layer in range(2):
        blk = f"blk.{layer}."
        tensors |= {
            blk + "attn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
            blk + "ffn_norm.weight": (np.ones(hidden, np.float32), Q.F32),
            blk + "attn_q.weight": q4_k(hidden, hidden),
            blk + "attn_k.weight": q4_k(hidden // 2, hidden),
            blk + "attn_v.weight": q4_k(hidden // 2, hidden),
            blk + "attn_output.weight": q4_k(hidden, hidden),
            blk + "ffn_gate.weight": q4_k(inter, hidden),
            blk + "ffn_up.weight": q4_k(inter, hidden),
            blk + "ffn_down.weight": q4_k(hidden, inter),
        }
    metadata = {
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": inter,
        "llama.block_count": 2,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": heads // 2,
        "llama.vocab_size": vocab,
        "llama.context_length": 128,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
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


# ---- A tiny Llama whose projections differ in format within a layer (issue 34) ----

HIDDEN, INTER, VOCAB, HEADS = 256, 512, 96, 4
PROJECTION_SIZE = 0.0125  # the largest projection weight: a model whose errors stay small
# The largest code a format's fp16 scale multiplies, for K-quant blocks of sane magnitude.
_K_CODE_RANGE = {Q.Q4_K: 63 * 15, Q.Q5_K: 63 * 31, Q.Q6_K: 127 * 32}
MIXED = {
    "token_embd": Q.Q6_K,
    "output": Q.Q5_K,
    "blk.0.attn_q": Q.Q5_K,
    "blk.0.attn_k": Q.Q4_K,
    "blk.0.attn_v": Q.Q6_K,
    "blk.0.attn_output": Q.Q5_1,
    "blk.0.ffn_gate": Q.Q4_0,
    "blk.0.ffn_up": Q.Q8_0,
    "blk.0.ffn_down": Q.Q6_K,
    "blk.1.attn_q": Q.Q4_K,
    "blk.1.attn_k": Q.Q4_K,
    "blk.1.attn_v": Q.Q4_K,
    "blk.1.attn_output": Q.Q6_K,
    "blk.1.ffn_gate": Q.Q5_0,
    "blk.1.ffn_up": Q.Q4_1,
    "blk.1.ffn_down": Q.Q4_K,
}


def _sane_blocks(
    qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator, size: float
) -> np.ndarray:
    """``[rows, bytes a row]`` of ``qtype`` blocks whose weights are ~``size`` at most (random
    K-quant bytes under fp16 scales sized by the format's largest code)."""
    if qtype in QUANTIZABLE:
        return gguf_quantize(rng.standard_normal((rows, cols), dtype=np.float32) * size / 2.5, qtype)
    if qtype not in _K_CODE_RANGE:
        return _random_blocks(qtype, rows, cols, rng)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        unit = size / (_K_CODE_RANGE[qtype] if at != 2 else 63)  # dmin multiplies a 6-bit minimum
        scales = rng.uniform(0.5, 1, size=(len(blocks), 1)) * unit
        blocks[:, at : at + 2] = scales.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _mixed_llama(path: Path, types: dict[str, GGMLQuantizationType]) -> Path:
    rng = np.random.default_rng(34)
    shapes = {"token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN)}
    for layer in range(2):
        blk = f"blk.{layer}."
        shapes |= {
            blk + "attn_q": (HIDDEN, HIDDEN),
            blk + "attn_k": (HIDDEN // 2, HIDDEN),
            blk + "attn_v": (HIDDEN // 2, HIDDEN),
            blk + "attn_output": (HIDDEN, HIDDEN),
            blk + "ffn_gate": (INTER, HIDDEN),
            blk + "ffn_up": (INTER, HIDDEN),
            blk + "ffn_down": (HIDDEN, INTER),
        }
    tensors = {"output_norm.weight": (np.ones(HIDDEN, np.float32), Q.F32)}
    for name, (rows, cols) in shapes.items():
        qtype, size = types[name], PROJECTION_SIZE if name.startswith("blk.") else 0.05
        data = (
            rng.standard_normal((rows, cols), dtype=np.float32) * size / 2.5
            if qtype == Q.F32
            else _sane_blocks(qtype, rows, cols, rng, size)
        )
        tensors[name + ".weight"] = (data, qtype)
    for layer in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{norm}.weight"] = (np.ones(HIDDEN, np.float32), Q.F32)
    metadata = {
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": INTER,
        "llama.block_count": 2,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": HEADS // 2,
        "llama.vocab_size": VOCAB,
        "llama.context_length": 128,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    return _write(path, tensors, metadata=metadata)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _mixed_llama(tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf", MIXED)


def _logits(model, ids: list[int]) -> torch.Tensor:
    """The last position's float32 logits of one prompt, prefilled whole into fresh caches."""
    from fastsched.attention.base import AttentionMetadata
    from fastsched.attention.cpu import CpuBackend

    attn, t = model.layers[0].self_attn, len(ids)
    caches = [
        torch.zeros(2, 8, 16, attn.num_kv_heads, attn.head_dim, dtype=model.norm.weight.dtype)
        for _ in model.layers
    ]
    metadata = AttentionMetadata(
        torch.arange(t),
        torch.tensor([0, t], dtype=torch.int32),
        torch.tensor([t], dtype=torch.int32),
        torch.arange(8, dtype=torch.int32)[None],
        t,
        t,
    )
    backend = CpuBackend()
    backend.prepare(metadata)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(t), caches, metadata, backend)
        return model.compute_logits(hidden[-1:]).float()[0]


def test_a_gguf_with_every_format_mixed_within_layers_loads_with_no_dense_weight(mixed_gguf, caplog) -> None:
    """Each projection, the embedding and lm_head quantized in its own format: every one is
    kept (4-bit where all of a fused layer's shards are, else 8-bit), none is dense, and the
    kept weights are the file's (conversion exact up to the one rounding of a zero)."""
    with caplog.at_level("INFO", logger="fastsched.model_loader.weights"):
        kept = load_model(mixed_gguf, quantization="gguf", dtype=torch.bfloat16)
    reference = load_model(mixed_gguf, quantization="none", dtype=torch.float32)
    assert [n for n, p in kept.named_parameters() if p.dim() == 2] == []
    assert isinstance(kept.embed_tokens, QuantEmbedding) and isinstance(kept.lm_head, QuantLinear)
    assert isinstance(kept.layers[1].self_attn.qkv_proj.weight_packed, PackedInt4)  # Q4_K × 3
    qkv0 = kept.layers[0].self_attn.qkv_proj.weight_packed  # Q5_K, Q4_K, Q6_K: 8-bit, per 16, zeros
    assert isinstance(qkv0, PackedInt8) and qkv0.cpu.scale_group == 16 and qkv0.zero is not None
    down0 = kept.layers[0].mlp.down_proj.weight_packed
    for module, ref in [
        (qkv0, reference.layers[0].self_attn.qkv_proj.weight),
        (down0, reference.layers[0].mlp.down_proj.weight),
        (kept.lm_head.weight_packed, reference.lm_head.weight),
        (kept.embed_tokens.weight_packed, reference.embed_tokens.weight),
    ]:
        ours = dequantize_int8(module.codes, module.scale, module.zero)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    messages = [r.getMessage() for r in caplog.records]
    line = next(m for m in messages if "kept quantized" in m)
    for part in (
        "Q4_K 5 tensors",
        "Q5_K 2 tensors",
        "Q6_K 4 tensors",
        "Q8_0 1 tensors",
        "Q4_0 1 tensors",
        "Q4_1 1 tensors",
        "Q5_0 1 tensors",
        "Q5_1 1 tensors",
    ):
        assert part in line, line
    assert "Q4_K 5 tensors" in line and "(4 int4, 1 int8)" in line  # layer 0's k fused with 8-bit shards
    q6_k_weights = VOCAB * HIDDEN + HIDDEN // 2 * HIDDEN + HIDDEN * INTER + HIDDEN**2
    q6_k = GGML_QUANT_SIZES[Q.Q6_K][1] * q6_k_weights // 256
    assert f"Q6_K 4 tensors {q6_k / 2**20:.1f} MiB (int8)" in line
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_mixed_gguf_generates_the_greedy_tokens_of_its_dequantized_float32_weights(mixed_gguf) -> None:
    """8 greedy steps, bfloat16 with the kept weights (one Rust call a step where it can)
    against float32 with the dequantized ones. Bound: each step's logits within 0.01 of the
    reference's (bf16 activations and the GEMV's int8 ones; measured ≤ 0.009, on logits of
    ±1). The tokens must agree wherever the reference's top two are further apart than twice
    that bound, and so most steps must be (no test passed on near ties alone). A 20-token
    prompt (the many-row GEMM) meets the same bound."""
    kept = load_model(mixed_gguf, quantization="gguf", dtype=torch.bfloat16)
    reference = load_model(mixed_gguf, quantization="none", dtype=torch.float32)
    ids, bound, decisive = [7, 7, 30], 0.01, 0
    for _ in range(8):
        want, got = _logits(reference, ids), _logits(kept, ids)
        assert (got - want).abs().max().item() <= bound, ids
        top2 = want.topk(2).values
        if (top2[0] - top2[1]).item() > 2 * bound:
            decisive += 1
            assert int(got.argmax()) == int(want.argmax()), ids
        ids.append(int(got.argmax()))
    assert decisive >= 6
    prompt = list(range(3, 23))
    assert (_logits(kept, prompt) - _logits(reference, prompt)).abs().max().item() <= bound


@pytest.mark.skipif(not quant_matmul_cpu.GEMM_SIMD, reason="the decoder stack needs AVX-512 BF16")
@pytest.mark.parametrize("rows", [5, 20])
def test_the_decoder_stack_gives_the_layer_by_layer_bits_on_every_layout(mixed_gguf, rows) -> None:
    """The one-call Rust stack reads the 8-bit layouts (zeros, scales per 16) as the layers
    do: its hidden states are bit-equal to the layer-by-layer path, for the GEMV (5 rows) and
    the many-row GEMM (20)."""
    from fastsched.models.llama_cpu import CpuDecoderStack

    model = load_model(mixed_gguf, quantization="gguf", dtype=torch.bfloat16)
    ids = list(range(1, rows + 1))
    model._stack = "switched off by the test"
    layered = _logits(model, ids)
    model._stack = None
    stacked = _logits(model, ids)
    assert isinstance(model._stack, CpuDecoderStack)
    assert torch.equal(stacked, layered)


def test_what_cannot_stay_quantized_is_a_warning_with_its_count_and_bytes(tmp_path, caplog) -> None:
    """A Q2_K ffn_down (no kept form) and a fused q/k/v with a dense v: their quantized
    tensors are dequantized, and the start-up warning says how many and how large."""
    types = MIXED | {"blk.1.ffn_down": Q.Q2_K, "blk.1.attn_v": Q.F32}
    path = _mixed_llama(tmp_path / "tiny-dense-parts.gguf", types)
    with caplog.at_level("INFO", logger="fastsched.model_loader.weights"):
        model = load_model(path, quantization="gguf", dtype=torch.bfloat16)
    assert not isinstance(model.layers[1].mlp.down_proj, QuantLinear)
    assert not isinstance(model.layers[1].self_attn.qkv_proj, QuantLinear)
    warning = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    q2_k = GGML_QUANT_SIZES[Q.Q2_K][1] * HIDDEN * INTER // 256
    q4_k = GGML_QUANT_SIZES[Q.Q4_K][1] * (HIDDEN + HIDDEN // 2) * HIDDEN // 256
    expected = f"3 quantized tensors ({(q2_k + q4_k) / 2**20:.1f} MiB) dequantized to bfloat16"
    assert expected in warning, warning
    assert "Q2_K 1 tensors" in warning and "Q4_K 2 tensors" in warning


def test_every_quantized_tensor_of_the_real_gemma3_q4_k_m_file_is_kept_exactly(gemma3_gguf) -> None:
    """The published Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0): each quantized matrix
    converts to a kept form, 4-bit or 8-bit, whose dequantization is the file's weights (the
    tied Q8_0 embedding checked on its first 4096 rows)."""
    from dataclasses import replace

    from fastsched.kernels.quant_matmul import dequantize_int4
    from fastsched.model_loader.gguf_quants import KEPT_BITS, dequantize, quantized_blocks

    types: dict[str, int] = {}
    for tensor in GGUFContainer(gemma3_gguf).tensors:
        if tensor.tensor_type == Q.F32:
            continue
        if tensor.name == "token_embd.weight":
            rows = 4096
            tensor = replace(tensor, shape=(rows, tensor.shape[1]), data=tensor.data[:rows])
        blocks = quantized_blocks(tensor)
        assert blocks is not None, tensor.name
        parts = [None if p is None else torch.from_numpy(np.ascontiguousarray(p)) for p in blocks]
        ours = (dequantize_int4 if KEPT_BITS[tensor.tensor_type] == 4 else dequantize_int8)(*parts).numpy()
        np.testing.assert_allclose(ours, dequantize(tensor), rtol=1e-6, atol=1e-7, err_msg=tensor.name)
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    assert types == {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
