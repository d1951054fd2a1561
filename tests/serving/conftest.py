"""Serving tests: real engine processes (spawned) on the tiny model, ipc sockets under a
temporary directory, and one AsyncLLM per test on its own event loop.

Engine processes are shared by a module (they take seconds to start); every test
connects its own AsyncLLM and shuts it down. Teardown asserts no engine outlives it.
"""

from __future__ import annotations

import os

# Before transformers is imported anywhere: the tests must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    import fastsched  # noqa: F401  (installed, e.g. by maturin develop)
except ImportError:  # running from a bare checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from engine_stack import Engines, ipc_dir, launch, teardown

from fastsched.tools.tiny_model import make_tiny_model

KV_CACHE_MEMORY = 64 * 1024 * 1024


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir: Path) -> dict:
    return {
        "model": str(tiny_model_dir),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_memory": KV_CACHE_MEMORY,
        "log_stats_interval": 0.0,
    }


@pytest.fixture(scope="module")
def engines(engine_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """Two engines (D=2) and two frontend addresses (F=2), shared by a test module."""
    started = launch(engine_config, ipc_dir(tmp_path_factory, "ipc"), num_engines=2, num_frontends=2)
    try:
        yield started
    finally:
        teardown(started, expect_clean_exit=True)


@pytest.fixture
def launch_engines(
    engine_config: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Engines]]:
    """A factory of engines of a test's own, torn down after it:
    ``launch_engines(num_engines=1, num_frontends=2, **engine_config_overrides)``."""
    started: list[Engines] = []

    def factory(num_engines: int = 1, num_frontends: int = 2, **overrides: object) -> Engines:
        engines = launch(
            {**engine_config, **overrides}, ipc_dir(tmp_path_factory, "ipc"), num_engines, num_frontends
        )
        started.append(engines)
        return engines

    try:
        yield factory
    finally:
        for engines in started:
            teardown(engines)


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: Path):
    """fastsched.LLM in-process on the same model: what the served engine must reproduce."""
    from fastsched import LLM

    return LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        kv_cache_memory=KV_CACHE_MEMORY,
        log_stats_interval=0.0,
    )
