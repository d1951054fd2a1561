"""A frontend's ``GetStats`` answer: AsyncLLM's ``stats()`` plus the gRPC server's latency
histograms (``frontend.request_metrics``), as ``GetStatsResponse``.

The latencies the frontend sees itself (TTFT, inter-token, end-to-end) are timed on the
response stream by the gRPC server; the per-request histograms and finish reasons are
AsyncLLM's (``requests_by_engine``), from the engine's timestamps. Both are per engine, in
``requests_by_engine``; the top-level histogram fields are their sums over engines. When
AsyncLLM's ``stats()`` carries a histogram of its own under a top-level name, that one is
used instead there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastsched.engine.protocol import ITERATION_TOKENS_BUCKETS
from fastsched.frontend.request_metrics import (
    LATENCY_BUCKETS,
    EngineRequestMetrics,
    Histogram,
    LatencyHistograms,
)
from fastsched.process_stats import PROCESS_METRICS, read_process_stats
from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()

HISTOGRAM_BUCKETS = LATENCY_BUCKETS  # the name older callers know

__all__ = ["HISTOGRAM_BUCKETS", "Histogram", "LatencyHistograms", "histogram_to_proto", "stats_to_proto"]

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


def _histogram_proto(h: Histogram) -> Any:
    return pb.Histogram(upper_bounds=h.upper_bounds, bucket_counts=h.counts, sum=h.sum, count=h.count)


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
        return pb.Histogram(
            upper_bounds=bounds,
            bucket_counts=[int(c) for c in counts],
            sum=float(value.get("sum", 0.0)),
            count=count,
        )
    if isinstance(value, (int, float)):
        return pb.Histogram(
            upper_bounds=upper_bounds, bucket_counts=[0] * (len(upper_bounds) + 1), sum=float(value), count=0
        )
    observations = np.asarray(value, dtype=np.float64)
    buckets = np.searchsorted(np.asarray(upper_bounds), observations, side="left")
    counts = np.bincount(buckets, minlength=len(upper_bounds) + 1)
    return pb.Histogram(
        upper_bounds=upper_bounds,
        bucket_counts=counts.tolist(),
        sum=float(observations.sum()),
        count=int(observations.size),
    )


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


def _process_proto(msg: Any, stats: Mapping[str, float] | None) -> None:
    if stats:
        msg.process.CopyFrom(
            pb.ProcessStats(
                pid=int(stats.get("pid", 0)), **{k: float(stats[k]) for k in PROCESS_METRICS if k in stats}
            )
        )


def _engine_extras(msg: Any, engine: Mapping[str, Any]) -> None:
    """Iteration tokens, cache config, KV connector, speculative decoding and process stats: per engine
    only, like the gates."""
    counts = engine.get("iteration_tokens")
    if counts:
        msg.iteration_tokens.CopyFrom(
            pb.Histogram(
                upper_bounds=ITERATION_TOKENS_BUCKETS,
                bucket_counts=[int(c) for c in counts],
                sum=float(engine.get("iteration_tokens_sum", 0)),
                count=int(sum(counts)),
            )
        )
    for key, value in (engine.get("cache_config") or {}).items():
        msg.cache_config[key] = str(value)
    msg.running_lora_adapters.extend(engine.get("running_lora_adapters") or ())
    msg.waiting_lora_adapters.extend(engine.get("waiting_lora_adapters") or ())
    msg.max_lora = int(engine.get("max_lora") or 0)
    for key, value in (engine.get("kv_connector") or {}).items():
        msg.kv_connector[key] = float(value)
    per_pos = engine.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos:
        msg.spec_decode.CopyFrom(
            pb.SpecDecodeStats(
                num_drafts=int(engine["spec_decode_num_drafts"]),
                num_draft_tokens=int(engine["spec_decode_num_draft_tokens"]),
                num_accepted_tokens=int(engine["spec_decode_num_accepted_tokens"]),
                num_accepted_tokens_per_pos=[int(c) for c in per_pos],
            )
        )
    _process_proto(msg, engine.get("process"))


def _set_session_fields(msg: Any, engine: Mapping[str, Any]) -> None:
    """The pause state (S13) and the sessions waiting for input (S15): per engine only."""
    msg.pause_state = engine.get("pause_state") or "unpaused"
    msg.num_requests_waiting_for_streaming_input = int(engine.get("num_waiting_for_streaming_input") or 0)


def _requests_by_engine(msg: Any, stats: Mapping[str, Any], latencies: LatencyHistograms) -> None:
    """The per-engine request stats: AsyncLLM's and the gRPC server's latencies, merged."""
    theirs: Mapping[int, EngineRequestMetrics] = stats.get("requests_by_engine") or {}
    indexes = sorted({i for i in latencies.by_engine if i is not None} | set(theirs))
    for index in indexes:
        histograms: dict[str, Histogram] = {}
        for name, h in latencies.engine(index).items():
            histograms[name] = Histogram(h.upper_bounds)
            histograms[name].add(h)
        entry = msg.requests_by_engine.add(engine_index=int(index))
        requests = theirs.get(index)
        if requests is not None:
            for reason, count in requests.success.items():
                entry.request_success_total[reason] = int(count)
            for name, h in requests.histograms.items():
                if name in histograms and histograms[name].upper_bounds == h.upper_bounds:
                    histograms[name].add(h)
                else:
                    histograms[name] = h
        for name, h in histograms.items():
            entry.histograms[name].CopyFrom(_histogram_proto(h))


def stats_to_proto(stats: Mapping[str, Any], latencies: LatencyHistograms) -> Any:
    """``stats``: AsyncLLM's ``stats()``; per-engine stats, when it has them, under
    ``engines`` as mappings with an ``index`` (or ``engine_index``) and the same names, and
    per-engine request metrics under ``requests_by_engine`` (engine index ->
    ``EngineRequestMetrics``)."""
    msg = pb.GetStatsResponse()
    _set_engine_fields(msg, stats)
    for engine in stats.get("engines") or ():
        entry = msg.engines.add(engine_index=int(engine.get("engine_index", engine.get("index", 0))))
        _set_engine_fields(entry, engine)
        _set_gate_fields(entry, engine)
        if not engine.get("healthy", True):
            entry.dead, entry.dead_reason = True, engine.get("dead_reason") or ""
        _engine_extras(entry, engine)
        _set_session_fields(entry, engine)
    for reason, count in (stats.get("admission_rejections_total") or {}).items():
        msg.admission_rejections_total[reason] = int(count)
    for cause, count in (stats.get("routing_decisions_total") or {}).items():
        msg.routing_decisions_total[cause] = int(count)
    if stats.get("admission_queued_tokens_limit") is not None:
        msg.admission_queued_tokens_limit = int(stats["admission_queued_tokens_limit"])
    for target, h in (stats.get("slo_prediction_error_seconds") or {}).items():
        msg.slo_prediction_error_seconds[target].CopyFrom(_histogram_proto(h))
    _requests_by_engine(msg, stats, latencies)
    # The top-level histograms: summed over engines (and over observations of no known engine).
    totals = latencies.histograms
    for requests in (stats.get("requests_by_engine") or {}).values():
        for name, h in requests.histograms.items():
            if name in totals and totals[name].upper_bounds == h.upper_bounds:
                totals[name].add(h)
    for name, total in totals.items():
        theirs = stats.get(name)
        getattr(msg, name).CopyFrom(
            _histogram_proto(total) if theirs is None else histogram_to_proto(theirs, total.upper_bounds)
        )
    if stats.get("frontend_index") is not None:
        msg.frontend_index = int(stats["frontend_index"])
    _process_proto(msg, read_process_stats())
    return msg
