"""``fastsched bench serve`` end to end on a handful of requests: the real gateway and
gRPC frontend over the fake AsyncLLM of test_grpc_gateway (fast, deterministic), driven
through the CLI as a user would, checking the JSON report and the plot."""

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

from loop_thread import LoopThread, free_port  # noqa: E402
from test_grpc_gateway import MODEL, FakeAsyncLLM, FakeTokenizer  # noqa: E402

from fastsched.entrypoints.cli import main  # noqa: E402
from fastsched.frontend.admission import QueueOverflowError  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.tools.bench_serve import arrival_times, make_requests  # noqa: E402

STAT_KEYS = {"mean", "p50", "p90", "p99"}


class FakeServer:
    def __init__(self) -> None:
        self.loop = LoopThread()
        self.fake = FakeAsyncLLM(stats_names="engine", journal=[])
        self.fake.token_delay = 0.002
        port = free_port()
        self.grpc = self.loop.call(serve_frontend(self.fake, "127.0.0.1", port))
        self.url = self.loop.start_gateway(create_app([f"127.0.0.1:{port}"], MODEL, FakeTokenizer()))

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
    code = main(["bench", "serve", "--url", server.url, "--num-requests", "6", "--prompt-len", "8",
                 "--output-len", "8", "--seed", "1", "--no-progress", "--out", str(out), *args])
    assert code == 0
    return json.loads(out.read_text())


def test_bench_serve_reports_latencies_and_throughput_per_rate(server: FakeServer, fake: FakeAsyncLLM,
                                                                tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "latency.png"
    report = bench(server, tmp_path, "--qps", "50", "inf", "--plot", str(plot))
    assert report["model"] == MODEL and report["config"]["num_requests"] == 6
    want_tokens = sum(r.max_tokens for r in make_requests(6, 8, 8, 1, (10, 250)))
    assert [r["qps"] for r in report["results"]] == [50.0, "inf"]
    for r in report["results"]:
        assert r["num_requests"] == 6 and r["completed"] == 6 and r["num_rejected"] == 0 and r["failed"] == 0
        assert r["total_output_tokens"] == want_tokens
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(r[key]) == STAT_KEYS and r[key]["p50"] > 0, key
            assert r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
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
    assert r["completed"] == 0 and r["failed"] == 0
    assert r["rejected"] == {"max_num_queued_reqs": 6} and r["num_rejected"] == 6
    assert r["rejection_latency_ms"]["p50"] > 0 and r["ttft_ms"]["p50"] is None


def test_bench_serve_arrivals_are_seeded_poisson() -> None:
    times = arrival_times(2000, 10.0, seed=3)
    assert times == arrival_times(2000, 10.0, seed=3) and times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(0.1, rel=0.1)  # mean gap 1/qps
    assert arrival_times(3, float("inf"), seed=3) == [0.0, 0.0, 0.0]
    lengths = [len(r.prompt_token_ids) for r in make_requests(500, 100, 10, 0, (10, 250))]
    assert min(lengths) >= 50 and max(lengths) <= 150
