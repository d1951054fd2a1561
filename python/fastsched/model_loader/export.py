"""``fastsched export-hf``: a model (GGUF file, HF directory, or the embedded SmolLM2) as a
Hugging Face directory, so HF tools (transformers, ``vllm bench serve --tokenizer DIR``)
can use its tokenizer and config, and the launcher can hand frontends a tokenizer that
loads in milliseconds instead of parsing the GGUF file again."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fastsched.model_loader import (
    hf,
    is_gguf,
    load_model_config,
    load_tokenizer,
    open_gguf,
    resolve_model_path,
)
from fastsched.models.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"


def generation_config(config: ModelConfig) -> dict[str, Any]:
    """``generation_config.json``: what transformers stops on."""
    out: dict[str, Any] = {}
    if config.eos_token_ids:
        out["eos_token_id"] = (
            list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else config.eos_token_ids[0]
        )
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    return out


def export_tokenizer(model: str | os.PathLike[str] | None, out_dir: str | os.PathLike[str]) -> Path:
    """Config, generation config and tokenizer files of ``model`` in ``out_dir`` (no weights):
    enough for ``load_tokenizer(out_dir)`` and ``load_model_config(out_dir)``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = load_model_config(model)
    (out / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    load_tokenizer(model).save(out)
    return out


def export_hf(
    model: str | os.PathLike[str] | None, out_dir: str | os.PathLike[str], *, weights: bool
) -> Path:
    """``export_tokenizer``, plus the weights as one float32 safetensors file when ``weights``."""
    out = export_tokenizer(model, out_dir)
    if not weights:
        return out
    from safetensors.numpy import save_file

    path = resolve_model_path(model)
    config = load_model_config(model)
    if is_gguf(path):
        tensors = dict(open_gguf(path).iter_weights(config))
    else:
        tensors = _hf_weights_as_float32(path)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["torch_dtype"] = "float32"  # what was written, whatever the source held
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out


def _hf_weights_as_float32(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    tensors = {}
    for file in tqdm(hf.weight_files(path), desc="Reading weights", unit="file"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name).float().numpy()
    return tensors
