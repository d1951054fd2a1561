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
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# ``model_type`` -> class name, for config.json files saved without ``architectures``.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

_ROPE_TYPES = ("default", "llama3", "linear", "longrope")
_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Every how many layers Gemma's global one comes (the others slide), where a file does not list them:
# transformers' default sliding_window_pattern and llama.cpp's swa pattern.
_GEMMA_WINDOW_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
# Gemma's local RoPE base (transformers' and llama.cpp's default for Gemma 3's sliding layers).
_GEMMA3_LOCAL_THETA = 10000.0
# llama.cpp's block counts of Gemma 2/3 27B, the size whose attention scale is 1/sqrt(hidden / heads).
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}

_DTYPES = ("float32", "float16", "bfloat16")

# GGUF ``general.file_type`` values whose weights are stored unquantized (llama.cpp's LLAMA_FTYPE).
_GGUF_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder: the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3)
    and Gemma 2/3 (whose (1 + w) norms, post-norms and scaled embeddings the architecture
    implies, :data:`GEMMA_ARCHITECTURES`)."""

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
    # "high_freq_factor": ..., "original_max_position_embeddings": ...}, {"rope_type": "linear",
    # "factor": ...} or {"rope_type": "longrope", "short_factor": [...], "long_factor": [...],
    # "original_max_position_embeddings": ..., optionally "factor", "attention_factor"}.
    # With layer_types it applies to the full-attention layers only (Gemma 3).
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dims RoPE rotates
    hidden_act: str = "silu"  # the MLP's gate activation (gelu_pytorch_tanh: GeGLU, Gemma)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama/Qwen3 when configured)
    o_proj_bias: bool = False  # bias on the attention output (Llama/Qwen3 ``attention_bias``)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    # Windowed attention: a query sees the last sliding_window keys, itself included. Without
    # layer_types every layer slides (Mistral, Phi-3); with it the "sliding_attention" ones.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer one of LAYER_TYPES (Gemma 2/3)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers when they have their own
    query_pre_attn_scalar: float | None = None  # scale query_pre_attn_scalar**-0.5 (else head_dim's)
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    dtype: str = (
        "float32"  # the checkpoint's own dtype (a torch dtype name), not necessarily the serving dtype
    )
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
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
            self._check_rope_scaling(self.rope_scaling)
        if not 0.0 < self.partial_rotary_factor <= 1.0 or int(self.head_dim * self.partial_rotary_factor) < 2:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1] and rotate at least 2 dims of "
                f"head_dim {self.head_dim}, got {self.partial_rotary_factor}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {list(_ACTIVATIONS)}"
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        if self.layer_types:
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if len(self.layer_types) != self.num_layers or bad:
                raise ValueError(
                    f"layer_types must name one of {list(LAYER_TYPES)} for each of the "
                    f"{self.num_layers} layers, got {list(self.layer_types)}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_theta",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config field {name} must be positive or null, got {value!r}")

    def _check_rope_scaling(self, scaling: dict[str, Any]) -> None:
        rope_type = scaling.get("rope_type")
        if rope_type not in _ROPE_TYPES or rope_type == "default":
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {list(_ROPE_TYPES)}")
        missing = [k for k in _ROPE_KEYS[rope_type] if scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling of type {rope_type!r} is missing {missing}")
        if rope_type == "longrope":
            half = int(self.head_dim * self.partial_rotary_factor) // 2
            for key in ("short_factor", "long_factor"):
                if len(scaling[key]) != half:
                    raise ValueError(
                        f"rope_scaling {key} has {len(scaling[key])} values; the rotated dims need {half}"
                    )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier key)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """The factor on q·k: ``query_pre_attn_scalar**-0.5`` where given (Gemma), else
        ``head_dim**-0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        num_layers = _required(config, "num_hidden_layers")
        rope_theta, rope_scaling, local_theta = _hf_rope(config)
        rope_params = config.get("rope_parameters") or {}
        gemma = architecture in GEMMA_ARCHITECTURES
        # Gemma's configs name the activation hidden_activation (hidden_act may be stale there).
        hidden_act = (config.get("hidden_activation") if gemma else None) or config.get("hidden_act", "silu")
        if config.get("use_bidirectional_attention"):
            raise ValueError("config.json use_bidirectional_attention (an encoder) is not supported")
        attention_bias = bool(config.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        generation_config = generation_config or {}
        eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
        bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
        layer_types = tuple(config.get("layer_types") or ())
        if gemma and not layer_types:
            pattern = config.get("sliding_window_pattern") or _GEMMA_WINDOW_PATTERN[architecture]
            layer_types = _window_pattern(num_layers, pattern)
        elif is_qwen and not layer_types and _hf_sliding_window(config) is not None:
            first = config.get("max_window_layers", 28)  # the layers from max_window_layers on slide
            layer_types = tuple(
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            )
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_required(config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            vocab_size=_required(config, "vocab_size"),
            max_position_embeddings=_required(config, "max_position_embeddings"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=float(
                config.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
            ),
            hidden_act=hidden_act,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            attention_bias=is_qwen2 or attention_bias,
            o_proj_bias=not is_qwen2 and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=_hf_sliding_window(config),
            layer_types=layer_types,
            rope_local_theta=local_theta if architecture == "Gemma3ForCausalLM" else None,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
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
            "hidden_act": self.hidden_act,
            "torch_dtype": self.dtype,
        }
        if self.partial_rotary_factor != 1.0:
            config["partial_rotary_factor"] = self.partial_rotary_factor
        if self.architecture in GEMMA_ARCHITECTURES:
            config.update(
                hidden_activation=self.hidden_act,
                layer_types=list(self.layer_types),
                query_pre_attn_scalar=self.query_pre_attn_scalar,
                attn_logit_softcapping=self.attn_logit_softcapping,
                final_logit_softcapping=self.final_logit_softcapping,
            )
        if self.rope_local_theta is not None:
            config["rope_local_base_freq"] = self.rope_local_theta
        if self.architecture == "Phi3ForCausalLM":
            # transformers' Phi-3 defaults its pad id to 32000, past a smaller vocabulary; the
            # pad id is no part of this config, and LongRoPE's context is also read top-level.
            config["pad_token_id"] = None
            scaling = self.rope_scaling or {}
            if scaling.get("rope_type") == "longrope":
                config["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
        if self.sliding_window is not None:
            config["sliding_window"] = self.sliding_window
        if self.eos_token_ids:
            config["eos_token_id"] = (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
            )
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        return config

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: dict[str, Any],
        tensor_names: set[str],
        rope_factors: dict[str, list[float]] | None = None,
    ) -> ModelConfig:
        """Build from GGUF key/value metadata (llama.cpp names) and the file's tensor names;
        ``rope_factors``: the values of Phi-3's ``rope_factors_short``/``_long`` tensors.

        llama.cpp drops ``tie_word_embeddings``: a file without ``output.weight`` is tied. It
        keeps no per-layer window list for Gemma: the layer pattern is its fixed one (every
        2nd layer global in Gemma 2, every 6th in Gemma 3), and the attention scale is
        1/sqrt(head_dim) but for the 27B models' 1/sqrt(hidden / heads).
        """
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        if "rope_freqs.weight" in tensor_names:
            raise ValueError(
                "GGUF tensor rope_freqs.weight (llama.cpp's Llama-3.1 rope scaling) is not supported"
            )

        def key(name: str) -> Any:
            full = f"{arch}.{name}"
            if full not in metadata:
                raise ValueError(f"GGUF metadata is missing {full}")
            return metadata[full]

        def optional(name: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{name}", default)

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_layers = int(key("block_count"))
        head_dim = int(optional("attention.key_length", hidden_size // num_heads))
        vocab_size = optional("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
        architecture = GGUF_ARCHITECTURES[arch]
        gemma = architecture in GEMMA_ARCHITECTURES
        layer_types: tuple[str, ...] = ()
        scalar = None
        if gemma:
            layer_types = gemma_layer_types(architecture, num_layers)
            scalar = hidden_size // num_heads if num_layers == _GEMMA_27B_BLOCKS[arch] else head_dim
            if optional("attention.scale") is not None:
                scalar = float(optional("attention.scale")) ** -2
        rotated = optional("rope.dimension_count")
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(optional("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab_size),
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(optional("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(arch, metadata, rope_factors or {}),
            partial_rotary_factor=1.0 if rotated is None else int(rotated) / head_dim,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sliding_window=None
            if optional("attention.sliding_window") is None
            else int(optional("attention.sliding_window")),
            layer_types=layer_types,
            rope_local_theta=(
                float(optional("rope.freq_base_swa", _GEMMA3_LOCAL_THETA)) if arch == "gemma3" else None
            ),
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=optional("attn_logit_softcapping"),
            final_logit_softcapping=optional("final_logit_softcapping"),
            dtype=_GGUF_FILE_TYPE_DTYPES.get(metadata.get("general.file_type"), "float16"),
            eos_token_ids=_id_tuple(metadata.get("tokenizer.ggml.eos_token_id")),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        )


def _gguf_rope_scaling(
    arch: str, metadata: dict[str, Any], rope_factors: dict[str, list[float]]
) -> dict[str, Any] | None:
    """llama.cpp's ``rope.scaling.*`` keys as a ``rope_scaling`` dict: ``linear`` with its
    factor, or Phi-3's LongRoPE, whose factors are tensors (``rope_factors_short``/``_long``)."""
    if rope_factors:
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is None or set(rope_factors) != {"short_factor", "long_factor"}:
            raise ValueError(
                f"GGUF LongRoPE needs rope_factors_short, rope_factors_long and "
                f"{arch}.rope.scaling.original_context_length; got {sorted(rope_factors)}, "
                f"{original}"
            )
        return {
            "rope_type": "longrope",
            **rope_factors,
            "original_max_position_embeddings": int(original),
            "attention_factor": metadata.get(f"{arch}.rope.scaling.attn_factor"),
        }
    rope_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    if rope_type != "linear":
        raise ValueError(
            f"GGUF {arch}.rope.scaling.type {rope_type!r} is not supported; supported: none, linear"
        )
    return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}


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


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """RoPE base, scaling and the sliding layers' base from either ``rope_parameters``
    (transformers 5; per layer type for Gemma 3) or ``rope_theta`` + ``rope_scaling`` +
    ``rope_local_base_freq`` (transformers 4; ``type`` is the older spelling of ``rope_type``,
    ``su`` Phi-3's older name of ``longrope``)."""
    params = dict(config.get("rope_parameters") or {})
    local_theta = float(config.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
    if "full_attention" in params:  # transformers 5's per-layer-type layout
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_parameters.sliding_attention type {local['rope_type']!r} is not "
                "supported; only 'default' is"
            )
        local_theta = float(local.get("rope_theta", local_theta))
        params = dict(params["full_attention"] or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return theta, None, local_theta
    rope_type = "longrope" if rope_type == "su" else rope_type
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    if rope_type == "longrope" and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    return theta, {"rope_type": rope_type, **scaling}, local_theta


def gemma_layer_types(architecture: str, num_layers: int) -> tuple[str, ...]:
    """Gemma's default layer types, the only ones a GGUF file can mean (llama.cpp's pattern)."""
    return _window_pattern(num_layers, _GEMMA_WINDOW_PATTERN[architecture])


def _window_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every ``pattern``-th layer global, the others sliding (Gemma's ``sliding_window_pattern``)."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


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
