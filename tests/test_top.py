"""``fastsched top`` as specifications: parsing a /metrics page, the arithmetic between two
scrapes (rates, reset counters, windowed histogram quantiles as Prometheus computes them,
the red gate), missing metrics, and the command against a real HTTP server.

The worked histogram: in the window, 10 observations ≤ 0.1 s, 60 ≤ 0.5 s, 95 ≤ 1 s and
100 ≤ 2.5 s, none above. p50 has rank 50, in the (0.1, 0.5] bucket (10 below it, 50 in
it): 0.1 + 0.4 × 40/50 = 0.42 s. p99 has rank 99, in the (1, 2.5] bucket (95 below, 5
in it): 1 + 1.5 × 4/5 = 2.2 s.
"""

from __future__ import annotations

import argparse
import io
import math
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from rich.console import Console

from fastsched.entrypoints.cli import main
from fastsched.tools import top_screen
from fastsched.tools.metrics_snapshot import (
    Histogram,
    counter_increase,
    parse_metrics,
)
from fastsched.tools.top import add_top_parser
from fastsched.tools.top_screen import render_view, watch
from fastsched.tools.top_view import EngineView, Latency, TopView, is_limiting, top_view

INF = math.inf


def labels(old: bool, **extra: str) -> str:
    """``{...}`` with ``model_name`` (the current page) and ``extra``, sorted as prometheus_client writes them."""
    pairs = {**({} if old else {"model_name": "m"}), **extra}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}" if pairs else ""


def histogram_lines(
    name: str, scale: float, counts: tuple[float, ...], total: float, old: bool = False
) -> list[str]:
    """A histogram with buckets 0.1, 0.5, 1, 2.5 (times ``scale``) and +Inf; on the current
    page engine 0's, with an empty one of engine 1 beside it (parsing sums them)."""
    bounds = [f"{b * scale:g}" for b in (0.1, 0.5, 1.0, 2.5)] + ["+Inf"]
    lines = [f"# TYPE {name} histogram"]
    for engine, engine_counts, engine_total in (("0", counts, total), ("1", (0,) * len(counts), 0.0)):
        if old and engine == "1":
            continue
        at = {} if old else {"engine": engine}
        lines += [
            *(
                f"{name}_bucket{labels(old, le=le, **at)} {count}"
                for le, count in zip(bounds, engine_counts, strict=True)
            ),
            f"{name}_count{labels(old, **at)} {engine_counts[-1]}",
            f"{name}_sum{labels(old, **at)} {engine_total * scale}",
        ]
    return lines


