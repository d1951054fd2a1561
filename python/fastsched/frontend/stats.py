"""A frontend's ``GetStats`` answer: AsyncLLM's ``stats()`` plus the latency histograms.

Histograms are bucketed here, once per observation, with vLLM's bucket bounds, so a
scrape ships a few dozen counts per histogram whatever the traffic. The latencies the
frontend sees itself (TTFT, inter-token, end-to-end) are timed on the response stream
by the gRPC server; queue time comes from the engine via the final output's
``metrics.queue_time``. When AsyncLLM's ``stats()`` carries a histogram of its own under
the same name, that one is used instead.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()

_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                            60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
HISTOGRAM_BUCKETS: dict[str, tuple[float, ...]] = {
    "request_queue_time_seconds": _REQUEST_LATENCY_BUCKETS,
    "time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e_request_latency_seconds": _REQUEST_LATENCY_BUCKETS,
}

# Proto field -> the names AsyncLLM's stats() may use for it (docs/design.md §7's first).
_STATS_KEYS: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running", "num_running"),
    "num_requests_waiting": ("num_requests_waiting", "num_waiting"),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "kv_cache_usage"),
    "num_preemptions_total": ("num_preemptions_total",),
    "prompt_tokens_total": ("prompt_tokens_total",),
    "generation_tokens_total": ("generation_tokens_total",),
    "prefix_cache_queries_total": ("prefix_cache_queries_total", "prefix_cache_queries"),
    "prefix_cache_hits_total": ("prefix_cache_hits_total", "prefix_cache_hits"),
}


class Histogram:
    """Prometheus-style bucket counts (``le`` semantics), not cumulative."""

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        self.upper_bounds = tuple(upper_bounds)
        self.counts = [0] * (len(self.upper_bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += times
        self.sum += value * times
        self.count += times

    def to_proto(self) -> Any:
        return pb.Histogram(upper_bounds=self.upper_bounds, bucket_counts=self.counts, sum=self.sum, count=self.count)


class LatencyHistograms:
    """The four latency histograms of docs/design.md §7 for one frontend."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAM_BUCKETS.items()}

    def observe(self, name: str, value: float, times: int = 1) -> None:
        self.histograms[name].observe(value, times)


def histogram_to_proto(value: Any, upper_bounds: Sequence[float]) -> Any:
    """A histogram as AsyncLLM's ``stats()`` may hold it: a sequence of every observation
    since start, a mapping in this proto's shape (``upper_bounds``, ``bucket_counts``,
    ``sum``, ``count``; only ``sum``/``count`` puts everything in +Inf), or a number (a sum)."""
    if isinstance(value, Mapping):
        bounds = value.get("upper_bounds", upper_bounds)
        counts = value.get("bucket_counts")
        count = int(value.get("count", sum(counts) if counts is not None else 0))
        if counts is None:
            counts = [0] * len(bounds) + [count]
        return pb.Histogram(upper_bounds=bounds, bucket_counts=[int(c) for c in counts],
                            sum=float(value.get("sum", 0.0)), count=count)
    if isinstance(value, (int, float)):
        return pb.Histogram(upper_bounds=upper_bounds, bucket_counts=[0] * (len(upper_bounds) + 1),
                            sum=float(value), count=0)
    observations = np.asarray(value, dtype=np.float64)
    buckets = np.searchsorted(np.asarray(upper_bounds), observations, side="left")
    counts = np.bincount(buckets, minlength=len(upper_bounds) + 1)
    return pb.Histogram(upper_bounds=upper_bounds, bucket_counts=counts.tolist(),
                        sum=float(observations.sum()), count=int(observations.size))


def _set_engine_fields(msg: Any, stats: Mapping[str, Any]) -> None:
    for field, keys in _STATS_KEYS.items():
        value = next((stats[k] for k in keys if stats.get(k) is not None), 0)
        setattr(msg, field, float(value) if field == "kv_cache_usage_perc" else int(value))


def _set_gate_fields(msg: Any, engine: Mapping[str, Any]) -> None:
    """Gate telemetry is per engine only: summing it over frontends would count it K times."""
    for gate, count in (engine.get("scan_stops_total") or {}).items():
        msg.scan_stops_total[gate] = int(count)
    for reason, count in (engine.get("skips_total") or {}).items():
        msg.skips_total[reason] = int(count)
    if engine.get("last_scan_stop"):
        msg.last_scan_stop = engine["last_scan_stop"]
    if engine.get("prefill_tokens_per_s") is not None:
        msg.prefill_tokens_per_s = float(engine["prefill_tokens_per_s"])


def stats_to_proto(stats: Mapping[str, Any], latencies: LatencyHistograms) -> Any:
    """``stats``: AsyncLLM's ``stats()``; per-engine stats, when it has them, under
    ``engines`` as mappings with an ``index`` (or ``engine_index``) and the same names."""
    msg = pb.GetStatsResponse()
    _set_engine_fields(msg, stats)
    for engine in stats.get("engines") or ():
        entry = msg.engines.add(engine_index=int(engine.get("engine_index", engine.get("index", 0))))
        _set_engine_fields(entry, engine)
        _set_gate_fields(entry, engine)
        if not engine.get("healthy", True):
            entry.dead, entry.dead_reason = True, engine.get("dead_reason") or ""
    for reason, count in (stats.get("admission_rejections_total") or {}).items():
        msg.admission_rejections_total[reason] = int(count)
    if stats.get("admission_queued_tokens_limit") is not None:
        msg.admission_queued_tokens_limit = int(stats["admission_queued_tokens_limit"])
    for name, own in latencies.histograms.items():
        theirs = stats.get(name)
        getattr(msg, name).CopyFrom(own.to_proto() if theirs is None else histogram_to_proto(theirs, own.upper_bounds))
    return msg
