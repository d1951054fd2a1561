"""Architecture name (``config.json``'s ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from fastsched.models.gemma import GemmaForCausalLM
from fastsched.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class serving ``architecture``; a checkpoint we cannot run fails here, before any weight is read."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