def exposition(
    *,
    running: float = 3,
    waiting: float = 7,
    kv: float = 0.625,
    preemptions: float = 4,
    prompt: float = 1000,
    generation: float = 500,
    ttft: tuple[float, ...] = (5, 10, 20, 20, 20),
    ttft_sum: float = 8.0,
    rejected: float = 2,
    kv_blocks_stops: float = 10,
    no_waiting_stops: float = 50,
    last_stops: tuple[str, ...] = ("kv_blocks", "no_waiting"),
    queued_tokens_limit: float | None = None,
    engine_0_prefill: float | None = None,
    old: bool = False,
) -> str:
    """A /metrics page shaped like gateway/metrics.py's: two engines,
    ``last_stops[i]`` being engine i's last stop; TTFT counts in buckets 0.1, 0.5, 1, 2.5,
    +Inf, and the same counts for queue time and end-to-end latency in buckets 10 times
    shorter and 10 times longer. The TTFT-SLO valve's limit and engine 0's prefill
    throughput are there only when given. Engine-level values are split over the two
    engines (engine 1 holds 1 of each count; both have KV usage ``kv``). ``old``: the page
    of a server from before the vLLM names (no model_name and engine labels, sums over
    engines, ``prefill_throughput_tokens_per_s``)."""
    gates = ("kv_blocks", "no_waiting")

    def per_engine(name: str, value: float, kind: str, split: bool = True) -> list[str]:
        if old:
            return [f"# TYPE {name} {kind}", f"{name} {value}"]
        one = 1 if split else value
        return [
            f"# TYPE {name} {kind}",
            f"{name}{labels(old, engine='0')} {value - one if split else value}",
            f"{name}{labels(old, engine='1')} {one}",
        ]

    def stops(gate: str, count: float) -> list[str]:
        if old:
            return [f"fastsched:scheduler_scan_stops_total{labels(old, gate=gate)} {count}"]
        return [
            f"fastsched:scheduler_scan_stops_total{labels(old, engine='0', gate=gate)} {count - 1}",
            f"fastsched:scheduler_scan_stops_total{labels(old, engine='1', gate=gate)} 1",
        ]

    lines = [
        "# TYPE fastsched:admission_rejections_total counter",
        f"fastsched:admission_rejections_total{labels(old, reason='max_num_queued_reqs')} {rejected}",
        f"fastsched:admission_rejections_total{labels(old, reason='max_num_queued_tokens')} 0.0",
        f"fastsched:admission_rejections_total{labels(old, reason='engine_faulted')} 0.0",
        *per_engine("fastsched:num_requests_running", running, "gauge"),
        *per_engine("fastsched:num_requests_waiting", waiting, "gauge"),
        *per_engine("fastsched:kv_cache_usage_perc", kv, "gauge", split=False),
        *per_engine("fastsched:num_preemptions_total", preemptions, "counter"),
        *per_engine("fastsched:prompt_tokens_total", prompt, "counter"),
        *per_engine("fastsched:generation_tokens_total", generation, "counter"),
        *histogram_lines("fastsched:request_queue_time_seconds", 0.1, ttft, ttft_sum, old),
        *histogram_lines("fastsched:time_to_first_token_seconds", 1.0, ttft, ttft_sum, old),
        *histogram_lines("fastsched:e2e_request_latency_seconds", 10.0, ttft, ttft_sum, old),
        "# TYPE fastsched:scheduler_scan_stops_total counter",
        *stops("kv_blocks", kv_blocks_stops),
        *stops("no_waiting", no_waiting_stops),
        "# TYPE fastsched:scheduler_last_scan_stop gauge",
        *(
            f"fastsched:scheduler_last_scan_stop{labels(old, engine=str(engine), gate=gate)} {float(gate == last)}"
            for engine, last in enumerate(last_stops)
            for gate in gates
        ),
    ]
    if queued_tokens_limit is not None:
        lines += [
            "# TYPE fastsched:admission_queued_tokens_limit gauge",
            f"fastsched:admission_queued_tokens_limit{labels(old)} {queued_tokens_limit}",
        ]
    if engine_0_prefill is not None:
        name = "fastsched:prefill_throughput_tokens_per_" + ("s" if old else "second")
        lines += [f"# TYPE {name} gauge", f"{name}{labels(old, engine='0')} {engine_0_prefill}"]
    return "\n".join(lines) + "\n"


# Two scrapes 2 s apart: 100 new TTFTs (the worked histogram), 2000 prompt and 600
# generated tokens, 10 rejections, 40 kv_blocks stops and 10 no_waiting stops.
BEFORE = exposition()
AFTER = exposition(
    running=5,
    waiting=2,
    preemptions=6,
    prompt=3000,
    generation=1100,
    ttft=(15, 70, 115, 120, 120),
    ttft_sum=60.0,
    rejected=12,
    kv_blocks_stops=50,
    no_waiting_stops=60,
    queued_tokens_limit=20000,
    engine_0_prefill=40000,
)


def windowed(before: str = BEFORE, after: str = AFTER, seconds: float = 2.0) -> TopView:
    """The view of scrapes ``before`` and ``after`` taken ``seconds`` apart."""
    return top_view(parse_metrics(after, taken_at=100.0 + seconds), parse_metrics(before, taken_at=100.0))


# ---- parsing ----------------------------------------------------------------------------------


