"""``fastsched top``'s screen: scrape ``/metrics``, draw frames with rich.

top_view.py does the arithmetic; this module only fetches and draws. Rates and latency
quantiles need two scrapes, so a frame covers the window since the previous one. An
unreachable or failing server is shown in the frame and retried at the next tick:
``top`` is what one runs while a server restarts.
"""

from __future__ import annotations

import logging
import sys
import time

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fastsched.tools.metrics_snapshot import Snapshot, parse_metrics
from fastsched.tools.top_view import Latency, TopView, is_limiting, top_view

# A scrape sums every frontend's GetStats; one that takes longer than this is reported as an error.
FETCH_TIMEOUT_S = 5.0
MISSING = "–"


class ScrapeError(Exception):
    """``/metrics`` could not be fetched or was not a Prometheus exposition."""


def scrape(client: httpx.Client, metrics_url: str) -> Snapshot:
    """The page, stamped with the monotonic time it arrived (rates divide by the difference)."""
    try:
        response = client.get(metrics_url)
        response.raise_for_status()
        return parse_metrics(response.text, taken_at=time.monotonic())
    except (httpx.HTTPError, ValueError) as e:
        raise ScrapeError(f"cannot read {metrics_url}: {type(e).__name__}: {e}") from e


def _number(value: float | None, fmt: str = ",.0f", unit: str = "") -> str:
    return MISSING if value is None else f"{value:{fmt}}{unit}"


def _seconds(value: float | None) -> str:
    if value is None:
        return MISSING
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _latency(latency: Latency | None) -> str:
    if latency is None:
        return MISSING
    if latency.count == 0:
        return f"{MISSING} (no new requests)"
    return f"p50 {_seconds(latency.p50)} · p99 {_seconds(latency.p99)}  ({latency.count:,.0f} new)"


def _per_second(rates: dict[str, float]) -> str:
    return "\n".join(f"{key} {rate:,.1f}" for key, rate in rates.items()) if rates else MISSING


def _engines(view: TopView) -> Table:
    """One row per engine. The gate that stopped its last scan is the red gate when it held
    requests back; it also says "limiting", for screens without colour."""
    table = Table(expand=False)
    table.add_column("engine", justify="right")
    table.add_column("last scan stop")
    table.add_column("")
    table.add_column("prefill tok/s", justify="right")
    table.add_column("prefix hits", justify="right")
    for engine, e in view.engines.items():
        prefill = _number(e.prefill_tokens_per_s, ",.0f")
        hits = _number(
            None if e.prefix_cache_hit_rate is None else e.prefix_cache_hit_rate * 100, ".1f", " %"
        )
        if e.last_scan_stop is None:
            table.add_row(engine, MISSING, "no step yet", prefill, hits)
        elif is_limiting(e.last_scan_stop):
            table.add_row(
                engine, Text(e.last_scan_stop, style="bold red"), Text("limiting", style="red"), prefill, hits
            )
        else:
            table.add_row(engine, Text(e.last_scan_stop, style="green"), "idle", prefill, hits)
    if not view.engines:
        table.add_row(MISSING, MISSING, "", MISSING, MISSING)
    return table


def render_view(url: str, interval: float, view: TopView | None, error: str | None = None) -> RenderableType:
    """One frame: the last view (if any) and the last scrape's error (if any)."""
    window = f"window {view.window_s:.2f} s" if view is not None and view.window_s else "first scrape"
    header = Text(f"fastsched top · {url} · every {interval:g} s · {window}", style="bold")
    parts: list[RenderableType] = [header]
    if error is not None:
        parts.append(Text(f"{error} (retrying every {interval:g} s)", style="bold red"))
    if view is None:
        return Group(*parts)
    table = Table(show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    kv = None if view.kv_cache_usage is None else view.kv_cache_usage * 100
    table.add_row(
        "requests",
        f"running {_number(view.num_requests_running)} · waiting {_number(view.num_requests_waiting)}",
    )
    table.add_row("KV cache usage", _number(kv, ".1f", " %"))
    table.add_row(
        "preemptions",
        f"{_number(view.num_preemptions)} total · {_number(view.preemptions_per_s, ',.1f', '/s')}",
    )
    table.add_row(
        "throughput",
        f"prompt {_number(view.prompt_tokens_per_s, ',.1f')} tok/s · "
        f"generation {_number(view.generation_tokens_per_s, ',.1f')} tok/s",
    )
    table.add_row("TTFT", _latency(view.ttft))
    table.add_row("queue time", _latency(view.queue_time))
    table.add_row("e2e latency", _latency(view.e2e_latency))
    table.add_row("rejections/s", _per_second(view.rejections_per_s))
    table.add_row("queued-tokens limit", _number(view.queued_tokens_limit, ",.0f", " tokens"))
    if view.slo_prediction_error_s:  # the goodput valve (--tpot-slo)
        table.add_row(
            "SLO prediction error",
            " · ".join(
                f"{target} {error:.3f} s" for target, error in sorted(view.slo_prediction_error_s.items())
            )
            + " (mean |predicted − measured|)",
        )
    table.add_row("scan stops/s", _per_second(view.scan_stops_per_s))
    table.add_row("routing/s", _per_second(view.routing_per_s))
    parts += [table, _engines(view)]
    return Group(*parts)


def print_once(client: httpx.Client, url: str, interval: float, console: Console) -> int:
    """Two scrapes ``interval`` apart, one frame; 1 (and the error on stderr) if either fails."""
    metrics_url = url + "/metrics"
    try:
        before = scrape(client, metrics_url)
        time.sleep(interval)
        now = scrape(client, metrics_url)
    except ScrapeError as e:
        print(f"fastsched top: error: {e}", file=sys.stderr)
        return 1
    console.print(render_view(url, interval, top_view(now, before)))
    return 0


def watch(
    client: httpx.Client, url: str, interval: float, console: Console, iterations: int | None = None
) -> None:
    """Redraws a frame after every scrape, ``iterations`` times (None: until interrupted).
    A failed scrape keeps the last view on screen under the error and is retried."""
    metrics_url = url + "/metrics"
    before: Snapshot | None = None
    view: TopView | None = None
    with Live(render_view(url, interval, None), console=console, auto_refresh=False) as live:
        polls = 0
        while iterations is None or polls < iterations:
            if polls:
                time.sleep(interval)
            polls += 1
            try:
                now = scrape(client, metrics_url)
            except ScrapeError as e:
                live.update(render_view(url, interval, view, str(e)), refresh=True)
                continue
            view = top_view(now, before)
            before = now
            live.update(render_view(url, interval, view), refresh=True)


def show(url: str, interval: float, once: bool, iterations: int | None) -> int:
    """The command: one frame (``once``, or stdout is not a terminal) or a live view until
    ``iterations`` scrapes or Ctrl-C; the exit status."""
    # httpx logs every request at INFO, which would scroll the live frame away.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console()
    try:
        with httpx.Client(timeout=FETCH_TIMEOUT_S) as client:
            if once or not console.is_terminal:
                return print_once(client, url, interval, console)
            watch(client, url, interval, console, iterations)
    except KeyboardInterrupt:
        pass
    return 0
