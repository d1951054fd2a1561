"""A few-MB random-weight Llama checkpoint in Hugging Face format, for tests and demos.

Everything is made offline: the byte-level BPE tokenizer is trained on a fixed list of
Python standard-library sources (so its vocabulary follows the Python version, and is
identical across runs on one installation), the weights come from a seeded torch
generator, and ``config.json`` is written by hand so neither transformers nor a model hub
is needed to make it. ``transformers.LlamaForCausalLM`` loads the result, which is what
makes it a correctness oracle.
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
    "argparse.py", "bisect.py", "calendar.py", "dataclasses.py", "difflib.py", "enum.py",
    "fractions.py", "functools.py", "heapq.py", "json/decoder.py", "json/encoder.py",
    "queue.py", "random.py", "statistics.py", "string.py", "textwrap.py",
)
_CORPUS_BYTES = 400_000


def make_tiny_model(
    path: str | Path,
    seed: int = 0,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write the checkpoint into directory ``path`` (created if needed) and return it.

    Same arguments, same bytes. ``vocab_size`` is the BPE target; config.json records the
    size the trained tokenizer actually has.
    """
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
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_ids})
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    })
    save_file(_random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


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

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=generator)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        weights[prefix + "input_layernorm.weight"] = norm(hidden)
        weights[prefix + "self_attn.q_proj.weight"] = linear(q_size, hidden)
        weights[prefix + "self_attn.k_proj.weight"] = linear(kv_size, hidden)
        weights[prefix + "self_attn.v_proj.weight"] = linear(kv_size, hidden)
        weights[prefix + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        weights[prefix + "post_attention_layernorm.weight"] = norm(hidden)
        weights[prefix + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[prefix + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[prefix + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = 3.0 * linear(config["vocab_size"], hidden)
    return weights


def _write_json(file: Path, value: dict) -> None:
    file.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
