"""Model definitions: one Llama-family decoder, its config, and the architecture registry."""

from fastsched.models.config import ModelConfig
from fastsched.models.llama import LlamaForCausalLM
from fastsched.models.registry import get_model_class, supported_architectures

__all__ = ["LlamaForCausalLM", "ModelConfig", "get_model_class", "supported_architectures"]