def test_parse_keys_counters_by_their_name_in_the_text_with_total() -> None:
    snapshot = parse_metrics(BEFORE, taken_at=0.0)
    assert snapshot.value("fastsched:prompt_tokens_total") == 1000
    assert snapshot.value("fastsched:num_requests_running") == 3
    assert snapshot.by_label("fastsched:admission_rejections_total", "reason") == {
        "max_num_queued_reqs": 2,
        "max_num_queued_tokens": 0,
        "engine_faulted": 0,
    }


def test_parse_collects_a_histogram_by_family_name_with_bounds_ascending_and_inf_last() -> None:
    histograms = parse_metrics(BEFORE, taken_at=0.0).histograms
    assert histograms["fastsched:time_to_first_token_seconds"] == Histogram(
        (0.1, 0.5, 1.0, 2.5, INF), (5, 10, 20, 20, 20), 8.0
    )
    assert histograms["fastsched:e2e_request_latency_seconds"].upper_bounds == (1, 5, 10, 25, INF)


def test_parse_of_a_metric_the_server_does_not_export_is_none() -> None:
    assert parse_metrics(BEFORE, taken_at=0.0).value("fastsched:admission_queued_tokens_limit") is None


def test_parse_rejects_a_page_that_is_not_prometheus_text() -> None:
    with pytest.raises(ValueError):
        parse_metrics("<html><body>not found</body></html>", taken_at=0.0)


# ---- histogram quantiles and windows ---------------------------------------------------------

WORKED = Histogram((0.1, 0.5, 1.0, 2.5, INF), (10, 60, 95, 100, 100), 60.0)


def test_quantile_interpolates_linearly_within_the_bucket_that_holds_the_rank() -> None:
    assert WORKED.quantile(0.5) == pytest.approx(0.42)
    assert WORKED.quantile(0.99) == pytest.approx(2.2)


def test_quantile_in_the_first_bucket_interpolates_from_zero() -> None:
    assert WORKED.quantile(0.05) == pytest.approx(0.05)  # rank 5 of 10 in (0, 0.1]


def test_quantile_whose_rank_is_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert Histogram((0.1, 1.0, INF), (1, 2, 10), 0.0).quantile(0.5) == 1.0


def test_quantile_of_an_empty_histogram_is_none() -> None:
    assert Histogram((0.1, INF), (0, 0), 0.0).quantile(0.5) is None


def test_histogram_since_an_earlier_scrape_is_the_bucket_deltas() -> None:
    earlier = Histogram(WORKED.upper_bounds, (5, 10, 20, 20, 20), 8.0)
    later = Histogram(WORKED.upper_bounds, (15, 70, 115, 120, 120), 68.0)
    assert later.since(earlier) == WORKED


def test_histogram_since_a_reset_is_everything_observed_after_it() -> None:
    earlier = Histogram(WORKED.upper_bounds, (500, 600, 700, 700, 700), 900.0)
    assert WORKED.since(earlier) == WORKED


def test_counter_increase_after_a_reset_counts_from_zero() -> None:
    assert counter_increase(30, 10) == 20
    assert counter_increase(7, 1000) == 7


# ---- the view: rates, latencies, red gate ---------------------------------------------------


def test_rates_are_counter_deltas_over_the_window() -> None:
    view = windowed()
    assert view.window_s == 2.0
    assert (view.prompt_tokens_per_s, view.generation_tokens_per_s) == (1000, 300)
    assert view.preemptions_per_s == 1
    assert view.rejections_per_s == {
        "max_num_queued_reqs": 5,
        "max_num_queued_tokens": 0,
        "engine_faulted": 0,
    }
    assert view.scan_stops_per_s == {"kv_blocks": 20, "no_waiting": 5}


