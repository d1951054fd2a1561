"""Turning a model path into a config, a tokenizer and a ready model.

A path is a Hugging Face checkpoint directory or a ``.gguf`` file; ``None`` means the
embedded default model. This package reads configs and tokenizers without torch, so a
frontend or gateway can use it; the engine builds the model with
``fastsched.model_loader.weights.load_model``.
"""

from __future__ import annotations

import functools
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
    "open_gguf",
    "resolve_model_path",
]


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The checkpoint directory or ``.gguf`` file ``model`` names: a path, a Hugging Face
    repo id already in the local cache (never downloaded), or None for the embedded model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _looks_like_repo_id(str(model)):
        return _cached_snapshot(str(model))
    raise FileNotFoundError(
        f"model path {path} does not exist (expected a checkpoint directory or a .gguf file)"
    )


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _cached_snapshot(repo_id: str) -> Path:
    """The local Hugging Face cache's copy of ``repo_id`` (offline: nothing is fetched)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local path nor in the Hugging Face cache at {constants.HF_HUB_CACHE} "
            f"(fastsched never downloads). Fetch it into that cache with `{download_command(repo_id)}`, or pass "
            "the checkpoint's directory"
        ) from None


def download_command(repo_id: str) -> str:
    """The command that puts ``repo_id`` into the cache this process reads (``HF_HUB_CACHE``
    follows ``HF_HOME``; the command names it when it is not the default)."""
    from huggingface_hub import constants

    command = f"hf download {repo_id}"
    if constants.HF_HUB_CACHE != constants.default_cache_path:
        command += f" --cache-dir {constants.HF_HUB_CACHE}"
    return command


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def open_gguf(path: Path) -> GGUFFile:
    """The file parsed once per process (config, tokenizer and weights all read it), and
    again only if it changed on disk."""
    stat = path.stat()
    return _open_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def load_model_config(model: str | os.PathLike[str] | None) -> ModelConfig:
    path = resolve_model_path(model)
    return open_gguf(path).config() if is_gguf(path) else hf.read_config(path)


def load_tokenizer(model: str | os.PathLike[str] | None) -> Tokenizer:
    path = resolve_model_path(model)
    if is_gguf(path):
        return open_gguf(path).tokenizer()
    return hf.read_tokenizer(path, hf.read_config(path))
