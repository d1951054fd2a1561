"""S7 ``remote_kv`` end to end: the SharedStorageConnector (``--kv-transfer-config``) with
the tiny checkpoint. Prompt KV saved by one engine is loaded by another (a restart, a
second engine) asynchronously: the scheduler skips the loading request while others
run, the tokens are those computed without a store, and a damaged file is a miss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastsched import SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.kv_connector import SharedStorageConnector
from fastsched.engine.protocol import EngineCoreRequest

BLOCK_SIZE = 16
PROMPT_LENGTHS = (70, 37, 16, 5)  # 4, 2, 0 (the last token is computed) and 0 full blocks to load
MAX_TOKENS = 6


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_core(model_dir: Path, store: Path, async_scheduling: bool = False, **engine_args: object) -> EngineCore:
    kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return EngineCore(EngineConfig.from_kwargs(model=str(model_dir), log_stats_interval=0, block_size=BLOCK_SIZE,
                                               async_scheduling=async_scheduling, kv_transfer_config=kv,
                                               **engine_args))


def generate(core: EngineCore, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Runs the prompts to the end and shuts the engine down (its saves are then on disk)."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), list(prompt), greedy()))
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    core.shutdown()
    return list(tokens.values())


def block_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.kv"))


@pytest.fixture
def prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    return [random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s7_cold_and_warm_store_give_the_greedy_tokens_of_transformers(
    tiny_model_dir, prompts, greedy_reference, tmp_path, async_scheduling: bool
) -> None:
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    cold = make_core(tiny_model_dir, tmp_path, async_scheduling)
    assert generate(cold, prompts) == expected
    assert cold.kv_transfer.stats["blocks_loaded"] == 0
    # Full blocks of prompts and outputs, each once: 70+6 -> 4, 37+6 -> 2, 16+6 -> 1.
    assert cold.kv_transfer.stats["blocks_saved"] == len(block_files(tmp_path)) == 7
    warm = make_core(tiny_model_dir, tmp_path, async_scheduling)
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 4 + 2  # never the block holding the last prompt token
    assert warm.kv_transfer.stats["hits"] == 3


def test_s7_a_4_bit_bf16_engine_saves_and_loads_its_bf16_blocks(tiny_model_dir, prompts, tmp_path) -> None:
    """4-bit weights, bf16 activations and KV: the warm engine loads the blocks the cold one
    saved (bf16 block files) and, from them, generates the cold engine's tokens."""
    weights = dict(quantization="int4", dtype="bfloat16")
    cold = make_core(tiny_model_dir, tmp_path, **weights)
    expected = generate(cold, prompts)
    assert cold.kv_transfer.stats["blocks_saved"] == len(block_files(tmp_path)) == 7
    warm = make_core(tiny_model_dir, tmp_path, **weights)
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 4 + 2


def test_s7_warm_restart_prefills_only_what_the_store_lacks(tiny_model_dir, prompts, tmp_path) -> None:
    cold = make_core(tiny_model_dir, tmp_path)
    generate(cold, prompts)
    warm = make_core(tiny_model_dir, tmp_path)
    generate(warm, prompts)
    loaded_tokens = (4 + 2) * BLOCK_SIZE
    computed = cold.stats.iteration_tokens_sum, warm.stats.iteration_tokens_sum
    assert computed[1] == computed[0] - loaded_tokens
    assert warm.scheduler.stats()["prefix_cache_hits"] == 0, "the tokens came from the store, not the local cache"


def test_s7_two_live_engines_share_a_prefix_through_the_store(tiny_model_dir, random_prompt, greedy_reference,
                                                             tmp_path) -> None:
    system = random_prompt(48, seed=1)
    first, second = system + random_prompt(9, seed=2), system + random_prompt(12, seed=3)
    a, b = make_core(tiny_model_dir, tmp_path), make_core(tiny_model_dir, tmp_path)
    a_tokens = generate_one(a, first)
    a.kv_transfer.connector.close()  # waits for a's saves; a itself stays up
    assert generate_one(b, second) == greedy_reference([second], [MAX_TOKENS])[0]
    assert a_tokens == greedy_reference([first], [MAX_TOKENS])[0]
    assert b.kv_transfer.stats["blocks_loaded"] == 3  # the shared 48-token system prompt