def test_rates_after_a_server_restart_count_the_new_counters_from_zero() -> None:
    restarted = exposition(
        prompt=400, generation=100, ttft=(1, 2, 2, 2, 2), rejected=0, kv_blocks_stops=0, no_waiting_stops=8
    )
    view = windowed(AFTER, restarted, seconds=4.0)
    assert (view.prompt_tokens_per_s, view.generation_tokens_per_s) == (100, 25)
    assert view.scan_stops_per_s == {"kv_blocks": 0, "no_waiting": 2}
    assert view.ttft is not None and view.ttft.count == 2


def test_gauges_come_from_the_newer_scrape() -> None:
    view = windowed()
    assert (view.num_requests_running, view.num_requests_waiting, view.kv_cache_usage) == (5, 2, 0.625)
    assert view.num_preemptions == 6
    assert view.queued_tokens_limit == 20000


def test_latency_quantiles_cover_only_the_observations_in_the_window() -> None:
    view = windowed()
    assert view.ttft == Latency(100, pytest.approx(0.42), pytest.approx(2.2))
    assert view.queue_time == Latency(100, pytest.approx(0.042), pytest.approx(0.22))
    assert view.e2e_latency == Latency(100, pytest.approx(4.2), pytest.approx(22.0))


def test_ttft_without_new_observations_has_no_quantiles() -> None:
    ttft = windowed(BEFORE, BEFORE).ttft
    assert ttft is not None and (ttft.count, ttft.p50, ttft.p99) == (0, None, None)


def test_the_first_scrape_has_gauges_but_no_rates_or_latencies() -> None:
    view = top_view(parse_metrics(BEFORE, taken_at=1.0), None)
    assert view.num_requests_running == 3
    assert (view.window_s, view.prompt_tokens_per_s, view.ttft) == (None, None, None)
    assert view.rejections_per_s == {}


def test_metrics_the_server_does_not_export_are_none_not_errors() -> None:
    view = windowed("", "")
    assert (
        view.num_requests_running,
        view.kv_cache_usage,
        view.prompt_tokens_per_s,
        view.ttft,
        view.queued_tokens_limit,
    ) == (None, None, None, None, None)
    assert (view.rejections_per_s, view.scan_stops_per_s, view.engines) == ({}, {}, {})


def test_the_red_gate_is_each_engines_gate_whose_gauge_is_one() -> None:
    assert windowed().engines == {"0": EngineView("kv_blocks", 40000), "1": EngineView("no_waiting", None)}


def test_an_engine_before_its_first_step_has_no_last_gate() -> None:
    engines = windowed(BEFORE, exposition(last_stops=("none", "kv_blocks"))).engines
    assert (engines["0"].last_scan_stop, engines["1"].last_scan_stop) == (None, "kv_blocks")


def test_every_gate_but_no_waiting_is_limiting() -> None:
    assert [
        is_limiting(g) for g in ("no_waiting", "kv_blocks", "token_budget", "active_seqs", "preempted")
    ] == [False, True, True, True, True]


def gateway_page(tokens: int, ttft_counts: list[int], stops: int) -> str:
    """A page rendered by the gateway's own /metrics code from one frontend's GetStats."""
    from fastsched.gateway.metrics import render
    from fastsched.proto_gen import import_stubs

    pb, _ = import_stubs()
    latency = pb.Histogram(
        upper_bounds=[0.1, 1.0], bucket_counts=ttft_counts, sum=1.0, count=sum(ttft_counts)
    )
    engine = pb.EngineStats(
        engine_index=0,
        num_requests_running=2,
        num_requests_waiting=1,
        kv_cache_usage_perc=0.5,
        num_preemptions_total=1,
        prompt_tokens_total=tokens,
        generation_tokens_total=tokens,
        scan_stops_total={"kv_blocks": stops, "no_waiting": 1},
        last_scan_stop="kv_blocks",
    )
    stats = pb.GetStatsResponse(
        engines=[engine],
        admission_rejections_total={"max_num_queued_reqs": stops},
        request_queue_time_seconds=latency,
        time_to_first_token_seconds=latency,
        inter_token_latency_seconds=latency,
        e2e_request_latency_seconds=latency,
    )
    return render([stats]).decode()


