"""``/metrics`` speaks vLLM's metrics (issue 13): the families, their labels and bucket
layouts, how each process's counts travel (engine -> frontend -> gateway) and add up, and
``promtool check metrics`` over a page with every family filled. No processes: the
frontends' ``GetStats`` answers are built with the real ``stats_to_proto``.

Bucket layouts are vLLM's (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (requirements-serve.txt)")
pytest.importorskip("grpc_tools", reason="the gRPC stubs are generated with grpcio-tools")

from promtool import lint_problems

from fastsched.engine import protocol
from fastsched.engine.protocol import ITERATION_TOKENS_BUCKETS
from fastsched.engine.stats import StatsLogger
from fastsched.frontend.request_metrics import (
    EngineRequestMetrics,
    LatencyHistograms,
    build_1_2_5_buckets,
)
from fastsched.frontend.stats import stats_to_proto
from fastsched.gateway.metrics import render
from fastsched.process_stats import read_process_stats
from fastsched.tools.metrics_snapshot import parse_metrics

MODEL = "served-name"
VLLM_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


# ------------------------------------------------------------------ the parts


def test_token_count_buckets_are_vllms_1_2_5_up_to_max_model_len() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert build_1_2_5_buckets(1) == (1,)


def test_phases_of_a_finished_completion_are_vllms() -> None:
    """queue = scheduled - arrival, prefill = first token - scheduled, decode = last token -
    first token, inference = last token - scheduled."""
    m = EngineRequestMetrics(max_model_len=1000)
    m.observe_finished(
        "length", num_prompt_tokens=7, num_generation_tokens=30, queue_time=0.25, ttft=0.75, end=2.0
    )
    h = m.histograms
    assert {
        name: h[name].sum
        for name in (
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
        )
    } == {
        "request_queue_time_seconds": 0.25,
        "request_prefill_time_seconds": 0.5,
        "request_decode_time_seconds": 1.25,
        "request_inference_time_seconds": 1.75,
    }
    assert (h["request_prompt_tokens"].sum, h["request_generation_tokens"].sum) == (7, 30)
    assert h["request_queue_time_seconds"].upper_bounds == VLLM_REQUEST_LATENCY_BUCKETS
    # Aborted while waiting: a success of reason abort, its tokens, no phase it never reached.
    m.observe_finished("abort", 7, 0, queue_time=None, ttft=None, end=3.0)
    assert m.success == {"stop": 0, "length": 1, "abort": 1}
    assert (h["request_prompt_tokens"].count, h["request_queue_time_seconds"].count) == (2, 1)
    # A prompt the engine refused is an error, not a finished request.
    m.observe_finished("ignored", 7, 0, None, None, 0.1)
    assert sum(m.success.values()) == 2 and h["request_prompt_tokens"].count == 2


def test_engine_counts_tokens_per_step_in_vllms_buckets_without_objects() -> None:
    assert ITERATION_TOKENS_BUCKETS == VLLM_ITERATION_TOKENS_BUCKETS
    s = StatsLogger(interval=0)
    for tokens in (1, 9, 16, 17, 100_000):
        s.on_iteration(tokens)
    assert s.iteration_tokens[:4] == [1, 0, 2, 1]  # le 1; le 8; le 16 (9 and 16); le 32 (17)
    assert s.iteration_tokens[-1] == 1 and sum(s.iteration_tokens) == 5  # +Inf
    assert s.iteration_tokens_sum == 1 + 9 + 16 + 17 + 100_000


def test_protocol_carries_iteration_tokens_process_and_cache_config() -> None:
    stats = protocol.EngineStats(
        iteration_tokens=[1] * (len(ITERATION_TOKENS_BUCKETS) + 1),
        iteration_tokens_sum=99,
        process={"cpu_seconds_total": 1.5, "pid": 42},
    )
    back = protocol.decode(protocol.encode(protocol.Heartbeat(0, stats))).stats
    assert (back.iteration_tokens, back.iteration_tokens_sum, back.process) == (
        stats.iteration_tokens,
        99,
        {"cpu_seconds_total": 1.5, "pid": 42},
    )
    info = protocol.ModelInfo("/m", "m", 64, 1000, cache_config={"block_size": "16"})
    assert protocol.decode(protocol.encode(protocol.Ready(0, info))).model_info.cache_config == {
        "block_size": "16"
    }
    import msgpack

    for bad in ({"iteration_tokens": [1, 2]}, {"process": {"cpu_seconds_total": "a lot"}}):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(msgpack.packb(["heartbeat", 0, bad]))
    with pytest.raises(protocol.ProtocolError, match="cache_config"):
        protocol.decode(
            msgpack.packb(
                [
                    "ready",
                    0,
                    {
                        "model": None,
                        "model_name": "m",
                        "max_model_len": 1,
                        "vocab_size": 1,
                        "cache_config": {"block_size": 16},
                    },
                ]
            )
        )


def test_process_stats_of_this_process() -> None:
    stats = read_process_stats()
    if stats is None:
        pytest.skip("no /proc here")
    assert stats["pid"] == os.getpid()
    assert (
        stats["resident_memory_bytes"] > 1e6
        and stats["virtual_memory_bytes"] >= stats["resident_memory_bytes"]
    )
    assert stats["cpu_seconds_total"] > 0 and 0 < stats["open_fds"] <= stats["max_fds"]
    assert read_process_stats(pid=2**22 + 12345) is None  # no such process


# ------------------------------------------------------------------ a page with everything


def engine(index: int, tokens: int, steps: int) -> dict[str, Any]:
    """An engine as AsyncLLM's ``stats()`` lists it (the freshest report has more tokens)."""
    iteration = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    iteration[3] = steps  # le 32
    return {
        "index": index,
        "num_running": 1,
        "num_waiting": 2,
        "kv_cache_usage": 0.5,
        "num_preemptions_total": 0,
        "prompt_tokens_total": tokens,
        "generation_tokens_total": tokens,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "scan_stops_total": {"no_waiting": steps},
        "last_scan_stop": "no_waiting",
        "skips_total": {"lora_slots": 0},
        "prefill_tokens_per_s": 100.0,
        "iteration_tokens": iteration,
        "iteration_tokens_sum": 20 * steps,
        "spec_decode_num_drafts": steps,
        "spec_decode_num_draft_tokens": 3 * steps,
        "spec_decode_num_accepted_tokens": 2 * steps,
        "spec_decode_num_accepted_tokens_per_pos": [steps, steps, 0] if index == 0 else [],
        "cache_config": {"block_size": "16", "num_gpu_blocks": "512", "enable_prefix_caching": "True"},
        "process": {
            "pid": 1000 + index,
            "cpu_seconds_total": 2.0,
            "resident_memory_bytes": 1e8,
            "virtual_memory_bytes": 2e8,
            "start_time_seconds": 1.7e9,
            "open_fds": 10.0,
            "max_fds": 1024.0,
        },
    }


