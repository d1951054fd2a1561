"""A tiny random-weight Llama GGUF with a Llama-2-style SentencePiece vocabulary, for tests.

llama.cpp files of the ``llama`` tokenizer model (Llama 2, Mistral, Gemma, Phi-3) carry no
merges: a vocabulary of pieces written with ``▁`` for a space, a score per piece (higher
merges first), the 256 byte tokens ``<0x00>``..``<0xFF>`` that spell whatever no piece
covers (byte fallback), and flags (``add_space_prefix``, ``add_bos_token``). This file
has all of that, and no chat template, like a base model. Its pieces are learned offline
from the tiny model's corpus (``tiny_model.corpus``), so the file is the same on every run
on one installation; ``transformers.AutoTokenizer`` reads it, which makes it an oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers
from gguf import GGUFWriter, TokenType
from tokenizers import models, pre_tokenizers, trainers

from fastsched.tools.tiny_model import corpus

UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2, as in Llama 2
# A control token (matched whole, dropped by skip_special_tokens) and a user-defined one
# (matched whole, kept in decoded text), as chat models add them.
CONTROL_TOKENS = ("<|user|>", "<|assistant|>")
USER_DEFINED_TOKENS = ("<tool>",)
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


def make_tiny_gguf(
    path: str | Path,
    seed: int = 0,
    *,
    architecture: str = "llama",
    add_space_prefix: bool = True,
    num_pieces: int = 768,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    context_length: int = 4096,
) -> Path:
    """Write the GGUF file ``path`` (its directory created if needed) and return it.

    ``num_pieces`` is the SentencePiece target (characters and merged pieces); the file's
    vocabulary adds the specials and byte tokens to it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = _sentencepiece_vocab(num_pieces)
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(num_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    for name, weights in _random_weights(
        len(tokens), num_layers, hidden_size, intermediate_size, hidden_size // num_heads * num_kv_heads, seed
    ).items():
        writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sentencepiece_vocab(num_pieces: int) -> tuple[list[str], list[float], list[int]]:
    """Llama 2's layout: specials, byte tokens, then the pieces best-first; a merged piece
    scores by when it was learned, a single character below every merge."""
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=num_pieces, min_frequency=2, show_progress=False)
    trained.train_from_iterator(corpus(), trainer=trainer)
    merged = [left + right for left, right in _merges(trained)]
    characters = sorted(set(trained.get_vocab()) - set(merged))
    pieces = merged + characters
    tokens = [UNK, BOS, EOS, *_BYTE_TOKENS, *CONTROL_TOKENS, *USER_DEFINED_TOKENS, *pieces]
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(rank) for rank in range(len(pieces))]
    types = (
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
        + [TokenType.BYTE] * len(_BYTE_TOKENS)
        + [TokenType.CONTROL] * len(CONTROL_TOKENS)
        + [TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS)
        + [TokenType.NORMAL] * len(pieces)
    )
    return tokens, scores, [int(t) for t in types]


def _merges(trained: tokenizers.Tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(trained.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _random_weights(
    vocab: int, layers: int, hidden: int, inter: int, kv: int, seed: int
) -> dict[str, np.ndarray]:
    """GGUF tensor names, float32; scaled as ``tiny_model``'s, so logits spread apart."""
    rng = np.random.default_rng(seed)

    def linear(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    weights = {"token_embd.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
    for layer in range(layers):
        blk = f"blk.{layer}."
        weights |= {
            blk + "attn_norm.weight": norm(hidden),
            blk + "attn_q.weight": linear(hidden, hidden),
            blk + "attn_k.weight": linear(kv, hidden),
            blk + "attn_v.weight": linear(kv, hidden),
            blk + "attn_output.weight": linear(hidden, hidden),
            blk + "ffn_norm.weight": norm(hidden),
            blk + "ffn_gate.weight": linear(inter, hidden),
            blk + "ffn_up.weight": linear(inter, hidden),
            blk + "ffn_down.weight": linear(hidden, inter),
        }
    weights["output_norm.weight"] = norm(hidden)
    weights["output.weight"] = 3.0 * linear(vocab, hidden)
    return weights
