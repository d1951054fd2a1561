"""The SharedStorageConnector's two figures: the prefill a warm restart saves, and what a
block costs to save and to load.

``--num-prompts`` random token-id prompts of ``--prompt-len`` tokens, greedy, one output
token each (a prefill workload), run twice on one store in a temporary directory:

- **cold**: a new ``EngineCore`` with an empty store computes every prompt and saves
  its full blocks; shutting it down waits for the saves.
- **warm**: a new ``EngineCore`` (the restart) on the same store loads what it can and
  computes the rest.

Per run: tokens computed (``StatsLogger.iteration_tokens_sum``), wall time from the first
``add_request`` to the last output, and the connector's counters. Per block:

- save: ``KVConnectorStats.save_seconds / blocks_saved`` (checksum and file write, on the
  save thread) plus ``ModelRunner.read_blocks`` (KV cache -> host) timed on its own;
- load: ``load_seconds / blocks_loaded`` (file read and checks, on the load threads)
  plus ``ModelRunner.write_blocks`` (host -> KV cache) timed on its own.

``--model`` defaults to the tiny random-weight Llama (``fastsched.tools.tiny_model``);
``--model embedded`` is the embedded SmolLM2-135M-Instruct. The last line of stdout is
one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from fastsched import SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.model_loader import load_model_config
from fastsched.tools.tiny_model import make_tiny_model

FIRST_PROMPT_TOKEN = 3  # below: the tiny model's special tokens


def run(config: EngineConfig, prompts: list[list[int]]) -> tuple[EngineCore, float]:
    core = EngineCore(config)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    while core.has_unfinished_requests():
        core.step()
    seconds = time.perf_counter() - start
    core.shutdown()
    return core, seconds


def copy_cost(core: EngineCore, num_blocks: int, repeats: int = 20) -> tuple[float, float]:
    """Median seconds per block of ``read_blocks`` and ``write_blocks`` over ``num_blocks`` blocks."""
    ids = np.arange(1, num_blocks + 1, dtype=np.uint32)
    reads, writes = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        blocks = core.runner.read_blocks(ids)
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        core.runner.write_blocks(ids, blocks)
        writes.append(time.perf_counter() - t)
    return statistics.median(reads) / num_blocks, statistics.median(writes) / num_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="HF directory, 'embedded' (SmolLM2), default: the tiny model"
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model: str | None = str(make_tiny_model(Path(tmp) / "model"))
        else:
            model = None if args.model == "embedded" else args.model
        store = Path(tmp) / "store"
        config = EngineConfig.from_kwargs(
            model=model,
            device="cpu",
            log_stats_interval=0,
            block_size=args.block_size,
            kv_cache_memory=512 * 2**20,
            kv_transfer_config={
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            },
        )
        rng = random.Random(args.seed)
        vocab_size = load_model_config(model).vocab_size
        prompts = [
            [rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(args.prompt_len)]
            for _ in range(args.num_prompts)
        ]
        cold, cold_s = run(config, prompts)
        warm, warm_s = run(config, prompts)
        read_s, write_s = copy_cost(warm, 64)
        block_bytes = next(store.rglob("*.kv")).stat().st_size
        c, w = cold.kv_transfer.stats, warm.kv_transfer.stats
        figures = {
            "model": args.model or "tiny",
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "block_size": args.block_size,
            "block_file_bytes": block_bytes,
            "cold_tokens_computed": cold.stats.iteration_tokens_sum,
            "warm_tokens_computed": warm.stats.iteration_tokens_sum,
            "cold_seconds": cold_s,
            "warm_seconds": warm_s,
            "blocks_saved": c["blocks_saved"],
            "blocks_loaded": w["blocks_loaded"],
            "save_store_us_per_block": 1e6 * c["save_seconds"] / max(c["blocks_saved"], 1),
            "load_store_us_per_block": 1e6 * w["load_seconds"] / max(w["blocks_loaded"], 1),
            "read_blocks_us_per_block": 1e6 * read_s,
            "write_blocks_us_per_block": 1e6 * write_s,
        }
    saving = 1 - figures["warm_tokens_computed"] / figures["cold_tokens_computed"]
    print(f"{'':8} {'tokens computed':>16} {'seconds':>8}")
    print(f"{'cold':8} {figures['cold_tokens_computed']:>16} {cold_s:>8.2f}")
    print(
        f"{'warm':8} {figures['warm_tokens_computed']:>16} {warm_s:>8.2f}   prefill saved: {100 * saving:.1f}%"
    )
    print(
        f"block file {block_bytes} bytes; per block: save {figures['save_store_us_per_block']:.0f} µs "
        f"(+ read_blocks {figures['read_blocks_us_per_block']:.0f} µs), load {figures['load_store_us_per_block']:.0f} "
        f"µs (+ write_blocks {figures['write_blocks_us_per_block']:.0f} µs)"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
