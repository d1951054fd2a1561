"""Gemma 2, Gemma 3 and Phi-3 against transformers: fp32 greedy tokens equal, from a Hugging
Face directory and from a GGUF file written with llama.cpp's names and keys.

The tiny checkpoints (``fastsched.tools.tiny_model``) have a 16-token sliding window and
prompts several times longer, run in prefill chunks whose context reaches past the window
and in decodes beyond it; Gemma 2's soft-capping is on, Gemma 3 has its q/k norms, own
local RoPE base and linear scaling on its global layers, Phi-3 its fused projections and
LongRoPE factors. The real Gemma 3 270M Q4_K_M file is checked against transformers'
dequantized load of the same file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from test_models import SingleRequestRunner  # tests/models, on the path as the tests' own directory

from fastsched import LLM, SamplingParams
from fastsched.config import EngineConfig
from fastsched.model_loader import load_model_config, load_tokenizer
from fastsched.model_loader.export import export_hf
from fastsched.model_loader.weights import load_model
from fastsched.models.config import ModelConfig
from fastsched.models.gemma import GemmaForCausalLM
from fastsched.models.llama_cpu import unsupported_reason
from fastsched.models.quant_linear import QuantLinear
from fastsched.tools.checkpoint_gguf import write_gguf
from fastsched.tools.tiny_model import make_tiny_model
from fastsched.worker.kv_sizing import determine_num_blocks, fit_max_model_len

ARCHES = ("gemma2", "gemma3", "phi3")
WINDOW = 16
PROMPTS = [
    "def hello(world):\n    return world + 1 if world else None  # a comment that runs on for a while",
    "The quick brown fox jumps over the lazy dog, and then it does it again and again and again.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ARCHES)
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(architecture, HF directory, GGUF file, transformers' model)."""
    directory = make_tiny_model(
        tmp_path_factory.mktemp(request.param) / "model", architecture=request.param, sliding_window=WINDOW
    )
    gguf = write_gguf(directory, directory.parent / "model.gguf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, directory, gguf, reference


def _hf_greedy(reference: transformers.PreTrainedModel, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def _chunked_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int, chunk: int) -> list[int]:
    """Prefill in chunks of ``chunk`` tokens (each after the cached ones), then decode."""
    runner = SingleRequestRunner(model, len(ids) + new_tokens + 16)
    for start in range(0, len(ids), chunk):
        logits = runner.step(ids[start : start + chunk])[-1]
    out = []
    while len(out) < new_tokens:
        out.append(int(logits.argmax()))
        logits = runner.step([out[-1]])[-1]
    return out


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_greedy_tokens_match_transformers_across_the_sliding_window(arch, fmt: str) -> None:
    name, directory, gguf, reference = arch
    model = load_model(directory if fmt == "hf" else gguf)
    tokenizer = load_tokenizer(directory)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert len(ids) > 2 * WINDOW
        assert _chunked_greedy(model, ids, NEW_TOKENS, chunk=11) == _hf_greedy(reference, ids, NEW_TOKENS)


def test_logits_match_transformers_in_chunked_prefill_and_decode(arch) -> None:
    name, directory, gguf, reference = arch
    ids = load_tokenizer(directory).encode(PROMPTS[0])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    for source in (directory, gguf):
        runner = SingleRequestRunner(load_model(source), len(ids))
        split = len(ids) - 8
        steps = [runner.step(ids[:9]), runner.step(ids[9:split]), *(runner.step([t]) for t in ids[split:])]
        logits = torch.cat(steps)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_q8_0_projections_kept_quantized_serve_close_to_their_dequantized_logits(arch, tmp_path) -> None:
    """Phi-3's fused qkv/gate_up Q8_0 tensors are split by rows into the fused layers' shards,
    kept 8-bit (``quantization="gguf"``); the logits stay close to the same file dequantized."""
    name, directory, _, _ = arch
    gguf = write_gguf(directory, tmp_path / "q8.gguf", q8_0=True)
    kept = load_model(gguf, quantization="gguf")
    assert sum(isinstance(m, QuantLinear) for m in kept.modules()) == 4 * kept.config.num_layers
    ids = load_tokenizer(directory).encode(PROMPTS[1])
    logits = SingleRequestRunner(kept, len(ids)).step(ids)
    dense = SingleRequestRunner(load_model(gguf, quantization="none"), len(ids)).step(ids)
    torch.testing.assert_close(logits, dense, atol=0.1, rtol=0.05)


def test_gguf_config_matches_the_checkpoint_config(arch) -> None:
    """What llama.cpp's keys carry (windows, layer types, scale, soft-caps, RoPE) reads back
    as config.json's."""
    name, directory, gguf, _ = arch
    fields = (
        "sliding_window",
        "layer_types",
        "rope_theta",
        "rope_local_theta",
        "rope_scaling",
        "attention_scale",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "partial_rotary_factor",
        "hidden_act",
        "qk_norm",
        "tie_word_embeddings",
        "max_position_embeddings",
    )
    hf_config, gguf_config = load_model_config(directory), load_model_config(gguf)
    for field in fields:
        hf_value, gguf_value = getattr(hf_config, field), getattr(gguf_config, field)
        if field == "rope_scaling" and hf_value is not None and hf_value["rope_type"] == "longrope":
            hf_value = {**hf_value, "attention_factor": pytest.approx(gguf_value["attention_factor"])}
            gguf_value = {k: pytest.approx(v) if isinstance(v, list) else v for k, v in gguf_value.items()}
        assert gguf_value == hf_value, field


def test_export_hf_of_the_gguf_file_gives_transformers_the_same_model(arch, tmp_path) -> None:
    """``fastsched export-hf``: the GGUF file's config (windows, caps, RoPE) and weights (norms
    back to Gemma's zero-centred form, Phi-3's fused tensors) as a directory transformers loads."""
    name, directory, gguf, reference = arch
    exported = export_hf(gguf, tmp_path / "exported", weights=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor([load_tokenizer(directory).encode(PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_the_engine_serves_windowed_layers_in_mixed_chunked_batches(arch) -> None:
    """``fastsched.LLM`` on the default CPU backend (windowed layers on its torch path), with a
    token budget that chunks every prompt and batches prefills beside decodes."""
    name, directory, _, reference = arch
    tokenizer = load_tokenizer(directory)
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [tokenizer.encode(PROMPTS[1][:30])]
    llm = LLM(
        str(directory), dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, log_stats_interval=0
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [_hf_greedy(reference, ids, NEW_TOKENS) for ids in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_gemma2_soft_capping_is_applied(arch) -> None:
    """Without its attention and final soft-caps the tiny Gemma 2 gives other logits: the
    caps bite at these sizes, so the equality tests above check them."""
    name, directory, _, _ = arch
    if name != "gemma2":
        pytest.skip("soft-capping is Gemma 2's")
    ids = load_tokenizer(directory).encode(PROMPTS[0])
    capped = load_model(directory)
    with_caps = SingleRequestRunner(capped, len(ids)).step(ids)
    assert float(with_caps.abs().max()) <= 30.0  # final_logit_softcapping
    without_attention_cap = load_model(directory)
    for layer in without_attention_cap.layers:
        layer.self_attn._backend_options.pop("logits_soft_cap")
    without_final_cap = load_model(directory)
    without_final_cap.config = dataclasses.replace(capped.config, final_logit_softcapping=None)
    for model in (without_attention_cap, without_final_cap):
        assert (SingleRequestRunner(model, len(ids)).step(ids) - with_caps).abs().max() > 0.1


def test_the_rust_decoder_stack_declines_what_its_kernels_lack(arch) -> None:
    """Dense bfloat16 layers are never the stack's; sliding windows, soft-caps and Gemma's
    layers are (tests/models/test_llama_cpu.py checks their bits), so int4 models run in it."""
    name, directory, _, _ = arch
    reason = unsupported_reason(load_model(directory, dtype=torch.bfloat16))
    assert reason is not None
    if "AVX-512" not in reason:  # on a CPU with the kernels, the dense layers are what declines
        assert "is not an int4/int8 layer" in reason
        assert unsupported_reason(load_model(directory, dtype=torch.bfloat16, quantization="int4")) is None
        assert "bfloat16" in unsupported_reason(
            load_model(directory, dtype=torch.float32, quantization="int4")
        )


def test_gemma_models_are_gemma_layers_with_windows_on_the_sliding_ones(arch) -> None:
    name, directory, _, _ = arch
    model = load_model(directory)
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    if name == "phi3":
        assert windows == [WINDOW] * len(windows)
        return
    assert isinstance(model, GemmaForCausalLM)
    expected = {"gemma2": [WINDOW, None], "gemma3": [WINDOW] * 5 + [None]}[name]
    assert windows == expected


def test_max_model_len_from_the_file_is_cut_to_the_kv_cache_and_says_so(arch, caplog) -> None:
    name, _, gguf, _ = arch
    model_config = load_model_config(gguf)
    assert model_config.max_position_embeddings == 4096  # the file's <arch>.context_length
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 4
    config = EngineConfig(model=str(gguf), device="cpu", dtype="float32", kv_cache_memory=1000 * per_token)
    with caplog.at_level(logging.INFO, logger="fastsched.worker.kv_sizing"):
        blocks = determine_num_blocks(config, model_config, torch.float32, torch.device("cpu"), 4096)
        assert fit_max_model_len(config, 4096, blocks) == (blocks - 1) * 16 < 4096
    assert "below the model's context length 4096" in caplog.text
    roomy = dataclasses.replace(config, kv_cache_memory=5000 * per_token)
    blocks = determine_num_blocks(roomy, model_config, torch.float32, torch.device("cpu"), 4096)
    assert fit_max_model_len(roomy, 4096, blocks) == 4096
    given = dataclasses.replace(config, max_model_len=2048)
    with pytest.raises(ValueError, match="max_model_len"):
        determine_num_blocks(given, model_config, torch.float32, torch.device("cpu"), 2048)


# Checkpoints that transformers 5 itself saves (its config.json layout: nested per-layer-type
# rope_parameters, explicit layer_types), with what the tiny ones leave out: a
# query_pre_attn_scalar other than head_dim, Phi-3's partial rotation.
_TRANSFORMERS_BUILT = {
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "qwen2-sliding-from-max-window-layers": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
    ),
    "phi3-partial-rotary": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            sliding_window=8,
            pad_token_id=0,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=64,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(4)],
                "long_factor": [2.0 + 0.1 * i for i in range(4)],
            },
        ),
    ),
}


@pytest.mark.parametrize("kind", sorted(_TRANSFORMERS_BUILT))
def test_checkpoints_saved_by_transformers_match_in_chunked_prefill_and_decode(
    kind: str, tmp_path: Path
) -> None:
    config_cls, model_cls, extra = _TRANSFORMERS_BUILT[kind]
    torch.manual_seed(0)
    reference = model_cls(
        config_cls(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=512,
            **extra,
        )
    ).eval()
    with torch.no_grad():  # randomized norms (Gemma's zero-centred), so a misplaced one shows
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif param.ndim == 1:
                param.copy_(0.1 * torch.randn_like(param) + (0.0 if kind.startswith("gemma") else 1.0))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    reference.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    runner = SingleRequestRunner(load_model(tmp_path), 64)
    steps = [runner.step(ids[:12]), runner.step(ids[12:24]), *(runner.step([t]) for t in ids[24:])]
    torch.testing.assert_close(torch.cat(steps), expected, atol=1e-4, rtol=1e-4)


def test_unsupported_gemma_settings_are_named() -> None:
    base = dict(
        architecture="Gemma3ForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=64,
    )
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(**base, layer_types=("sliding_attention",), sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(**base, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig(**base, hidden_act="relu")
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig(
            **base,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 32,
            },
        )
    hf = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    }
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**hf, "use_bidirectional_attention": True})


