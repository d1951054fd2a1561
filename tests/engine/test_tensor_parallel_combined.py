"""Tensor parallelism combined with a weight reload (S13) and the KV connector (S7
``remote_kv``) (issue 24; docs/deploy.md "Tensor parallelism"): over two gloo ranks, fp32,
greedy, the tokens are those of one rank.

- Reload: every rank loads its own shards of the new checkpoint and checks them, and all
  swap them in or none does: a checkpoint that any rank cannot load leaves every rank as it was.
- KV connector: rank 0 alone keeps the store, of whole blocks, gathered from the ranks' KV
  heads on save and scattered to them on load (``fastsched.worker.kv_blocks``), so a store
  is the same whatever ``tensor_parallel_size`` wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastsched import SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.model_loader import load_model_config
from fastsched.worker.kv_blocks import kv_heads_of

BLOCK_SIZE = 16
PROMPT_LENGTHS = (70, 37, 16, 5)  # 4, 2, 0 (the last token is computed) and 0 full blocks to load
MAX_TOKENS = 6


def _core(model_dir: Path, tp: int, **engine_args: object) -> EngineCore:
    return EngineCore(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            log_stats_interval=0,
            block_size=BLOCK_SIZE,
            dtype="float32",
            num_threads=1,
            tensor_parallel_size=tp,
            **engine_args,
        )
    )


def _generate(core: EngineCore, prompts: Sequence[Sequence[int]], prefix: str = "") -> list[list[int]]:
    tokens: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for request_id, prompt in zip(tokens, prompts):
        core.add_request(EngineCoreRequest(request_id, list(prompt), params))
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


@pytest.fixture(scope="module")
def prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    return [random_prompt(n, seed=200 + i) for i, n in enumerate(PROMPT_LENGTHS)]


# ------------------------------------------------------------------ weight reload


@pytest.fixture(scope="module")
def other_weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with noise on every tensor: other greedy tokens, same shapes."""
    out = tmp_path_factory.mktemp("tp-reload") / "model"
    out.mkdir()
    generator = torch.Generator().manual_seed(5)
    for file in tiny_model_dir.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            save_file(
                {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()},
                out / file.name,
            )
        elif file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    return out


