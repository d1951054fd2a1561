"""What ``fastsched top`` shows, computed from two scrapes of ``/metrics`` (no rendering).

Gauges are read from the newer scrape; rates and latency quantiles cover the window
between the two, so the view says what the server is doing now rather than since it
started. Any metric the server does not export (an older server, or one started without
the feature) is None here and "–" on screen, never an error.

Metric names are those of gateway/metrics.py as they appear in the text. Their labels
(``model_name``, and ``engine`` on engine-level values) are summed over, except for the
KV cache usage, a fraction per engine, which is their mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastsched.tools.metrics_snapshot import Histogram, Snapshot, counter_increase

PREFIX = "fastsched:"
RUNNING = PREFIX + "num_requests_running"
WAITING = PREFIX + "num_requests_waiting"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
PREEMPTIONS = PREFIX + "num_preemptions_total"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
TTFT = PREFIX + "time_to_first_token_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
E2E_LATENCY = PREFIX + "e2e_request_latency_seconds"
REJECTIONS = PREFIX + "admission_rejections_total"
SCAN_STOPS = PREFIX + "scheduler_scan_stops_total"
LAST_SCAN_STOP = PREFIX + "scheduler_last_scan_stop"
QUEUED_TOKENS_LIMIT = PREFIX + "admission_queued_tokens_limit"
PREFILL_THROUGHPUT = PREFIX + "prefill_throughput_tokens_per_second"
PREFILL_THROUGHPUT_OLD = (
    PREFIX + "prefill_throughput_tokens_per_s"
)  # its name before the vLLM-compatible names
SLO_PREDICTION_ERROR = PREFIX + "slo_prediction_error_seconds"  # the goodput valve's (--tpot-slo)
ROUTING = PREFIX + "routing_decisions_total"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"

# The one gate that holds nothing back: the scan ended because nothing was left to take.
IDLE_GATE = "no_waiting"


def is_limiting(gate: str) -> bool:
    """A scan that stopped at any gate but ``no_waiting`` left requests waiting: the red gate."""
    return gate != IDLE_GATE


@dataclass(frozen=True)
class Latency:
    """A latency histogram over the window: ``count`` new observations and their p50/p99
    (None when ``count`` is 0)."""

    count: float
    p50: float | None
    p99: float | None

    @classmethod
    def of(cls, window: Histogram) -> Latency:
        return cls(window.count, window.quantile(0.5), window.quantile(0.99))


@dataclass(frozen=True)
class EngineView:
    last_scan_stop: str | None  # the gate; None before its first step or when not exported
    prefill_tokens_per_s: float | None  # measured by the TTFT-SLO valve; None until measured
    prefix_cache_hit_rate: float | None = None  # hits / queries since start (tokens); None before a query


@dataclass(frozen=True)
class TopView:
    """One frame. Rates are per second over ``window_s``; everything that needs two
    scrapes (rates, latencies) is None on the first one."""

    window_s: float | None
    num_requests_running: float | None
    num_requests_waiting: float | None
    kv_cache_usage: float | None  # a fraction, as the gauge exports it despite its name
    num_preemptions: float | None
    preemptions_per_s: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    ttft: Latency | None
    queue_time: Latency | None
    e2e_latency: Latency | None
    rejections_per_s: dict[str, float]  # by reason
    scan_stops_per_s: dict[str, float]  # by gate
    engines: dict[str, EngineView]  # by engine index, in order
    queued_tokens_limit: float | None
    # The goodput valve's mean absolute prediction error (seconds) over the window,
    # by target (ttft, tpot); empty without --tpot-slo or with nothing measured in the window.
    slo_prediction_error_s: dict[str, float] = field(default_factory=dict)
    routing_per_s: dict[str, float] = field(default_factory=dict)  # engine choices by cause (--routing)


def top_view(now: Snapshot, before: Snapshot | None) -> TopView:
    """The frame for scrape ``now``, with rates over the window since ``before``."""
    window = now.taken_at - before.taken_at if before is not None else None

    def rate(name: str) -> float | None:
        value = now.value(name)
        then = before.value(name) if before is not None else None
        if value is None or then is None or not window:
            return None
        return counter_increase(value, then) / window

    def rates_by(name: str, label: str) -> dict[str, float]:
        values = now.by_label(name, label)
        if before is None or not window:
            return {}
        thens = before.by_label(name, label)
        # A label set the previous scrape did not have is a counter born since: it grew from 0.
        return {key: counter_increase(value, thens.get(key, 0.0)) / window for key, value in values.items()}

    def latency(name: str) -> Latency | None:
        histogram = now.histograms.get(name)
        earlier = before.histograms.get(name) if before is not None else None
        if histogram is None or earlier is None:
            return None
        return Latency.of(histogram.since(earlier))

    return TopView(
        window_s=window,
        num_requests_running=now.value(RUNNING),
        num_requests_waiting=now.value(WAITING),
        kv_cache_usage=now.mean(KV_CACHE_USAGE),
        num_preemptions=now.value(PREEMPTIONS),
        preemptions_per_s=rate(PREEMPTIONS),
        prompt_tokens_per_s=rate(PROMPT_TOKENS),
        generation_tokens_per_s=rate(GENERATION_TOKENS),
        ttft=latency(TTFT),
        queue_time=latency(QUEUE_TIME),
        e2e_latency=latency(E2E_LATENCY),
        rejections_per_s=rates_by(REJECTIONS, "reason"),
        scan_stops_per_s=rates_by(SCAN_STOPS, "gate"),
        engines=engine_views(now),
        queued_tokens_limit=now.value(QUEUED_TOKENS_LIMIT),
        slo_prediction_error_s=_mean_by_target(now, before),
        routing_per_s=rates_by(ROUTING, "cause"),
    )


def _mean_by_target(now: Snapshot, before: Snapshot | None) -> dict[str, float]:
    """The goodput valve's mean prediction error per target over the window."""
    if before is None:
        return {}
    sums, counts = (now.by_label(SLO_PREDICTION_ERROR + s, "target") for s in ("_sum", "_count"))
    sums_then, counts_then = (before.by_label(SLO_PREDICTION_ERROR + s, "target") for s in ("_sum", "_count"))
    means = {}
    for target, count in counts.items():
        new = count - counts_then.get(target, 0.0)
        if new > 0:
            means[target] = (sums.get(target, 0.0) - sums_then.get(target, 0.0)) / new
    return means


def engine_views(snapshot: Snapshot) -> dict[str, EngineView]:
    """Each engine's last stop (the gate whose 0/1 gauge is 1, None while all are 0), prefill
    throughput and prefix-cache hit rate, for every engine these metrics name."""
    stops: dict[str, str | None] = {}
    for s in snapshot.samples.get(LAST_SCAN_STOP, ()):
        engine = s.labels.get("engine", "")
        stops.setdefault(engine, None)
        if s.value == 1:
            stops[engine] = s.labels.get("gate")
    throughput = snapshot.by_label(PREFILL_THROUGHPUT, "engine") or snapshot.by_label(
        PREFILL_THROUGHPUT_OLD, "engine"
    )
    queries = snapshot.by_label(PREFIX_CACHE_QUERIES, "engine")
    hits = snapshot.by_label(PREFIX_CACHE_HITS, "engine")
    hit_rates = {engine: hits.get(engine, 0.0) / q for engine, q in queries.items() if q}
    engines = sorted(stops.keys() | throughput.keys(), key=lambda engine: (len(engine), engine))
    return {
        engine: EngineView(stops.get(engine), throughput.get(engine), hit_rates.get(engine))
        for engine in engines
    }