# --- the real Gemma 3 270M Q4_K_M file ------------------------------------------------------------

REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """transformers' fp32 model (it dequantizes the file) and its tokenizer, saved as a
    tokenizer.json directory the engine can read (with the file's config as config.json)."""
    kwargs = dict(gguf_file=gemma3_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, dtype=torch.float32, **kwargs
    )
    model.generation_config.eos_token_id = None  # 32 tokens each, as ignore_eos does ours
    tokenizer = transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, **kwargs)
    tokenizer_dir = tmp_path_factory.mktemp("gemma3-tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    config = load_model_config(gemma3_gguf).to_hf_config()
    (tokenizer_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return model.eval(), tokenizer, tokenizer_dir


def test_real_gemma3_270m_gguf_greedy_tokens_match_transformers(gemma3_gguf: Path, gemma3_reference) -> None:
    reference, tokenizer, tokenizer_dir = gemma3_reference
    prompts = [tokenizer(p).input_ids for p in REAL_PROMPTS]
    # The engine's tokenizer only detokenizes here: the prompts go in as token ids.
    llm = LLM(
        str(gemma3_gguf),
        quantization="none",
        dtype="float32",
        tokenizer=str(tokenizer_dir),
        log_stats_interval=0,
    )
    assert llm.engine.max_model_len <= 32768  # the file's gemma3.context_length, or what the KV cache holds
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [_hf_greedy(reference, ids, 32) for ids in prompts]
