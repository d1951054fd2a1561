"""The sampling defaults a checkpoint ships: ``generation_config.json`` of a Hugging Face
directory, or the ``general.sampling.*`` keys of a GGUF file. A request that leaves a
parameter out gets the model's value (as vLLM does with ``--generation-config auto``);
``--generation-config vllm`` keeps fastsched's own defaults instead."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fastsched.model_loader import is_gguf, open_gguf, resolve_model_path

# generation_config.json key -> SamplingParams field (vLLM reads the same ones)
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = {"top_k", "max_tokens"}


def load_generation_defaults(
    model: str | os.PathLike[str] | None, source: str = "auto"
) -> dict[str, float | int]:
    """The model's sampling defaults as SamplingParams fields. ``source``: ``auto`` (the
    model's own), ``vllm`` (none), or a directory holding a ``generation_config.json``."""
    if source == "vllm":
        return {}
    if source != "auto":
        return _from_hf_file(Path(source) / "generation_config.json", required=True)
    path = resolve_model_path(model)
    if is_gguf(path):
        meta = open_gguf(path).metadata
        return _typed({field: meta[key] for key, field in _GGUF_KEYS.items() if key in meta})
    return _from_hf_file(path / "generation_config.json", required=False)


def _from_hf_file(file: Path, required: bool) -> dict[str, float | int]:
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"--generation-config: no generation_config.json in {file.parent}")
        return {}
    config: dict[str, Any] = json.loads(file.read_text())
    return _typed({field: config[key] for key, field in _HF_KEYS.items() if config.get(key) is not None})


def _typed(values: dict[str, Any]) -> dict[str, float | int]:
    return {k: int(v) if k in _INT_FIELDS else float(v) for k, v in values.items()}
