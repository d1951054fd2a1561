"""Turning a model path into a config, a tokenizer and a ready model.

A path is a Hugging Face checkpoint directory or a ``.gguf`` file; ``None`` means the
embedded default model. The frontend needs only ``load_tokenizer`` (no weights read),
the engine ``load_model_config`` and ``load_model``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fastsched.model_loader import hf
from fastsched.model_loader.default_model import default_model_path
from fastsched.model_loader.gguf import GGUFFile
from fastsched.model_loader.tokenizer import Tokenizer
from fastsched.models.config import ModelConfig
from fastsched.models.llama import LlamaForCausalLM
from fastsched.models.registry import get_model_class

__all__ = [
    "Tokenizer",
    "default_model_path",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "resolve_model_path",
]


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (expected a checkpoint directory or a .gguf file)")
    return path


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_model_config(model: str | os.PathLike[str] | None) -> ModelConfig:
    path = resolve_model_path(model)
    return GGUFFile(path).config() if _is_gguf(path) else hf.read_config(path)


def load_tokenizer(model: str | os.PathLike[str] | None) -> Tokenizer:
    path = resolve_model_path(model)
    if _is_gguf(path):
        return GGUFFile(path).tokenizer()
    return hf.read_tokenizer(path, hf.read_config(path))


def load_model(
    model: str | os.PathLike[str] | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """Build the model for ``model`` in eval mode with weights cast to ``dtype`` on ``device``;
    its ``config`` attribute is the ``ModelConfig`` (EOS ids, ``max_position_embeddings``...)."""
    path = resolve_model_path(model)
    if _is_gguf(path):
        gguf_file = GGUFFile(path)
        config = gguf_file.config()
        weights = gguf_file.iter_weights(config)
    else:
        config = hf.read_config(path)
        hf.weight_files(path)  # a missing file fails before the model is allocated
        weights = hf.iter_weights(path)
    model_cls = get_model_class(config.architecture)  # an unsupported one fails before any weight is read
    # Built on the meta device so no memory is spent on a random init that the weights overwrite.
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype).to_empty(device=torch.device(device))
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval()
