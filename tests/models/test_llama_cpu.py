"""The CPU decoder stack (fastsched.models.llama_cpu): the embedded SmolLM2 (4-bit weights,
bfloat16), a Qwen2 with q/k/v biases, a Qwen3 with per-head q/k norms, a windowed Phi-3 and
Gemma 2 / Gemma 3 (windows, soft-caps, four ``1 + w`` norms a layer, GeGLU, Gemma 3's local
RoPE table; all quantized to int4 at load) run as one Rust call a step give the same bits as
the layer-by-layer path, for their hidden states and for what they write into the KV cache,
and the stack steps aside where it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from fastsched.attention.base import AttentionMetadata
from fastsched.attention.cpu import SDPA_MIN_QUERY_LEN, CpuBackend
from fastsched.kernels import quant_matmul_cpu
from fastsched.model_loader.weights import load_model
from fastsched.models.llama_cpu import CpuDecoderStack, unsupported_reason
from fastsched.models.quant_linear import copy_weights
from fastsched.tools.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not quant_matmul_cpu.GEMM_SIMD, reason="the stack needs AVX-512 BF16")

BLOCK_SIZE = 16
NUM_BLOCKS = 64
LAYER_BY_LAYER = "switched off by the test"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(None, dtype=torch.bfloat16, quantization="gguf")


def _caches(model) -> list[torch.Tensor]:
    attn = model.layers[0].self_attn
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    return [torch.zeros(shape, dtype=torch.bfloat16) for _ in model.layers]


def _step(requests: list[tuple[int, int, int]], padding: int = 0) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for requests given as (first block, tokens already cached, query rows), each
    owning 8 consecutive blocks from its first; plus the positions, padding rows last."""
    slots, positions, qsl, seq_lens, tables = [], [], [0], [], []
    for first, cached, rows in requests:
        for p in range(cached, cached + rows):
            slots.append((first + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE)
            positions.append(p)
        qsl.append(qsl[-1] + rows)
        seq_lens.append(cached + rows)
        tables.append(list(range(first, first + 8)))
    slots += [-1] * padding
    positions += [0] * padding
    metadata = AttentionMetadata(
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        max(r for _, _, r in requests),
        max(seq_lens),
    )
    return metadata, torch.tensor(positions, dtype=torch.int64)


def _forward(model, ids, positions, caches, metadata, stack: bool) -> torch.Tensor:
    model._stack = None if stack else LAYER_BY_LAYER
    backend = CpuBackend()
    backend.prepare(metadata)
    with torch.inference_mode():
        return model(ids, positions, caches, metadata, backend)


# Steps run in order on the same caches: prefills (integer GEMV rows: fewer than 16), then a
# decode of both with a padding row, then a 40-row chunk (many-row GEMM) next to a decode.
STEPS = [
    ([(1, 0, 9), (9, 0, 5)], 0),
    ([(1, 9, 1), (9, 5, 1)], 1),
    ([(17, 0, 40), (1, 10, 1)], 0),
]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory):
    """A random Qwen2 (q/k/v biases, randomized: transformers' init zeroes them) with int4 weights."""
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    reference = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif param.ndim > 1:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    reference.save_pretrained(path)
    model = load_model(Path(path), dtype=torch.bfloat16, quantization="int4")
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    return model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory):
    """A random Qwen3 (q/k norms, randomized: transformers' init sets them to ones) with int4 weights."""
    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
    )
    reference = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1 + 0.5 * torch.rand_like(param))
            elif param.ndim > 1:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    reference.save_pretrained(path)
    model = load_model(Path(path), dtype=torch.bfloat16, quantization="int4")
    assert model.config.qk_norm
    return model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory):
    """A random Phi-3 with a 3-token sliding window on every layer (shorter than the steps'
    contexts, so the window decides what the rows attend), int4 weights."""
    model = load_model(
        make_tiny_model(tmp_path_factory.mktemp("phi3") / "model", architecture="phi3", sliding_window=3),
        dtype=torch.bfloat16,
        quantization="int4",
    )
    assert model.layers[0].self_attn.sliding_window == 3
    return model


def _tiny_gemma(architecture: str, tmp_path_factory: pytest.TempPathFactory):
    """A random Gemma with a 5-token window, int4 weights."""
    directory = make_tiny_model(
        tmp_path_factory.mktemp(architecture) / "model", architecture=architecture, sliding_window=5
    )
    model = load_model(directory, dtype=torch.bfloat16, quantization="int4")
    assert model.layers[0].self_attn.sliding_window == 5
    return model


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory):
    """Gemma 2: a window on every other layer, attention soft-capping."""
    return _tiny_gemma("gemma2", tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    """Gemma 3: a window on five layers of six, q/k norms, the sliding layers' own RoPE base."""
    model = _tiny_gemma("gemma3", tmp_path_factory)
    assert model.config.qk_norm and model.local_rotary is not None
    return model


@pytest.mark.parametrize("name", ["model", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_the_stack_gives_the_layer_by_layer_bits_and_kv_cache(name, request) -> None:
    model = request.getfixturevalue(name)
    assert unsupported_reason(model) is None
    stacked, layered = _caches(model), _caches(model)
    generator = torch.Generator().manual_seed(1)
    for requests, padding in STEPS:
        metadata, positions = _step(requests, padding)
        ids = torch.randint(0, model.config.vocab_size, (positions.shape[0],), generator=generator)
        want = _forward(model, ids, positions, layered, metadata, stack=False)
        got = _forward(model, ids, positions, stacked, metadata, stack=True)
        assert isinstance(model._stack, CpuDecoderStack)
        assert torch.equal(got, want), f"step {requests}: max diff {(got.float() - want.float()).abs().max()}"
        for layer, (a, b) in enumerate(zip(stacked, layered)):
            assert torch.equal(a, b), f"step {requests}: layer {layer}'s KV cache differs"


def test_a_step_with_an_sdpa_chunk_runs_layer_by_layer(model, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(CpuDecoderStack, "forward", lambda *a, **k: calls.append(a))
    metadata, positions = _step([(1, 0, SDPA_MIN_QUERY_LEN), (40, 0, 1)])
    ids = torch.zeros(positions.shape[0], dtype=torch.int64)
    _forward(model, ids, positions, _caches(model), metadata, stack=True)
    assert calls == []
    metadata, positions = _step([(1, 0, 3)])
    _forward(model, ids[:3], positions, _caches(model), metadata, stack=True)
    assert len(calls) == 1


def test_models_it_cannot_run_say_why() -> None:
    fp32 = load_model(None, dtype=torch.float32, quantization="gguf")
    assert "bfloat16" in unsupported_reason(fp32)
    dense = load_model(None, dtype=torch.bfloat16, quantization="none")
    assert "int4/int8" in unsupported_reason(dense)


def test_a_weight_reload_drops_the_stack_built_from_the_old_weights(model) -> None:
    metadata, positions = _step([(1, 0, 2)])
    _forward(model, torch.tensor([1, 2]), positions, _caches(model), metadata, stack=True)
    old = model._stack
    assert isinstance(old, CpuDecoderStack)
    copy_weights(model, load_model(None, dtype=torch.bfloat16, quantization="gguf"))
    assert model._stack is None
