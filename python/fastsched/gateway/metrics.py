"""``/metrics``: docs/design.md §7's metrics, summed over the frontends' ``GetStats``.

A scrape first fetches every frontend's stats (async, in the gateway's event loop),
then renders them through a prometheus_client collector that holds that snapshot, so
the registry's sync ``collect()`` never blocks the loop on gRPC.

What is summed over frontends: admission rejections and the latency histograms (each
frontend counts its own requests). Engine-level metrics are different: every frontend
talks to the same D engines and reports what they last told it, so summing over K
frontends would count each engine K times. They are taken per engine instead (the
freshest report of each engine index: the one with the most tokens counted), then
summed over engines; ``kv_cache_usage_perc`` is averaged over engines. A frontend that
does not break its stats down by engine is added as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from fastsched.frontend.admission import REASONS

PREFIX = "fastsched:"
# Every reason is exported from the start, so a dashboard sees a 0 line before the first rejection.
ADMISSION_REASONS = REASONS

_GAUGES = {
    "num_requests_running": "Requests in the engine's running set.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
}
_COUNTERS = {
    "num_preemptions_total": "Preemptions (recompute) since start.",
    "prompt_tokens_total": "Prompt tokens processed.",
    "generation_tokens_total": "Tokens generated.",
    "prefix_cache_queries_total": "Tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Tokens found in the prefix cache.",
}
_HISTOGRAMS = {
    "request_queue_time_seconds": "Time from arrival to first scheduling (first scheduling only).",
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between consecutive generated tokens.",
    "e2e_request_latency_seconds": "Time from arrival to the end of the request.",
}


def _histogram(name: str, doc: str, histograms: Sequence[Any]) -> HistogramMetricFamily:
    per_bound: dict[float, int] = {}
    inf = total_sum = 0.0
    for h in histograms:
        for bound, count in zip(h.upper_bounds, h.bucket_counts):
            per_bound[bound] = per_bound.get(bound, 0) + count
        inf += sum(h.bucket_counts[len(h.upper_bounds):])
        total_sum += h.sum
    buckets, cumulative = [], 0
    for bound in sorted(per_bound):
        cumulative += per_bound[bound]
        buckets.append((floatToGoString(bound), cumulative))
    buckets.append(("+Inf", cumulative + int(inf)))
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=total_sum)


def _progress(engine: Any) -> int:
    """Counters only grow: the report that counted more is the newer one."""
    return (engine.prompt_tokens_total + engine.generation_tokens_total + engine.num_preemptions_total
            + engine.prefix_cache_queries_total)


def engine_rows(stats: Sequence[Any]) -> list[Any]:
    """Each live engine once (its freshest report over the frontends), plus the whole of
    any frontend that reports no per-engine breakdown. An engine a frontend reports dead
    is left out: its last gauges would otherwise stay frozen until it is replaced."""
    freshest: dict[int, Any] = {}
    dead = {e.engine_index for s in stats for e in s.engines if e.dead}
    rows = []
    for s in stats:
        if not s.engines:
            rows.append(s)
        for e in s.engines:
            if e.engine_index in dead:
                continue
            if e.engine_index not in freshest or _progress(e) > _progress(freshest[e.engine_index]):
                freshest[e.engine_index] = e
    return rows + [freshest[i] for i in sorted(freshest)]


def metric_families(stats: Sequence[Any]) -> list[Metric]:
    """Families for the ``GetStatsResponse`` of every frontend that answered."""
    rejections = CounterMetricFamily(PREFIX + "admission_rejections_total",
                                     "Requests rejected at admission (A5), by reason.", labels=["reason"])
    by_reason = dict.fromkeys(ADMISSION_REASONS, 0)
    for s in stats:
        for reason, count in s.admission_rejections_total.items():
            by_reason[reason] = by_reason.get(reason, 0) + count
    for reason, count in by_reason.items():
        rejections.add_metric([reason], count)
    families: list[Metric] = [rejections]
    engines = engine_rows(stats)
    for name, doc in _GAUGES.items():
        families.append(GaugeMetricFamily(PREFIX + name, doc, value=sum(getattr(e, name) for e in engines)))
    usage = [e.kv_cache_usage_perc for e in engines]
    families.append(GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of the KV block pools in use.",
                                      value=sum(usage) / len(usage) if usage else 0.0))
    for name, doc in _COUNTERS.items():
        families.append(CounterMetricFamily(PREFIX + name, doc, value=sum(getattr(e, name) for e in engines)))
    for name, doc in _HISTOGRAMS.items():
        families.append(_histogram(name, doc, [getattr(s, name) for s in stats]))
    families.extend(_gate_families([e for e in engines if hasattr(e, "engine_index")]))
    families.extend(_ttft_slo_families(stats, [e for e in engines if hasattr(e, "engine_index")]))
    return families


def _ttft_slo_families(stats: Sequence[Any], engines: Sequence[Any]) -> list[Metric]:
    """The TTFT-SLO valve: the queued-token limit in force (the frontends' shares summed;
    absent when the valve is off) and each engine's measured prefill throughput."""
    families: list[Metric] = []
    limits = [s.admission_queued_tokens_limit for s in stats if s.HasField("admission_queued_tokens_limit")]
    if limits:
        families.append(GaugeMetricFamily(
            PREFIX + "admission_queued_tokens_limit",
            "Queued prompt tokens the TTFT-SLO valve admits: ttft_slo x measured prefill throughput.",
            value=sum(limits)))
    throughput = GaugeMetricFamily(PREFIX + "prefill_throughput_tokens_per_s",
                                   "Prompt tokens each engine prefills per second while requests wait.",
                                   labels=["engine"])
    for e in engines:
        if e.HasField("prefill_tokens_per_s"):
            throughput.add_metric([str(e.engine_index)], e.prefill_tokens_per_s)
    families.append(throughput)
    return families


def _gate_families(engines: Sequence[Any]) -> list[Metric]:
    """Which scheduler gate is red: scan stops and skips summed over engines, and each
    engine's last stop as a 0/1 gauge per gate."""
    stops = CounterMetricFamily(PREFIX + "scheduler_scan_stops_total",
                                "Scheduler steps whose waiting-queue scan stopped at each gate.", labels=["gate"])
    skips = CounterMetricFamily(PREFIX + "scheduler_skips_total",
                                "Waiting requests skipped for their own reasons (S7).", labels=["reason"])
    last = GaugeMetricFamily(PREFIX + "scheduler_last_scan_stop",
                             "1 for the gate that stopped each engine's last scheduler step.",
                             labels=["engine", "gate"])
    gates: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for e in engines:
        for gate, count in e.scan_stops_total.items():
            gates[gate] = gates.get(gate, 0) + count
        for reason, count in e.skips_total.items():
            reasons[reason] = reasons.get(reason, 0) + count
        for gate in e.scan_stops_total:
            last.add_metric([str(e.engine_index), gate], 1.0 if gate == e.last_scan_stop else 0.0)
    for gate, count in sorted(gates.items()):
        stops.add_metric([gate], count)
    for reason, count in sorted(reasons.items()):
        skips.add_metric([reason], count)
    return [stops, skips, last]


class _Snapshot:
    """A prometheus_client collector over one scrape's stats."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def render(stats: Sequence[Any]) -> bytes:
    """The Prometheus text exposition of the frontends' summed stats."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metric_families(stats)))
    return generate_latest(registry)