def generate_one(core: EngineCore, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    core.add_request(EngineCoreRequest("r", prompt, greedy(max_tokens)))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty"])
def test_s7_a_damaged_block_file_is_a_miss_and_is_saved_again(tiny_model_dir, prompts, greedy_reference, tmp_path,
                                                              damage: str) -> None:
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    generate(make_core(tiny_model_dir, tmp_path), prompts)
    victim = next(p for p in block_files(tmp_path) if p.stat().st_size > 0)
    data = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        victim.write_bytes(b"")
    warm = make_core(tiny_model_dir, tmp_path)
    assert generate(warm, prompts) == expected
    stats = warm.kv_transfer.stats
    assert stats["load_failures"] >= 1
    assert stats["blocks_loaded"] + stats["load_failures"] == 6
    assert victim.read_bytes() == data, "the recomputed block replaces the damaged file"


def test_s7_a_slow_load_is_skipped_as_remote_kv_while_other_requests_run(
    tiny_model_dir, prompts, greedy_reference, tmp_path, monkeypatch
) -> None:
    expected = greedy_reference(prompts[:2], [MAX_TOKENS] * 2)
    generate(make_core(tiny_model_dir, tmp_path), prompts[:1])
    release = threading.Event()
    read_block = SharedStorageConnector._read_block

    def slow_read(self, path, block_hash):  # the injected delay: the store answers when released
        release.wait(timeout=60)
        return read_block(self, path, block_hash)

    monkeypatch.setattr(SharedStorageConnector, "_read_block", slow_read)
    core = make_core(tiny_model_dir, tmp_path)
    core.add_request(EngineCoreRequest("stored", prompts[0], greedy()))
    core.add_request(EngineCoreRequest("other", prompts[1], greedy()))
    tokens: dict[str, list[int]] = {"stored": [], "other": []}
    while len(tokens["other"]) < MAX_TOKENS:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["stored"] == [], "the loading request waited"
    assert core.scheduler.stats()["skips_total"]["remote_kv"] >= MAX_TOKENS - 1
    release.set()
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    core.shutdown()
    assert [tokens["stored"], tokens["other"]] == expected
    assert core.kv_transfer.stats["blocks_loaded"] == 4


def test_s7_a_request_aborted_while_loading_leaves_its_load_unused(tiny_model_dir, prompts, tmp_path,
                                                                  monkeypatch) -> None:
    generate(make_core(tiny_model_dir, tmp_path), prompts[:1])
    release = threading.Event()
    read_block = SharedStorageConnector._read_block
    monkeypatch.setattr(SharedStorageConnector, "_read_block",
                        lambda self, path, h: release.wait(timeout=60) and read_block(self, path, h))
    core = make_core(tiny_model_dir, tmp_path)
    core.add_request(EngineCoreRequest("stored", prompts[0], greedy()))
    core.step()
    core.abort_requests(["stored"])
    release.set()
    core.add_request(EngineCoreRequest("next", prompts[1], greedy()))
    while core.has_unfinished_requests():
        core.step()
    core.shutdown()
    assert core.scheduler.num_free_blocks == core.scheduler.config.num_gpu_blocks - 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s7_blocks_filled_by_generated_tokens_are_saved_with_their_kv(
    tiny_model_dir, random_prompt, greedy_reference, tmp_path, async_scheduling: bool
) -> None:
    """The conversation's next turn (prompt + answer + more) loads the block the answer
    completed: its KV is the one the decode steps wrote, whatever step saved it."""
    prompt = random_prompt(43, seed=7)  # 2 full blocks; answer tokens 43..47 fill the third
    first = make_core(tiny_model_dir, tmp_path, async_scheduling)
    answer = generate_one(first, prompt, max_tokens=10)
    first.shutdown()
    assert first.kv_transfer.stats["blocks_saved"] == 3
    follow_up = prompt + answer + random_prompt(5, seed=8)
    second = make_core(tiny_model_dir, tmp_path, async_scheduling)
    assert generate_one(second, follow_up) == greedy_reference([follow_up], [MAX_TOKENS])[0]
    assert second.kv_transfer.stats["blocks_loaded"] == 3
