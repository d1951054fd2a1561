"""A Hugging Face checkpoint (Gemma 2, Gemma 3 or Phi-3) written as a float32 GGUF file the
way llama.cpp's converter writes one, for tests of the GGUF loader against transformers.

Tensor names and metadata keys are llama.cpp's for each architecture (the reverse of
``fastsched.model_loader.gguf``'s mapping); Gemma's RMSNorm weights are stored as
``1 + w``, Phi-3's LongRoPE factors as the ``rope_factors_short``/``_long`` tensors and its
q/k/v and gate/up fused. The tokenizer goes in as llama.cpp's ``gpt2`` (byte-level BPE)
model, so the file serves text prompts. What llama.cpp cannot express is refused: a Gemma
``query_pre_attn_scalar`` other than ``head_dim`` (llama.cpp derives the scale) or layer
types other than its fixed pattern.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from fastsched.model_loader import hf
from fastsched.model_loader.gguf import _GLOBAL_NAMES, layer_names
from fastsched.models.config import GGUF_ARCHITECTURES, ModelConfig, gemma_layer_types

_ARCHES = {arch: name for name, arch in GGUF_ARCHITECTURES.items() if name in ("gemma2", "gemma3", "phi3")}
_CONTROL = 3  # llama.cpp's token type of special tokens


def write_gguf(checkpoint: str | Path, out_file: str | Path, *, q8_0: bool = False) -> Path:
    """``checkpoint`` (a single-file safetensors directory) as the GGUF file ``out_file``;
    with ``q8_0`` its projection matrices are stored Q8_0 (as llama.cpp's ``--outtype q8_0``
    stores them), the rest float32."""
    import gguf  # the writer is only needed here
    from gguf.quants import quantize

    checkpoint, out_file = Path(checkpoint), Path(out_file)
    config = hf.read_config(checkpoint)
    arch = _ARCHES.get(config.architecture)
    if arch is None:
        raise ValueError(f"write_gguf supports {sorted(_ARCHES)}, not {config.architecture}")
    _check_expressible(config, arch)
    writer = gguf.GGUFWriter(str(out_file), arch)
    _write_hyperparameters(writer, config, arch)
    _write_tokenizer(writer, checkpoint, config)
    to_gguf = {f"model.layers.{{}}.{hf_part}": part for part, hf_part in layer_names(arch).items()}
    globals_ = {hf_name: name for name, hf_name in _GLOBAL_NAMES.items()}
    for name, tensor in load_file(str(checkpoint / hf.SINGLE_FILE)).items():
        tensor = tensor.astype(np.float32)
        if arch != "phi3" and name.endswith("norm.weight"):
            tensor = tensor + np.float32(1.0)
        if q8_0 and name.endswith("proj.weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(name, to_gguf, globals_), quantize(tensor, q8), raw_dtype=q8)
            continue
        writer.add_tensor(_gguf_name(name, to_gguf, globals_), tensor)
    if config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope":
        for key, tensor_name in (
            ("short_factor", "rope_factors_short.weight"),
            ("long_factor", "rope_factors_long.weight"),
        ):
            writer.add_tensor(tensor_name, np.asarray(config.rope_scaling[key], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def _check_expressible(config: ModelConfig, arch: str) -> None:
    if arch == "phi3":
        return
    if config.query_pre_attn_scalar != config.head_dim:
        raise ValueError(
            f"GGUF {arch} files carry no query_pre_attn_scalar; it must equal head_dim "
            f"({config.head_dim}), got {config.query_pre_attn_scalar}"
        )
    pattern = gemma_layer_types(config.architecture, config.num_layers)
    if pattern != config.layer_types:
        raise ValueError(
            f"GGUF {arch} files carry llama.cpp's fixed layer pattern {list(pattern)}; "
            f"the checkpoint has {list(config.layer_types)}"
        )


def _write_hyperparameters(writer: object, config: ModelConfig, arch: str) -> None:
    w = writer
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(0)  # float32 (the Q8_0 projections of q8_0 files are typed per tensor)
    if config.sliding_window is not None:
        w.add_sliding_window(config.sliding_window)
    if config.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    scaling = config.rope_scaling
    if arch == "phi3":
        w.add_rope_dimension_count(int(config.head_dim * config.partial_rotary_factor))
        if scaling is not None:
            from fastsched.models.rope import longrope_attention_factor

            w.add_rope_scaling_attn_factors(longrope_attention_factor(config, scaling))
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif scaling is not None:
        import gguf

        if scaling["rope_type"] != "linear":
            raise ValueError(
                f"GGUF {arch} files carry linear RoPE scaling only, not {scaling['rope_type']!r}"
            )
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])


def _write_tokenizer(writer: object, checkpoint: Path, config: ModelConfig) -> None:
    """The byte-level BPE ``tokenizer.json`` as llama.cpp's ``gpt2`` tokenizer model."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = spec.get("added_tokens", [])
    specials = {token["id"]: token["content"] for token in added if token.get("special")}
    tokens = [""] * config.vocab_size
    for token, index in {**vocab, **{v: k for k, v in specials.items()}}.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if i in specials else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])


def _gguf_name(name: str, layer_parts: dict[str, str], globals_: dict[str, str]) -> str:
    if name in globals_:
        return globals_[name]
    rest = name.removeprefix("model.layers.")
    layer, _, tail = rest.partition(".")
    module, _, kind = tail.rpartition(".")
    part = layer_parts.get(f"model.layers.{{}}.{module}")
    if part is None:
        raise ValueError(f"checkpoint tensor {name} has no llama.cpp name")
    return f"blk.{layer}.{part}.{kind}"
