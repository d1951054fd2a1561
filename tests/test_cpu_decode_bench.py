"""bench/cpu_decode.py sizes fastsched's KV pool as llama.cpp's context is sized in the same
bench (blocks for the largest batch), so the two engines' RSS count comparable KV caches."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cpu_decode.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("cpu_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_pool_holds_the_largest_batch_and_the_longest_prompt():
    bench = load_bench()
    args = argparse.Namespace(batches=[1, 8, 32], tokens=64, prompt_len=512, kv_cache_memory=None)
    pool = bench.kv_pool_args(args, 16)
    # 32 sequences of (16 prompt + 64 new) tokens = 5 blocks each; + the null block.
    assert pool == {"num_gpu_blocks": 32 * 5 + 1, "max_model_len": 528}
    args.batches = [1]  # then the 513-token prefill sets the floor: one max_model_len request
    assert bench.kv_pool_args(args, 16)["num_gpu_blocks"] == 528 // 16 + 1


def test_kv_cache_memory_overrides_the_sizing():
    bench = load_bench()
    args = argparse.Namespace(batches=[32], tokens=128, prompt_len=512, kv_cache_memory=2**29)
    assert bench.kv_pool_args(args, 16) == {"kv_cache_memory": 2**29, "max_model_len": 528}


def test_rounds_append_each_measurement_and_the_summary_gives_the_ratio_of_medians():
    bench = load_bench()
    results: dict = {}
    bench.merge_round(results, {"engine": "fastsched", "decode_1_tok_s": [100.0], "rss_mib": 800.0})
    bench.merge_round(results, {"engine": "llama.cpp", "decode_1_tok_s": [90.0], "rss_mib": 200.0})
    bench.merge_round(results, {"engine": "fastsched", "decode_1_tok_s": [120.0, 110.0], "rss_mib": 790.0})
    assert results["fastsched"]["decode_1_tok_s"] == [100.0, 120.0, 110.0]
    assert results["fastsched"]["rss_mib"] == 790.0
    table = bench.summarize(list(results.values()))
    assert "| decode_1_tok_s | 100.0–120.0 | 90.0 | 1.22× |" in table
    assert "| rss_mib | 790 | 200 | 3.95× |" in table
