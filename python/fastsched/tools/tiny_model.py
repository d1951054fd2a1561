"""A few-MB random-weight checkpoint in Hugging Face format, for tests and demos: Llama by
default, or Gemma 2, Gemma 3 (text) or Phi-3 (``architecture``).

Everything is made offline: the byte-level BPE tokenizer is trained on a fixed list of
Python standard-library sources (so its vocabulary follows the Python version, and is
identical across runs on one installation), the weights come from a seeded torch
generator, and ``config.json`` is written by hand so neither transformers nor a model hub
is needed to make it. transformers' ``AutoModelForCausalLM`` loads the result, which is what
makes it a correctness oracle. The Gemma and Phi-3 configs turn on what sets those families
apart at tiny sizes: a sliding window of ``sliding_window`` tokens (every other layer in
Gemma 2, five in six in Gemma 3, every layer in Phi-3), Gemma 2's attention and final logit
soft-capping, Gemma 3's linear RoPE scaling on its global layers and own base on the sliding
ones, Phi-3's LongRoPE factors; each is written so llama.cpp's GGUF keys can express it
(``fastsched.tools.checkpoint_gguf``).
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Long-lived standard-library modules: a mix of prose (docstrings) and code.
_CORPUS_FILES = (
    "argparse.py",
    "bisect.py",
    "calendar.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "json/decoder.py",
    "json/encoder.py",
    "queue.py",
    "random.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)
_CORPUS_BYTES = 400_000

ARCHITECTURES = ("llama", "gemma2", "gemma3", "phi3")
# Layers by default: Gemma 3's llama.cpp pattern puts one global layer in six.
_DEFAULT_LAYERS = {"llama": 2, "gemma2": 2, "gemma3": 6, "phi3": 2}


def make_tiny_model(
    path: str | Path,
    seed: int = 0,
    *,
    num_layers: int | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    architecture: str = "llama",
    sliding_window: int = 16,
) -> Path:
    """Write the checkpoint into directory ``path`` (created if needed) and return it.

    Same arguments, same bytes. ``vocab_size`` is the BPE target; config.json records the
    size the trained tokenizer actually has. ``num_layers`` defaults per architecture
    (:data:`_DEFAULT_LAYERS`); Gemma ties its embeddings whatever ``tie_word_embeddings`` says.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    num_layers = num_layers or _DEFAULT_LAYERS[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save(str(path / "tokenizer.json"))
    actual_vocab = tokenizer.get_vocab_size()
    eos_ids = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    bos_id = tokenizer.token_to_id("<|endoftext|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": actual_vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "torch_dtype": "float32",
    }
    config.update(_family_config(architecture, config, sliding_window))
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_ids})
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(_random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _family_config(architecture: str, base: dict, sliding_window: int) -> dict:
    """What config.json holds beyond the Llama keys for ``architecture``."""
    head_dim = base["head_dim"]
    if architecture == "phi3":
        half = head_dim // 2
        return {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "sliding_window": sliding_window,
            "original_max_position_embeddings": 1024,
            "pad_token_id": base["bos_token_id"],
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(half)],
                "long_factor": [2.0 + 0.5 * i for i in range(half)],
            },
        }
    if architecture == "llama":
        return {}
    gemma = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": head_dim,
        "sliding_window": sliding_window,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "pad_token_id": base["bos_token_id"],
    }
    if architecture == "gemma2":
        return {
            **gemma,
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 30.0,
        }
    return {
        **gemma,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window_pattern": 6,
    }


def _train_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def corpus() -> list[str]:
    """The tokenizer training texts: fixed standard-library sources (prose and code)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, remaining = [], _CORPUS_BYTES
    for name in _CORPUS_FILES:
        file = stdlib / name
        if not file.is_file():
            raise FileNotFoundError(f"tiny-model tokenizer corpus file {file} is missing from this Python")
        text = file.read_text(encoding="utf-8")[:remaining]
        texts.append(text)
        remaining -= len(text)
        if remaining <= 0:
            break
    return texts


def _random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Scaled so activations stay O(1) and logits spread well apart: greedy decoding then
    has no near-ties that rounding differences between implementations could flip."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) / math.sqrt(in_features)

    gemma = config["model_type"].startswith("gemma")
    fused = config["model_type"] == "phi3"

    def norm(size: int) -> torch.Tensor:  # Gemma scales by 1 + w, the others by w
        return (0.0 if gemma else 1.0) + 0.1 * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=generator)}
    if gemma:  # scaled up by sqrt(hidden) on the way in: kept small so the layers, not the token, dominate
        weights["model.embed_tokens.weight"] *= 0.05
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        weights[prefix + "input_layernorm.weight"] = norm(hidden)
        q, k, v = linear(q_size, hidden), linear(kv_size, hidden), linear(kv_size, hidden)
        if fused:
            weights[prefix + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        else:
            weights.update(
                {
                    prefix + "self_attn.q_proj.weight": q,
                    prefix + "self_attn.k_proj.weight": k,
                    prefix + "self_attn.v_proj.weight": v,
                }
            )
        if config["model_type"] == "gemma3_text":
            weights[prefix + "self_attn.q_norm.weight"] = norm(config["head_dim"])
            weights[prefix + "self_attn.k_norm.weight"] = norm(config["head_dim"])
        weights[prefix + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        weights[prefix + "post_attention_layernorm.weight"] = norm(hidden)
        if gemma:
            weights[prefix + "pre_feedforward_layernorm.weight"] = norm(hidden)
            weights[prefix + "post_feedforward_layernorm.weight"] = norm(hidden)
        gate, up = linear(inter, hidden), linear(inter, hidden)
        if fused:
            weights[prefix + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        else:
            weights.update({prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up})
        weights[prefix + "mlp.down_proj.weight"] = linear(hidden, inter)
    # Gemma's tied output embedding is as small as its input one: a final norm of 5 spreads the logits.
    weights["model.norm.weight"] = norm(hidden) + (4.0 if gemma else 0.0)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = 3.0 * linear(config["vocab_size"], hidden)
    return weights


def _write_json(file: Path, value: dict) -> None:
    file.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
