"""The KV connector leaves adapter requests alone: their prefix-cache hashes chain from the
adapter's numeric id, which a restarted engine may give to another adapter, so a stored
block could otherwise be read as another adapter's KV."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from fastsched import SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.lora import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [(7 * i) % 200 + 3 for i in range(40)]  # two full blocks of 16


def run(base_dir: Path, store: Path, lora: LoRARequest) -> tuple[list[int], dict[str, float]]:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=str(base_dir),
            enable_lora=True,
            max_loras=1,
            max_lora_rank=8,
            num_gpu_blocks=64,
            max_model_len=128,
            log_stats_interval=0,
            async_scheduling=False,
            kv_transfer_config=kv,
        )
    )
    core.add_request(EngineCoreRequest("r", PROMPT, GREEDY, lora_request=lora))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    core.shutdown()
    return tokens, core.kv_transfer.stats


def test_s7_adapter_requests_neither_save_nor_load(
    base_dir: Path, adapters: dict[str, LoRARequest], peft_reference: Callable[..., list[int]], tmp_path: Path
) -> None:
    first, stats = run(base_dir, tmp_path, adapters["full"])
    assert first == peft_reference(PROMPT, 4, "full")
    assert stats["blocks_saved"] == 0 and not list(tmp_path.rglob("*.kv"))
    # A restart where id 1 names the other adapter: its own tokens, nothing loaded.
    other = dataclasses.replace(adapters["qv"], id=adapters["full"].id)
    second, stats = run(base_dir, tmp_path, other)
    assert second == peft_reference(PROMPT, 4, "qv")
    assert stats["queries"] == 0 and stats["blocks_loaded"] == 0
