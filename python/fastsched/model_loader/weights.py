"""Building the model and loading its weights (the engine's half of model loading; it
needs torch, unlike the rest of ``fastsched.model_loader``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from fastsched.model_loader import hf, is_gguf, open_gguf, resolve_model_path
from fastsched.models.llama import LlamaForCausalLM
from fastsched.models.registry import get_model_class

logger = logging.getLogger(__name__)


def iter_hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint as (Hugging Face name, CPU tensor in its stored dtype),
    one at a time so peak host memory stays at one tensor, with a progress bar."""
    files = hf.weight_files(path)
    handles = [safe_open(str(file), framework="pt", device="cpu") for file in files]
    total = sum(len(handle.keys()) for handle in handles)
    with tqdm(total=total, desc=f"Loading {path.name}", unit="tensor") as progress:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                progress.update(1)


def load_model(
    model: str | os.PathLike[str] | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """Build the model for ``model`` in eval mode with weights cast to ``dtype`` on ``device``;
    its ``config`` attribute is the ``ModelConfig`` (EOS ids, ``max_position_embeddings``...)."""
    start = time.monotonic()
    path = resolve_model_path(model)
    if is_gguf(path):
        gguf_file = open_gguf(path)
        config = gguf_file.config()
        weights = ((name, torch.from_numpy(w)) for name, w in gguf_file.iter_weights(config))
    else:
        config = hf.read_config(path)
        hf.weight_files(path)  # a missing file fails before the model is allocated
        weights = iter_hf_weights(path)
    model_cls = get_model_class(config.architecture)  # an unsupported one fails before any weight is read
    # Built on the meta device so no memory is spent on a random init that the weights overwrite.
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype).to_empty(device=torch.device(device))
    with torch.no_grad():
        model.load_weights(weights)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%.0fM parameters) in %.1f s", path.name, num_params / 1e6, time.monotonic() - start)
    return model.eval()
