"""Whose KV a store holds: the served weights, fingerprinted, not only their path.

A checkpoint replaced in place (new weights under the same directory) must not read
the blocks the old weights computed, and two servers that each hold a copy of the same
checkpoint should share blocks. So the store's identity covers the weights' content:
:func:`weights_fingerprint` hashes each weight file's name and size and
:data:`NUM_SAMPLES` evenly spaced samples of its bytes (a whole file when it is small),
which any retraining changes, without reading every byte of a large checkpoint at
start-up.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fastsched.engine.kv_connector.base import StoreIdentity
from fastsched.model_loader import resolve_model_path

if TYPE_CHECKING:
    import torch

    from fastsched.models.config import ModelConfig

# Files whose bytes decide what the model computes (weights, and the config that shapes them).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json",)
NUM_SAMPLES = 64
SAMPLE_BYTES = 64 * 1024


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """A SHA-256 over the checkpoint's weight files (a directory's, or one ``.gguf``):
    each file's name, size and sampled bytes, files in name order."""
    root = Path(path)
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            p
            for p in root.iterdir()
            if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES)
        )
    if not files:
        raise ValueError(f"no weight files in {root} to fingerprint for the KV store's identity")
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for offset in _sample_offsets(size):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    """Where the samples start: the whole file when it is small, else evenly spaced from
    the first byte to the last sample's end at the file's end."""
    if size <= NUM_SAMPLES * SAMPLE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return [round(i * last / (NUM_SAMPLES - 1)) for i in range(NUM_SAMPLES)]


def store_identity(
    model: str | None, model_config: ModelConfig, block_size: int, dtype: torch.dtype, hash_algo: str
) -> StoreIdentity:
    """The identity of the served model's blocks. ``model`` (a path, a cached hub id or None
    for the embedded model) names it for people; the fingerprint decides."""
    path = resolve_model_path(model)
    return StoreIdentity(
        model=str(path.absolute()),
        weights=weights_fingerprint(path),
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        hash_algo=hash_algo,
    )