@pytest.fixture(scope="module")
def bad_checkpoints(
    tiny_model_dir: Path,
    other_weights: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """Checkpoints a reload must refuse, leaving the old weights: none there; a truncated
    safetensors file (``SafetensorError``, which the engine once did not catch and died of);
    one that only rank 1 fails to load (:func:`rank_1_fails`)."""
    root = tmp_path_factory.mktemp("tp-bad")
    truncated = root / "truncated"
    truncated.mkdir()
    for file in tiny_model_dir.iterdir():
        if file.is_file():
            data = file.read_bytes()
            cut = data[: len(data) // 2] if file.suffix == ".safetensors" else data
            (truncated / file.name).write_bytes(cut)
    rank_1 = root / "rank-1-fails"
    rank_1.mkdir()
    for file in other_weights.iterdir():
        (rank_1 / file.name).write_bytes(file.read_bytes())
    return {"missing": root / "missing", "truncated": truncated, "rank 1": rank_1}


@pytest.fixture
def rank_1_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes started from now on fail (``KeyError``, a type the engine once let
    through) to load any checkpoint under a ``rank-1-fails`` folder: a failure on a rank
    other than 0, after rank 0 loaded its shards."""
    (tmp_path / "sitecustomize.py").write_text(
        "import fastsched.model_loader.weights as w\n"
        "_load = w.load_model\n"
        "def load_model(path, *args, tp=None, **kwargs):\n"
        "    if tp is not None and tp.rank == 1 and 'rank-1-fails' in str(path):\n"
        "        raise KeyError('injected: rank 1 cannot load')\n"
        "    return _load(path, *args, tp=tp, **kwargs)\n"
        "w.load_model = load_model\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(__file__).resolve().parents[2] / 'python'}")


def _reload_and_generate(
    model_dir: Path, other: Path, tp: int, prompts: list[list[int]], bad: dict[str, Path]
) -> list:
    core = _core(model_dir, tp)
    try:
        before = _generate(core, prompts, "a")
        core.pause("all")
        for name, path in bad.items():
            if name == "rank 1" and tp == 1:
                continue
            with pytest.raises(ValueError, match="the served ones stay") as refused:
                core.reload_weights(str(path))  # nothing changes, on any rank
            if name == "rank 1":
                assert "tensor parallel rank 1: KeyError" in str(refused.value)
            if name == "truncated":
                assert "SafetensorError" in str(refused.value)
        core.resume()
        unchanged = _generate(core, prompts, "b")
        core.pause("all")
        core.reload_weights(str(other))
        core.resume()
        after = _generate(core, prompts, "c")
    finally:
        core.shutdown()
    return [before, unchanged, after]


def test_s13_tp2_reload_gives_the_tokens_of_tp1_after_the_same_reload(
    tiny_model_dir: Path,
    other_weights: Path,
    prompts: list[list[int]],
    bad_checkpoints: dict[str, Path],
    rank_1_fails: None,
) -> None:
    one = _reload_and_generate(tiny_model_dir, other_weights, 1, prompts, bad_checkpoints)
    two = _reload_and_generate(tiny_model_dir, other_weights, 2, prompts, bad_checkpoints)
    assert two == one
    before, unchanged, after = one
    assert unchanged == before and after != before, "the reload changes the tokens, the failed ones do not"


# ------------------------------------------------------------------ KV connector


def _kv_config(store: Path) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


def test_each_rank_holds_the_kv_heads_of_its_k_proj_shard(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)  # 2 KV heads
    assert [kv_heads_of(config, r, 2) for r in range(2)] == [[0], [1]]
    assert [kv_heads_of(config, r, 4) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    assert kv_heads_of(config, 0, 1) == [0, 1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s7_tp2_warm_restart_loads_the_stored_prefixes_and_gives_the_tokens_of_tp1(
    tiny_model_dir: Path, prompts: list[list[int]], tmp_path: Path, async_scheduling: bool
) -> None:
    reference = _generate(_core(tiny_model_dir, 1), prompts)
    runs = []
    for _ in ("cold", "warm"):
        core = _core(
            tiny_model_dir, 2, kv_transfer_config=_kv_config(tmp_path), async_scheduling=async_scheduling
        )
        try:
            runs.append(
                (_generate(core, prompts), dict(core.kv_transfer.stats), core.runner.block_shards.bytes_moved)
            )
        finally:
            core.shutdown()
    (cold, cold_stats, cold_bytes), (warm, warm_stats, warm_bytes) = runs
    assert cold == warm == reference
    assert cold_stats["blocks_saved"] == len(list(tmp_path.rglob("*.kv"))) == 7
    assert warm_stats["blocks_loaded"] == 4 + 2 and warm_stats["hits"] == 3
    # Half of each whole block (the other rank's KV head) crosses the group: the 7 saved; the
    # 6 loaded and the 16-token prompt's block, computed again and read for a save the store skips.
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * load_model_config(tiny_model_dir).head_dim * 4  # 8 KiB
    assert cold_bytes == 7 * block_bytes // 2 and warm_bytes == (6 + 1) * block_bytes // 2


def test_s7_a_store_written_with_one_rank_is_loaded_by_two(
    tiny_model_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    single = _core(tiny_model_dir, 1, kv_transfer_config=_kv_config(tmp_path))
    reference = _generate(single, prompts)
    single.shutdown()
    sharded = _core(tiny_model_dir, 2, kv_transfer_config=_kv_config(tmp_path))
    try:
        assert _generate(sharded, prompts) == reference
        assert sharded.kv_transfer.stats["blocks_loaded"] == 4 + 2
    finally:
        sharded.shutdown()
