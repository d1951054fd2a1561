"""Model tests run offline and share one tiny checkpoint."""

from __future__ import annotations

import os

# Before transformers is imported anywhere: the tests must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import sys
from pathlib import Path

import pytest

try:
    import fastsched  # noqa: F401  (installed, e.g. by maturin develop)
except ImportError:  # running from a bare checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


from fastsched.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def gemma3_gguf(pytestconfig: pytest.Config) -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF (tests/real_models.py), assembled once into pytest's cache."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from real_models import gemma3_gguf as locate

    cache = Path(pytestconfig.cache.mkdir("gemma3-gguf"))
    return locate(cache)


@pytest.fixture(scope="session")
def gemma3_fp32_llm(gemma3_gguf: Path):
    """The real Gemma 3 file dequantized, in float32: the reference its quantized paths are held to."""
    from fastsched import LLM

    return LLM(
        str(gemma3_gguf),
        quantization="none",
        dtype="float32",
        log_stats_interval=0,
        max_model_len=128,
        num_gpu_blocks=64,
    )  # a small KV pool: the tests run a few short prompts