def frontend(index: int, stale: bool) -> Any:
    """Frontend ``index``'s GetStats: both engines (an older report of them when ``stale``),
    one finished request on each engine, and TTFTs timed per engine."""
    requests = {}
    for e in (0, 1):
        m = requests[e] = EngineRequestMetrics(max_model_len=2048)
        m.observe_finished("stop" if e == 0 else "length", 10, 5, 0.5, 1.0, 2.0)
        m.observe_request(n=1, max_tokens=16)
    latencies = LatencyHistograms()
    latencies.observe("time_to_first_token_seconds", 0.05, engine=0)
    latencies.observe("time_to_first_token_seconds", 0.5, engine=1)
    latencies.observe("inter_token_latency_seconds", 0.02, times=4, engine=0)
    tokens, steps = (10, 3) if stale else (50, 7)
    stats = {
        "engines": [engine(0, tokens, steps), engine(1, tokens, steps)],
        "requests_by_engine": requests,
        "admission_rejections_total": {"max_num_queued_reqs": 1},
        "admission_queued_tokens_limit": 100,
        "frontend_index": index,
    }
    return stats_to_proto(stats, latencies)


def full_page() -> str:
    return render([frontend(0, stale=False), frontend(1, stale=True)], MODEL).decode()


def test_every_family_has_model_name_and_engine_level_ones_engine() -> None:
    page = parse_metrics(full_page(), 0.0)
    frontend_level = {"fastsched:admission_rejections_total", "fastsched:admission_queued_tokens_limit"}
    names = {name for name in page.samples if name.startswith("fastsched:")} | set(page.histograms)
    assert len(names) > 25
    for name, samples in page.samples.items():
        if name.startswith("fastsched:"):
            for s in samples:
                assert s.labels["model_name"] == MODEL, name
                assert ("engine" in s.labels) == (name not in frontend_level), name
    text = full_page()
    for name in page.histograms:
        bucket_lines = [line for line in text.splitlines() if line.startswith(name + "_bucket{")]
        assert bucket_lines and all(
            f'model_name="{MODEL}"' in line and 'engine="' in line for line in bucket_lines
        )