def test_the_view_finds_every_metric_the_gateway_exports_under_the_names_it_exports() -> None:
    pytest.importorskip("grpc_tools", reason="the gRPC stubs are generated with grpcio-tools")
    view = windowed(gateway_page(100, [1, 0, 0], 3), gateway_page(300, [1, 2, 0], 7))
    assert (
        view.num_requests_running,
        view.num_requests_waiting,
        view.kv_cache_usage,
        view.num_preemptions,
    ) == (2, 1, 0.5, 1)
    assert (view.prompt_tokens_per_s, view.generation_tokens_per_s) == (100, 100)
    for latency in (view.ttft, view.queue_time, view.e2e_latency):
        assert latency is not None and latency.count == 2
    assert view.rejections_per_s["max_num_queued_reqs"] == 2
    assert view.scan_stops_per_s == {"kv_blocks": 2, "no_waiting": 0}
    assert view.engines["0"].last_scan_stop == "kv_blocks"


def test_a_server_from_before_the_vllm_names_gives_the_same_view() -> None:
    before = exposition(old=True)
    after = exposition(
        running=5,
        waiting=2,
        preemptions=6,
        prompt=3000,
        generation=1100,
        ttft=(15, 70, 115, 120, 120),
        ttft_sum=60.0,
        rejected=12,
        kv_blocks_stops=50,
        no_waiting_stops=60,
        queued_tokens_limit=20000,
        engine_0_prefill=40000,
        old=True,
    )
    assert "model_name" not in after and "tokens_per_s{" in after
    assert windowed(before, after) == windowed()


def test_kv_cache_usage_is_the_mean_over_engines() -> None:
    page = (
        'fastsched:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'fastsched:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
    )
    assert top_view(parse_metrics(page, taken_at=0.0), None).kv_cache_usage == 0.5


# ---- drawing ---------------------------------------------------------------------------------


