"""Turning a model path into a config, a tokenizer and a ready model.

A path is a Hugging Face checkpoint directory or a ``.gguf`` file; ``None`` means the
embedded default model. This package reads configs and tokenizers without torch, so a
frontend or gateway can use it; the engine builds the model with
``fastsched.model_loader.weights.load_model``.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastsched.model_loader import hf
from fastsched.model_loader.default_model import default_model_path
from fastsched.model_loader.gguf import GGUFFile
from fastsched.model_loader.tokenizer import Tokenizer
from fastsched.models.config import ModelConfig

__all__ = [
    "Tokenizer",
    "default_model_path",
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


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_model_config(model: str | os.PathLike[str] | None) -> ModelConfig:
    path = resolve_model_path(model)
    return GGUFFile(path).config() if is_gguf(path) else hf.read_config(path)


def load_tokenizer(model: str | os.PathLike[str] | None) -> Tokenizer:
    path = resolve_model_path(model)
    if is_gguf(path):
        return GGUFFile(path).tokenizer()
    return hf.read_tokenizer(path, hf.read_config(path))
