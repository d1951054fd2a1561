"""``fastsched bench serve`` end to end on a handful of requests: the real gateway and
gRPC frontend over the fake AsyncLLM of test_grpc_gateway (fast, deterministic), driven
through the CLI as a user would, checking the JSON report and the plot, and vLLM's
``vllm bench serve`` flags and result file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port
from test_grpc_gateway import MODEL, FakeAsyncLLM, FakeTokenizer

from fastsched.admin import AdminSettings
from fastsched.entrypoints.cli import main
from fastsched.frontend.admission import QueueOverflowError
from fastsched.frontend.grpc_server import serve_frontend
from fastsched.gateway.app import create_app
from fastsched.tools.bench_report import RequestResult, parse_goodput, summarize
from fastsched.tools.workload import arrival_times, make_requests

METRICS = ("ttft", "tpot", "itl", "e2el")

# The keys of the result JSON that `vllm bench serve --save-result` writes, from vLLM's
# vllm/benchmarks/serve.py at commit 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1 (main; the
# `failed` key is there since v0.13), run with --goodput and --percentile-metrics
# ttft,tpot,itl,e2el, the default --metric-percentiles 99, without --save-detailed (which adds
# per-request lists) and without --metadata, --ramp-up-strategy or speculative decoding.
VLLM_SERVE_RESULT_KEYS = {
    # setup (main_async)
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    # benchmark()
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "rtfx",
    *(f"{stat}_{metric}_ms" for metric in METRICS for stat in ("mean", "median", "std", "p99")),
}
NOT_APPLICABLE = {"rtfx"}  # the inverse real-time factor of audio (ASR) benchmarks


class FakeServer:
    def __init__(self) -> None:
        self.loop = LoopThread()
        self.fake = FakeAsyncLLM(stats_names="engine", journal=[])
        self.fake.token_delay = 0.002
        port = free_port()
        # Its admin methods are on (ResetPrefixCache); the gateway of `url` offers no admin routes.
        self.grpc = self.loop.call(
            serve_frontend(self.fake, "127.0.0.1", port, admin=AdminSettings(enable_admin_api=True))
        )
        self.grpc_addr = f"127.0.0.1:{port}"
        self.url = self.loop.start_gateway(create_app([self.grpc_addr], MODEL, FakeTokenizer()))

    def close(self) -> None:
        self.loop.stop_gateways()
        self.loop.call(self.grpc.stop(0))
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def fake(server: FakeServer) -> Iterator[FakeAsyncLLM]:
    server.fake.reject = None
    yield server.fake
    server.fake.reject = None


def bench(server: FakeServer, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "results.json"
    code = main(
        [
            "bench",
            "serve",
            "--url",
            server.url,
            "--num-requests",
            "6",
            "--prompt-len",
            "8",
            "--output-len",
            "8",
            "--seed",
            "1",
            "--no-progress",
            "--out",
            str(out),
            *args,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_bench_serve_reports_latencies_and_throughput_per_rate(
    server: FakeServer, fake: FakeAsyncLLM, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    plot = tmp_path / "latency.png"
    sent_before = len(fake.journal)
    report = bench(server, tmp_path, "--qps", "50", "inf", "--plot", str(plot))
    assert report["model"] == MODEL and report["config"]["num_requests"] == 6
    assert [r["qps"] for r in report["results"]] == [50.0, "inf"]
    # Each rate draws its own prompts (seed + its position): the same ones again would be
    # prefix-cache hits that flatter every rate after the first.
    prompts = [list(p) for _, p, _, _ in fake.journal[sent_before:]]
    first, second = [
        [list(r.prompt_token_ids) for r in make_requests(6, 8, 8, seed, (10, 250))] for seed in (1, 2)
    ]
    assert sorted(prompts[:6]) == sorted(first) and sorted(prompts[6:]) == sorted(second)
    assert not set(map(tuple, first)) & set(map(tuple, second))
    for i, r in enumerate(report["results"]):
        want_tokens = sum(q.max_tokens for q in make_requests(6, 8, 8, 1 + i, (10, 250)))
        assert r["num_requests"] == 6 and r["completed"] == 6 and r["num_rejected"] == 0 and r["failed"] == 0
        assert r["total_output_tokens"] == want_tokens and r["total_input_tokens"] > 0
        assert "prefix_cache_hit_rate" in r  # the fake's counters do not move: None
        assert r["request_throughput"] > 0 and r["output_throughput"] > r["request_throughput"]
        assert r["total_token_throughput"] > r["output_throughput"] and r["request_goodput"] is None
        for metric in METRICS:
            assert r[f"median_{metric}_ms"] > 0 and r[f"std_{metric}_ms"] >= 0, metric
            assert (
                r[f"median_{metric}_ms"]
                == r[f"p50_{metric}_ms"]
                <= r[f"p90_{metric}_ms"]
                <= r[f"p99_{metric}_ms"]
            )
        assert r["median_ttft_ms"] <= r["median_e2el_ms"]
        assert 1 <= r["max_concurrent_requests"] <= 6 and r["max_output_tokens_per_s"] > 0
        assert len(r["e2e_latencies_s"]) == 6 and r["e2e_latencies_s"] == sorted(r["e2e_latencies_s"])
        assert r["rejection_latency_ms"]["p50"] is None
    printed = capsys.readouterr().out
    assert "| QPS" in printed and "| 50.0" in printed and "| inf" in printed
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_counts_503s_by_reason(server: FakeServer, fake: FakeAsyncLLM, tmp_path: Path) -> None:
    fake.reject = QueueOverflowError("queue full: 4 requests in flight would exceed max_num_queued_reqs (4)")
    report = bench(server, tmp_path, "--qps", "100")
    (r,) = report["results"]
    # vLLM's `failed` counts every request not completed; ours say why.
    assert r["completed"] == 0 and r["failed"] == 6 and r["num_errors"] == 0
    assert r["rejected"] == {"max_num_queued_reqs": 6} and r["num_rejected"] == 6
    assert r["rejection_latency_ms"]["p50"] > 0 and r["median_ttft_ms"] is None


def test_reset_prefix_cache_empties_the_servers_cache_before_each_rate(
    server: FakeServer,
    fake: FakeAsyncLLM,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    out = str(tmp_path / "r.json")
    argv = [
        "bench",
        "serve",
        "--num-requests",
        "2",
        "--prompt-len",
        "4",
        "--output-len",
        "2",
        "--no-progress",
        "--qps",
        "inf",
        "inf",
        "--reset-prefix-cache",
        "--out",
        out,
    ]
    assert main([*argv, "--url", server.url]) == 1  # this gateway has no admin routes
    assert "start it with --enable-admin-api" in capsys.readouterr().err
    resets = []

    async def reset_prefix_cache() -> None:
        resets.append(len(fake.journal))

    monkeypatch.setattr(fake, "reset_prefix_cache", reset_prefix_cache, raising=False)
    admin = server.loop.start_gateway(
        create_app([server.grpc_addr], MODEL, FakeTokenizer(), admin=AdminSettings(enable_admin_api=True))
    )
    start = len(fake.journal)
    assert main([*argv, "--url", admin]) == 0
    assert resets == [start, start + 2]  # before each rate's requests
    assert json.loads(Path(out).read_text())["config"]["reset_prefix_cache"] is True


def test_reset_prefix_cache_sends_the_admin_key_which_the_api_key_never_replaces(
    server: FakeServer,
    fake: FakeAsyncLLM,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    async def reset_prefix_cache() -> None:
        pass

    monkeypatch.setattr(fake, "reset_prefix_cache", reset_prefix_cache, raising=False)
    admin = server.loop.start_gateway(
        create_app(
            [server.grpc_addr],
            MODEL,
            FakeTokenizer(),
            admin=AdminSettings(enable_admin_api=True, admin_api_key="sk-admin"),
        )
    )
    argv = [
        "bench",
        "serve",
        "--url",
        admin,
        "--num-requests",
        "1",
        "--prompt-len",
        "4",
        "--output-len",
        "2",
        "--no-progress",
        "--qps",
        "inf",
        "--reset-prefix-cache",
        "--out",
        str(tmp_path / "r.json"),
    ]
    assert main(argv) == 1
    assert "POST /reset_prefix_cache answered 401" in capsys.readouterr().err
    assert main([*argv, "--admin-api-key", "sk-admin"]) == 0


def test_the_prefix_cache_hit_rate_is_read_from_two_scrapes_of_the_servers_counters() -> None:
    from fastsched.tools.bench_serve import (
        PREFIX_CACHE_HITS,
        PREFIX_CACHE_QUERIES,
        prefix_cache_counters,
        prefix_cache_hit_rate,
    )

    class Client:
        def __init__(self, queries: float, hits: float) -> None:
            self.text = (
                f'{PREFIX_CACHE_QUERIES}{{engine="0"}} {queries}\n{PREFIX_CACHE_QUERIES}{{engine="1"}} 10\n'
                f'{PREFIX_CACHE_HITS}{{engine="0"}} {hits}\n{PREFIX_CACHE_HITS}{{engine="1"}} 0\n'
            )

        async def get(self, path: str) -> tuple[int, bytes]:
            assert path == "/metrics"
            return 200, self.text.encode()

    import asyncio

    before = asyncio.run(prefix_cache_counters(Client(100, 20)))
    after = asyncio.run(prefix_cache_counters(Client(300, 170)))
    assert before == (110, 20) and after == (310, 170)
    assert prefix_cache_hit_rate(before, after) == pytest.approx(150 / 200)
    assert prefix_cache_hit_rate(before, before) is None and prefix_cache_hit_rate(None, after) is None


def test_bench_serve_arrivals_are_seeded_poisson() -> None:
    times = arrival_times(2000, 10.0, seed=3)
    assert times == arrival_times(2000, 10.0, seed=3) and times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(0.1, rel=0.1)  # mean gap 1/qps
    assert arrival_times(3, float("inf"), seed=3) == [0.0, 0.0, 0.0]
    lengths = [len(r.prompt_token_ids) for r in make_requests(500, 100, 10, 0, (10, 250))]
    assert min(lengths) >= 50 and max(lengths) <= 150


# ------------------------------------------------------------------ vLLM's flags and result file


def vllm_bench(server: FakeServer, *args: str) -> int:
    """``fastsched bench serve`` with a vLLM command line."""
    return main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "6",
            "--random-input-len",
            "8",
            "--random-output-len",
            "8",
            "--seed",
            "1",
            "--disable-tqdm",
            *args,
        ]
    )


def test_bench_serve_saves_vllms_result_json(server: FakeServer, fake: FakeAsyncLLM, tmp_path: Path) -> None:
    code = vllm_bench(
        server,
        "--request-rate",
        "50",
        "--goodput",
        "ttft:60000",
        "e2el:60000",
        "--save-result",
        "--result-dir",
        str(tmp_path / "results"),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "99",
        "--ignore-eos",
    )
    assert code == 0
    (path,) = (tmp_path / "results").iterdir()
    assert path.name.startswith(f"openai-50.0qps-{MODEL}-") and path.suffix == ".json"
    result = json.loads(path.read_text())
    missing = VLLM_SERVE_RESULT_KEYS - NOT_APPLICABLE - set(result)
    assert not missing, f"vLLM's keys missing from our result: {sorted(missing)}"
    assert (result["backend"], result["endpoint_type"], result["model_id"], result["num_prompts"]) == (
        "openai",
        "openai",
        MODEL,
        6,
    )
    assert (result["request_rate"], result["burstiness"], result["max_concurrency"]) == (50.0, 1.0, None)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["request_goodput"] == pytest.approx(
        result["request_throughput"]
    )  # every request within 60 s
    for key in (
        VLLM_SERVE_RESULT_KEYS
        - NOT_APPLICABLE
        - {"label", "tokenizer_id", "max_concurrency", "date", "endpoint_type", "backend", "model_id"}
    ):
        assert isinstance(result[key], (int, float)), key
    # Ours beside them: rejections by reason; no per-request lists without --save-detailed.
    assert result["rejected"] == {} and result["num_rejected"] == 0 and "e2e_latencies_s" not in result
    assert "p90_ttft_ms" not in result  # only the percentiles asked for


def test_bench_serve_chat_endpoint_under_max_concurrency(
    server: FakeServer, fake: FakeAsyncLLM, tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "chat.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "6",
            "--random-input-len",
            "2",
            "--random-output-len",
            "4",
            "--random-range-ratio",
            "0",
            "--max-concurrency",
            "1",
            "--request-rate",
            "inf",
            "--tokenizer",
            str(tiny_model_dir),
            "--disable-tqdm",
            "--out",
            str(out),
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "chat-result.json",
        ]
    )
    assert code == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["completed"] == 6 and r["total_output_tokens"] == 6 * 4  # range ratio 0: every length exact
    assert r["max_concurrent_requests"] == 1  # one at a time, though all were due at once
    assert r["median_ttft_ms"] > 0 and r["median_itl_ms"] > 0
    saved = json.loads((tmp_path / "chat-result.json").read_text())
    assert (saved["backend"], saved["max_concurrency"], saved["request_rate"]) == ("openai-chat", 1, "inf")
    assert saved["tokenizer_id"] == str(tiny_model_dir)


def test_bench_serve_replays_a_sharegpt_file(
    server: FakeServer, fake: FakeAsyncLLM, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from fastsched.model_loader import load_tokenizer

    conversations = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Name a queue class."},
                {"from": "gpt", "value": "A deque is a queue."},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "Say hi"}]},  # no reply: skipped
        {
            "id": "c",
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"}],
        },
        {
            "id": "d",
            "conversations": [
                {"from": "human", "value": "What is a stack?"},
                {"from": "gpt", "value": "A stack is last in, first out."},
            ],
        },
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    usable = [
        c["conversations"]
        for c in conversations
        if len(c["conversations"]) == 2
        and len(tokenizer.encode(c["conversations"][0]["value"])) >= 4
        and len(tokenizer.encode(c["conversations"][1]["value"], add_special_tokens=False)) >= 4
    ]
    assert 1 <= len(usable) < 4
    out = tmp_path / "sharegpt-report.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(dataset),
            "--tokenizer",
            str(tiny_model_dir),
            "--num-prompts",
            str(len(usable)),
            "--request-rate",
            "inf",
            "--disable-tqdm",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["completed"] == len(usable)
    assert r["total_output_tokens"] == sum(
        len(tokenizer.encode(turns[1]["value"], add_special_tokens=False)) for turns in usable
    )
    sent = {req[1] for req in fake.requests[-len(usable) :]}  # the prompts went as text
    assert sent == {turns[0]["value"] for turns in usable}


def test_bench_serve_rejects_bad_vllm_flags(server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    for args, error in (
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat"),
        (["--goodput", "ttft=5"], "--goodput"),
        (["--dataset-name", "sharegpt"], "--dataset-path"),
        (["--percentile-metrics", "ttft,latency"], "--percentile-metrics"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    ):
        assert vllm_bench(server, *args) != 0, args
        assert error in capsys.readouterr().err, args


def test_goodput_counts_requests_within_every_bound() -> None:
    assert parse_goodput(["ttft:100", "e2el:1000"]) == {"ttft": 100.0, "e2el": 1000.0}
    fast = RequestResult(200, 4, 3, output_tokens=3, ttft=0.05, e2e=0.25, itl=[0.1, 0.1])  # tpot 100 ms
    slow_start = RequestResult(200, 4, 3, output_tokens=3, ttft=0.5, e2e=0.7, itl=[0.1, 0.1])
    one_token = RequestResult(200, 4, 1, output_tokens=1, ttft=0.05, e2e=0.05)  # tpot 0, as vLLM
    rejected = RequestResult(503, 4, 3, reason="max_num_queued_reqs", e2e=0.001)
    results = [fast, slow_start, one_token, rejected]
    summary = summarize(1.0, results, 2.0, goodput=parse_goodput(["ttft:100", "tpot:100"]))
    assert summary["request_goodput"] == 2 / 2.0  # fast and one_token
    assert (summary["completed"], summary["failed"], summary["num_rejected"]) == (3, 1, 1)
    assert summary["median_tpot_ms"] == pytest.approx(100.0)  # one-token requests have no TPOT
    assert summary["max_concurrent_requests"] == 3  # all sent at 0
    assert summarize(1.0, results, 2.0, goodput={"e2el": 300.0})["request_goodput"] == 2 / 2.0


def test_range_ratio_sets_the_spread_of_lengths() -> None:
    exact = make_requests(50, 10, 6, 0, (10, 250), range_ratio=0.0)
    assert {len(r.prompt_token_ids) for r in exact} == {10} and {r.max_tokens for r in exact} == {6}
    wide = make_requests(500, 100, 10, 0, (10, 250), range_ratio=0.9)
    assert (
        min(len(r.prompt_token_ids) for r in wide) < 20 and max(len(r.prompt_token_ids) for r in wide) > 180
    )
    # The default is the ±50 % of old: the same requests as before the flag.
    assert make_requests(20, 100, 10, 3, (10, 250)) == make_requests(
        20, 100, 10, 3, (10, 250), range_ratio=0.5
    )