def test_request_families_add_up_over_frontends_per_engine() -> None:
    page = parse_metrics(full_page(), 0.0)
    success = {
        (s.labels["engine"], s.labels["finished_reason"]): s.value
        for s in page.samples["fastsched:request_success_total"]
    }
    assert success == {
        ("0", "stop"): 2,
        ("0", "length"): 0,
        ("0", "abort"): 0,
        ("1", "stop"): 0,
        ("1", "length"): 2,
        ("1", "abort"): 0,
    }
    for name in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
    ):
        assert page.histograms[f"fastsched:{name}"].count == 4, name  # 2 frontends x 2 engines
    assert page.histograms["fastsched:request_prefill_time_seconds"].sum == 4 * 0.5
    prompt = page.histograms["fastsched:request_prompt_tokens"]
    assert prompt.upper_bounds == (*map(float, build_1_2_5_buckets(2048)), math.inf)
    assert page.histograms["fastsched:request_params_n"].upper_bounds == (1, 2, 5, 10, 20, math.inf)
    assert page.histograms["fastsched:time_to_first_token_seconds"].count == 4
    assert page.histograms["fastsched:inter_token_latency_seconds"].count == 8


def test_engine_families_take_each_engine_once_from_its_freshest_report() -> None:
    text = full_page()
    page = parse_metrics(text, 0.0)
    iteration = page.histograms["fastsched:iteration_tokens_total"]
    assert iteration.upper_bounds == (*map(float, VLLM_ITERATION_TOKENS_BUCKETS), math.inf)
    assert (iteration.count, iteration.sum) == (2 * 7, 2 * 7 * 20)  # the fresh reports only
    assert f'fastsched:iteration_tokens_total_bucket{{engine="1",le="32.0",model_name="{MODEL}"}} 7.0' in text
    info = page.samples["fastsched:cache_config_info"]
    assert [
        (s.labels["engine"], s.labels["block_size"], s.labels["num_gpu_blocks"], s.value) for s in info
    ] == [("0", "16", "512", 1.0), ("1", "16", "512", 1.0)]
    assert page.value("fastsched:generation_tokens_total", engine="1") == 50
    assert page.value("fastsched:admission_rejections_total") == 2  # summed over frontends
    assert page.value("fastsched:admission_queued_tokens_limit", model_name=MODEL) == 200


def test_spec_decode_counters_are_vllms_per_engine_that_speculates() -> None:
    page = parse_metrics(full_page(), 0.0)
    # Engine 0 speculates (its fresh report: 7 steps); engine 1 does not and has no series.
    for name, value in (("num_drafts", 7), ("num_draft_tokens", 21), ("num_accepted_tokens", 14)):
        samples = page.samples[f"fastsched:spec_decode_{name}_total"]
        assert [(s.labels["engine"], s.value) for s in samples] == [("0", value)], name
    per_pos = page.samples["fastsched:spec_decode_num_accepted_tokens_per_pos_total"]
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 7), ("1", 7), ("2", 0)]
    stats = protocol.EngineStats(spec_decode_num_drafts=2, spec_decode_num_accepted_tokens_per_pos=[2, 1])
    back = protocol.decode(protocol.encode(protocol.Heartbeat(0, stats))).stats
    assert (back.spec_decode_num_drafts, back.spec_decode_num_accepted_tokens_per_pos) == (2, [2, 1])


def test_process_families_one_series_per_process() -> None:
    page = parse_metrics(full_page(), 0.0)
    cpu = {
        (s.labels["process"], s.labels["index"]): s.value for s in page.samples["process_cpu_seconds_total"]
    }
    assert set(cpu) == {
        ("gateway", "0"),
        ("frontend", "0"),
        ("frontend", "1"),
        ("engine", "0"),
        ("engine", "1"),
    }
    assert cpu[("engine", "1")] == 2.0
    for name in (
        "resident_memory_bytes",
        "virtual_memory_bytes",
        "start_time_seconds",
        "open_fds",
        "max_fds",
    ):
        assert len(page.samples[f"process_{name}"]) == 5, name


def test_promtool_accepts_the_page_but_for_vllms_names() -> None:
    """A page with every family filled, per engine and from a frontend with no breakdown
    (engine=""), passes ``promtool check metrics`` except for the lint rules that vLLM's
    own names break (see promtool.py)."""
    page = render(
        [frontend(0, stale=False), stats_to_proto({"admission_rejections_total": {}}, LatencyHistograms())],
        MODEL,
    ).decode()
    assert 'engine=""' in page and 'engine="1"' in page
    assert lint_problems(page) == []
