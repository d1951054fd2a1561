"""One description of a decoder checkpoint, whatever format it came in.

The model, the runner (KV cache sizing, ``max_model_len``) and the engine (EOS ids)
all read this dataclass instead of a raw ``config.json`` or GGUF metadata, so the
per-format quirks (old vs new rope keys, which architectures carry which biases,
llama.cpp's key names) are resolved here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# llama.cpp's ``general.architecture`` -> the Hugging Face class name it was converted from.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# ``model_type`` -> class name, for config.json files saved without ``architectures``.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_DTYPES = ("float32", "float16", "bfloat16")

# GGUF ``general.file_type`` values whose weights are stored unquantized (llama.cpp's LLAMA_FTYPE).
_GGUF_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; else {"rope_type": "llama3", "factor": ..., "low_freq_factor": ...,
    # "high_freq_factor": ..., "original_max_position_embeddings": ...}.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama/Qwen3 when configured)
    o_proj_bias: bool = False  # bias on the attention output (Llama/Qwen3 ``attention_bias``)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    # Mistral-style windowed attention; no backend implements it, so callers must keep
    # max_model_len <= sliding_window (outputs are exact below the window).
    sliding_window: int | None = None
    dtype: str = "float32"  # the checkpoint's own dtype (a torch dtype name), not necessarily the serving dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in _ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {list(_ROPE_TYPES)}")
            missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if rope_type == "llama3" and missing:
                raise ValueError(f"rope_scaling of type 'llama3' is missing {missing}")

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a parsed ``config.json`` (transformers 4.x or 5.x layout).

        EOS ids come from ``generation_config.json`` when it names them, because that is
        what ``transformers.generate`` stops on; otherwise from ``config.json``.
        """
        architecture = _hf_architecture(config)
        hidden_size = _required(config, "hidden_size")
        num_heads = _required(config, "num_attention_heads")
        rope_theta, rope_scaling = _hf_rope(config)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act {config['hidden_act']!r} is not supported; only 'silu' is")
        attention_bias = bool(config.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        generation_config = generation_config or {}
        eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
        bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_required(config, "intermediate_size"),
            num_layers=_required(config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            vocab_size=_required(config, "vocab_size"),
            max_position_embeddings=_required(config, "max_position_embeddings"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or attention_bias,
            o_proj_bias=not is_qwen2 and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=_hf_sliding_window(config),
            dtype=_hf_dtype(config),
            eos_token_ids=_id_tuple(eos),
            bos_token_id=bos,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """This config as a ``config.json`` that ``from_hf_config`` and transformers read back
        (``fastsched export-hf``)."""
        model_type = next((t for t, arch in _MODEL_TYPES.items() if arch == self.architecture), None)
        qwen2 = self.architecture == "Qwen2ForCausalLM"
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_proj_bias if not qwen2 else False,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
        }
        if self.sliding_window is not None:
            config["sliding_window"] = self.sliding_window
        if self.eos_token_ids:
            config["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        return config

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF key/value metadata (llama.cpp names) and the file's tensor names.

        llama.cpp drops ``tie_word_embeddings``: a file without ``output.weight`` is tied.
        """
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        if "rope_freqs.weight" in tensor_names:
            raise ValueError("GGUF tensor rope_freqs.weight (llama.cpp's Llama-3.1 rope scaling) is not supported")

        def key(name: str) -> Any:
            full = f"{arch}.{name}"
            if full not in metadata:
                raise ValueError(f"GGUF metadata is missing {full}")
            return metadata[full]

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
        vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
        architecture = GGUF_ARCHITECTURES[arch]
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab_size),
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            dtype=_GGUF_FILE_TYPE_DTYPES.get(metadata.get("general.file_type"), "float16"),
            eos_token_ids=_id_tuple(metadata.get("tokenizer.ggml.eos_token_id")),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        )


def _required(config: dict[str, Any], name: str) -> Any:
    if config.get(name) is None:
        raise ValueError(f"config.json is missing required field {name!r}")
    return config[name]


def _hf_architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures")
    if architectures:
        return architectures[0]
    model_type = config.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"config.json names no architectures and its model_type {model_type!r} is not one of {sorted(_MODEL_TYPES)}"
    )


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4; ``type`` is the older spelling of ``rope_type``)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling.pop("rope_theta", None)
    return theta, {"rope_type": rope_type, **scaling}


def _hf_sliding_window(config: dict[str, Any]) -> int | None:
    # Qwen2/Qwen3 write a sliding_window value but only use it with use_sliding_window.
    if config.get("use_sliding_window") is False:
        return None
    return config.get("sliding_window")


def _hf_dtype(config: dict[str, Any]) -> str:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"config.json dtype {name!r} is not one of {sorted(_DTYPES)}")
    return name


def _id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
