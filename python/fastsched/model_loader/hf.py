"""Reading a local Hugging Face checkpoint directory.

Expected files: ``config.json``; ``model.safetensors`` or ``model.safetensors.index.json``
with its shards; optionally ``generation_config.json`` (EOS ids) and, for the tokenizer,
``tokenizer.json`` plus ``tokenizer_config.json`` / ``chat_template.jinja``. A missing
required file fails with FileNotFoundError naming it, before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from fastsched.model_loader.tokenizer import Tokenizer
from fastsched.models.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(path: Path) -> ModelConfig:
    generation_config = path / "generation_config.json"
    return ModelConfig.from_hf_config(
        _read_json(path / "config.json"),
        _read_json(generation_config) if generation_config.is_file() else None,
    )


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights, every one checked to exist."""
    if (path / INDEX_FILE).is_file():
        weight_map: dict[str, str] = _read_json(path / INDEX_FILE)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"weight shard {file.name} listed in {INDEX_FILE} is missing from {path}")
    return files


def read_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"tokenizer.json is missing from checkpoint directory {path}")
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    tokenizer_config = path / "tokenizer_config.json"
    settings = _read_json(tokenizer_config) if tokenizer_config.is_file() else {}
    bos_token = _token_text(settings.get("bos_token"))
    eos_token = _token_text(settings.get("eos_token"))
    eos_ids = config.eos_token_ids
    if not eos_ids and eos_token is not None and backend.token_to_id(eos_token) is not None:
        eos_ids = (backend.token_to_id(eos_token),)
    return Tokenizer(
        backend,
        eos_token_ids=eos_ids,
        chat_template=_chat_template(path, settings),
        bos_token=bos_token,
        eos_token=eos_token,
    )


def _chat_template(path: Path, settings: dict[str, Any]) -> str | None:
    # transformers >= 4.43 may save the template as its own file instead of inside tokenizer_config.json.
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as a serialized AddedToken.
    return token["content"] if isinstance(token, dict) else token


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"{file.name} is missing from checkpoint directory {file.parent}")
    with file.open(encoding="utf-8") as f:
        return json.load(f)