def text_of(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_a_frame_shows_the_windowed_numbers_and_marks_the_limiting_gate() -> None:
    frame = text_of(render_view("http://x", 2.0, windowed()))
    for shown in (
        "running 5 · waiting 2",
        "62.5 %",
        "prompt 1,000.0 tok/s",
        "generation 300.0 tok/s",
        "p50 420 ms · p99 2.20 s",
        "max_num_queued_reqs 5.0",
        "20,000 tokens",
        "kv_blocks 20.0",
        "40,000",
    ):
        assert shown in frame
    limiting = [line for line in frame.splitlines() if "limiting" in line]
    assert len(limiting) == 1 and "kv_blocks" in limiting[0]


def test_a_frame_of_a_server_exporting_nothing_shows_dashes() -> None:
    frame = text_of(render_view("http://x", 1.0, windowed("", "")))
    assert "running – · waiting –" in frame
    assert "queued-tokens limit │ –" in frame


# ---- the command against a real HTTP server --------------------------------------------------


class CannedMetrics:
    """An HTTP server on a free 127.0.0.1 port answering ``GET /metrics`` with ``pages`` in
    turn (the last one repeated); a page that is an int is answered with that status."""

    def __init__(self, pages: list[str | int]) -> None:
        self.pages = list(pages)
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    page: str | int = 404
                else:
                    page = canned.pages.pop(0) if len(canned.pages) > 1 else canned.pages[0]
                status, body = (page, b"") if isinstance(page, int) else (200, page.encode())
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="canned-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
        assert not self.thread.is_alive()


Canned = Callable[[list[str | int]], CannedMetrics]


@pytest.fixture
def canned() -> Iterator[Canned]:
    """Starts CannedMetrics servers; stops them (and their threads) after the test."""
    servers: list[CannedMetrics] = []

    def start(pages: list[str | int]) -> CannedMetrics:
        servers.append(CannedMetrics(pages))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_once_prints_one_frame_from_two_scrapes(canned: Canned, capsys: pytest.CaptureFixture[str]) -> None:
    server = canned([BEFORE, AFTER])
    assert main(["top", "--url", server.url + "/", "--once", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    # The window's length is wall time, so only what does not depend on it is checked here
    # (the rates are specified above on scrapes with fixed times).
    for shown in (
        f"fastsched top · {server.url} ·",
        "running 5 · waiting 2",
        "62.5 %",
        "6 total",
        "p50 420 ms · p99 2.20 s  (100 new)",
        "20,000 tokens",
        "max_num_queued_reqs",
        "limiting",
    ):
        assert shown in out
    assert "prompt – tok/s" not in out


def test_once_against_a_server_that_is_not_there_exits_1_naming_the_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = closed_port_url()
    assert main(["top", "--url", url, "--once", "--interval", "0.01"]) == 1
    captured = capsys.readouterr()
    assert f"fastsched top: error: cannot read {url}/metrics" in captured.err
    assert captured.out == ""


def test_once_against_a_page_that_is_not_prometheus_text_exits_1(
    canned: Canned, capsys: pytest.CaptureFixture[str]
) -> None:
    server = canned(["<html><body>a web page</body></html>"])
    assert main(["top", "--url", server.url, "--once", "--interval", "0.01"]) == 1
    assert f"cannot read {server.url}/metrics: ValueError" in capsys.readouterr().err


def test_live_view_shows_a_failed_scrape_and_recovers_at_the_next_one(canned: Canned) -> None:
    import httpx

    server = canned([500, BEFORE, AFTER])
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None)
    with httpx.Client(timeout=5) as client:
        watch(client, server.url, 0.01, console, iterations=3)
    screen = console.file.getvalue()
    assert f"cannot read {server.url}/metrics: HTTPStatusError" in screen
    assert "p50 420 ms · p99 2.20 s" in screen


def test_ctrl_c_exits_cleanly_with_status_0(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(top_screen, "print_once", interrupted)
    assert main(["top", "--once", "--url", closed_port_url()]) == 0


def test_help_explains_every_flag() -> None:
    parser = argparse.ArgumentParser(prog="fastsched")
    top = add_top_parser(parser.add_subparsers())
    help_text = top.format_help()
    for flag in ("--url", "--interval", "--once", "--iterations"):
        action = next(a for a in top._actions if flag in a.option_strings)
        assert action.help and flag in help_text


def test_routing_decisions_per_second_by_cause_and_each_engines_prefix_hit_rate() -> None:
    """Issue 26: which engine and why (``--routing``), and what it bought per engine."""

    def page(prefix: float, load: float) -> str:
        return (
            "# TYPE fastsched:routing_decisions_total counter\n"
            f'fastsched:routing_decisions_total{{cause="prefix",model_name="m"}} {prefix}\n'
            f'fastsched:routing_decisions_total{{cause="load",model_name="m"}} {load}\n'
            "# TYPE fastsched:prefix_cache_queries_total counter\n"
            'fastsched:prefix_cache_queries_total{engine="0",model_name="m"} 400\n'
            'fastsched:prefix_cache_queries_total{engine="1",model_name="m"} 0\n'
            "# TYPE fastsched:prefix_cache_hits_total counter\n"
            'fastsched:prefix_cache_hits_total{engine="0",model_name="m"} 300\n'
            'fastsched:prefix_cache_hits_total{engine="1",model_name="m"} 0\n'
            "# TYPE fastsched:scheduler_last_scan_stop gauge\n"
            'fastsched:scheduler_last_scan_stop{engine="0",gate="no_waiting",model_name="m"} 1\n'
            'fastsched:scheduler_last_scan_stop{engine="1",gate="no_waiting",model_name="m"} 1\n'
        )

    view = windowed(page(10, 4), page(30, 8))
    assert view.routing_per_s == {"prefix": 10, "load": 2}
    assert view.engines["0"].prefix_cache_hit_rate == 0.75
    assert view.engines["1"].prefix_cache_hit_rate is None  # no query yet
    frame = text_of(render_view("http://x", 2.0, view))
    assert "prefix 10.0" in frame and "75.0 %" in frame
