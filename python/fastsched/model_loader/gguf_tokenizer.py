"""The tokenizer a GGUF file describes, as a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: ``tokenizer.ggml.model`` names the algorithm and
the vocabulary comes as metadata arrays. Two models are read:

* ``gpt2``: byte-level BPE with its merges; ``tokenizer.ggml.pre`` names how text is
  split before merging (SmolLM2, Llama 3, Qwen2).
* ``llama``: SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3). Pieces spell a space as
  ``▁``; no merges are stored, only a score per piece, and the pieces merge best score
  first, so the merges are rebuilt from the vocabulary: every split of a piece into two
  pieces, ranked by the whole piece's score. Characters no piece covers are spelled by the
  byte tokens ``<0x00>``..``<0xFF>`` (byte fallback), which decode back to UTF-8 text.

Token ids are those of transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), the reference the tests compare with, including where it departs from
llama.cpp: a space is prepended to the first piece of text only, not after each special
token; Gemma files are read the way Gemma's own ``tokenizer.json`` works (no space
prefix, pieces ranked by their place in the vocabulary, whose scores do not follow the
merge order); Phi-3 prepends its space in a normalizer. Where the file says
``add_space_prefix = false`` for another architecture no space is prepended (as llama.cpp
does; transformers 5 ignores the flag there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from fastsched.model_loader.tokenizer import Tokenizer

# llama.cpp token types (llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "▁"
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

# Pre-tokenizer regexes by ``tokenizer.ggml.pre``: text must be split the way the merges were learned.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_pre(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_BYTE_LEVEL_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    # SmolLM: every digit is its own token, then GPT-2 splitting.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()]),
    "llama3": lambda: _split_pre(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_pre(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_pre(_QWEN2_SPLIT),
}


def gguf_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a GGUF file with ``metadata``; ``ValueError`` naming the field for a
    tokenizer model or pre-tokenizer that is not supported."""
    model_type = metadata.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if model_type not in builders:
        raise ValueError(
            f"GGUF tokenizer.ggml.model {model_type!r} is not supported; supported: "
            f"{sorted(builders)} (byte-level BPE, SentencePiece)"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    backend = builders[model_type](metadata, tokens)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    # Control tokens (<|im_start|>, <start_of_turn>...) and user-defined ones must match whole,
    # never be merged from pieces; control tokens and the named ones (BOS, EOS, unknown,
    # padding) are the special tokens skip_special_tokens drops. A user-defined token the
    # model spells otherwise (Gemma's runs of spaces) is left to it.
    named = {metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
    token_types = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    typed = list(enumerate(zip(tokens, token_types, strict=True)))
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for i, (t, kind) in typed
            if kind == _CONTROL or i in named
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for _, (t, kind) in typed
            if kind == _USER_DEFINED and backend.model.token_to_id(t) is not None
        ]
    )
    eot_id = metadata.get("tokenizer.ggml.eot_token_id")  # chat models' end-of-turn, stops generation too
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model_type == "llama")) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        backend.post_processor = _added_around(
            backend, tokens[bos_id] if add_bos else None, tokens[eos_id] if add_eos else None
        )
    return Tokenizer(
        backend,
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos_id, eot_id) if i is not None)),
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
    )


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: "
            f"{sorted(_BYTE_LEVEL_PRE_TOKENIZERS)}"
        )
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _BYTE_LEVEL_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    architecture = metadata.get("general.architecture")
    gemma = architecture in _GEMMA_ARCHITECTURES
    if gemma:
        # Gemma stores its pieces of two or more spaces as real spaces: they are looked up as ▁▁...
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks: Sequence[float] = [-float(i) for i in range(len(tokens))]
    else:
        ranks = metadata.get("tokenizer.ggml.scores") or []
        if len(ranks) != len(tokens):
            raise ValueError(
                f"GGUF tokenizer.ggml.scores has {len(ranks)} entries for {len(tokens)} "
                "tokens: a SentencePiece vocabulary needs a score per token"
            )
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, vocab, ranks),
            byte_fallback=True,
            fuse_unk=True,
            unk_token=tokens[unk_id] if unk_id is not None else None,
        )
    )
    space_prefix = not gemma and bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if architecture == "phi3" and space_prefix:
        # Phi-3's prefix space comes from a normalizer: one before every piece of text, and a
        # text that starts with spaces keeps them all (▁▁▁hi for "  hi").
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
    elif gemma or architecture == "phi3":
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if space_prefix else "never", split=False
        )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:  # the space the encoder put before the text is not the text's
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(
    tokens: list[str], vocab: dict[str, int], ranks: Sequence[float]
) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose halves and whole are pieces, best first: a higher score
    of the whole first; on a tie, the longer left half, the longer right half, then the
    vocabulary's order (transformers ranks them so, and equal ids depend on it)."""
    candidates = []
    for order, (piece, score) in enumerate(dict(zip(tokens, ranks, strict=True)).items()):
        for cut in range(1, len(piece)):
            if piece[:cut] in vocab and piece[cut:] in vocab:
                candidates.append((-score, -cut, cut - len(piece), order, piece))
    candidates.sort()
    return [(piece[:-neg_cut], piece[-neg_cut:]) for _, neg_cut, _, _, piece in candidates]


def _added_around(
    backend: tokenizers.Tokenizer, bos: str | None, eos: str | None
) -> processors.PostProcessor:
    """BOS before and EOS after an encoded text, as the file's ``add_bos_token`` /
    ``add_eos_token`` ask (a Hugging Face tokenizer's post-processor does the same)."""
    single = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
