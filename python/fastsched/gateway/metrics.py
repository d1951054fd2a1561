"""``/metrics``: docs/design.md §7's metrics, from the frontends' ``GetStats``.

A scrape first fetches every frontend's stats (async, in the gateway's event loop),
then renders them through a prometheus_client collector that holds that snapshot, so
the registry's sync ``collect()`` never blocks the loop on gRPC.

Names are vLLM's with the prefix ``fastsched:`` instead of ``vllm:``, and every family
has vLLM's ``model_name`` label (the served model name), plus ``engine`` (the engine's
index) where the value is an engine's:

- Engine-level values (requests running and waiting, KV usage, token and preemption
  counters, prefix cache, tokens per step, the cache config, the gates, speculative decoding): every frontend
  talks to the same D engines and reports what they last told it, so each engine is
  taken once, from its freshest report (the one with the most tokens counted).
- Per-request values (latency and phase histograms, token counts, finish reasons): each
  frontend counts its own requests, per engine, so they are summed over frontends.
- Admission (rejections, the TTFT-SLO limit) is the frontends', summed over them.

A frontend that breaks nothing down by engine is added under ``engine=""`` (no engine).
Each process's resource use is exported as Prometheus' standard ``process_*`` families
(unprefixed), one series per process, labelled ``process`` (gateway, frontend, engine)
and ``index``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from fastsched.frontend.admission import REASONS
from fastsched.frontend.request_metrics import FINISHED_REASONS, REQUEST_HISTOGRAMS
from fastsched.process_stats import PROCESS_METRICS, read_process_stats

PREFIX = "fastsched:"
# Every reason is exported from the start, so a dashboard sees a 0 line before the first rejection.
ADMISSION_REASONS = REASONS

_GAUGES = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
_COUNTERS = {
    "num_preemptions_total": "Cumulative number of preemptions from the engine.",
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
    "prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
}
# The latency histograms of the top-level GetStats fields (a frontend without a per-engine breakdown).
_LATENCY_HISTOGRAMS = {
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
}
_REQUEST_HISTOGRAMS = {**_LATENCY_HISTOGRAMS, **REQUEST_HISTOGRAMS}
_PROCESS_COUNTERS = ("cpu_seconds_total",)
# EngineStats.kv_connector key -> (metric name without the prefix and the _total suffix, help).
KV_CONNECTOR_COUNTERS = {
    "queries": ("kv_connector_queries", "Requests whose prompt was looked up in the KV connector's store."),
    "hits": ("kv_connector_hits", "Requests that found at least one KV block in the connector's store."),
    "blocks_loaded": ("kv_connector_blocks_loaded", "KV blocks loaded from the connector's store."),
    "blocks_saved": ("kv_connector_blocks_saved", "KV blocks saved to the connector's store."),
    "load_failures": (
        "kv_connector_load_failures",
        "KV blocks found in the store but missing, corrupt or not the request's when loaded "
        "(computed instead).",
    ),
    "token_mismatches": (
        "kv_connector_token_mismatches",
        "KV blocks in the store whose token ids were not the request's (a miss).",
    ),
    "load_timeouts": ("kv_connector_load_timeouts", "KV block loads given up after load_timeout_s."),
    "lookup_timeouts": ("kv_connector_lookup_timeouts", "KV store lookups given up after lookup_timeout_s."),
    "blocks_evicted": (
        "kv_connector_blocks_evicted",
        "KV block files deleted to keep the store under max_size.",
    ),
    "saves_dropped": (
        "kv_connector_saves_dropped",
        "Batches of KV blocks not saved because too many saves were waiting for the store.",
    ),
    "load_seconds": ("kv_connector_load_seconds", "Seconds spent reading and checking loaded KV blocks."),
    "save_seconds": ("kv_connector_save_seconds", "Seconds spent writing saved KV blocks."),
}

NO_ENGINE = ""  # the engine label of a frontend's values that are not broken down by engine


# ------------------------------------------------------------------ engine rows


def _progress(engine: Any) -> int:
    """Counters only grow: the report that counted more is the newer one."""
    return (
        engine.prompt_tokens_total
        + engine.generation_tokens_total
        + engine.num_preemptions_total
        + engine.prefix_cache_queries_total
    )


def engine_rows(stats: Sequence[Any]) -> list[Any]:
    """Each live engine once (its freshest report over the frontends), plus the whole of any
    frontend that reports no per-engine breakdown (a ``GetStatsResponse``, not an
    ``EngineStats``). An engine a frontend reports dead is left out: its last gauges would
    otherwise stay frozen until it is replaced."""
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


def _is_engine(row: Any) -> bool:
    return hasattr(row, "engine_index")


# ------------------------------------------------------------------ histograms


class _Buckets:
    """Observations per upper bound (not cumulative), summed over the reports added."""

    def __init__(self) -> None:
        self.per_bound: dict[float, int] = {}
        self.inf = 0
        self.sum = 0.0

    def add(self, h: Any) -> None:
        for bound, count in zip(h.upper_bounds, h.bucket_counts):
            self.per_bound[bound] = self.per_bound.get(bound, 0) + count
        self.inf += sum(h.bucket_counts[len(h.upper_bounds) :])
        self.sum += h.sum

    def buckets(self) -> list[tuple[str, float]]:
        out, cumulative = [], 0
        for bound in sorted(self.per_bound):
            cumulative += self.per_bound[bound]
            out.append((floatToGoString(bound), cumulative))
        out.append(("+Inf", cumulative + self.inf))
        return out


def _histogram_family(
    name: str, doc: str, labels: list[str], series: dict[tuple[str, ...], _Buckets]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    for values, b in sorted(series.items()):
        family.add_metric(list(values), b.buckets(), b.sum)
    return family


# ------------------------------------------------------------------ families


def metric_families(stats: Sequence[Any], model_name: str = "", own_process: bool = True) -> list[Metric]:
    """Families for the ``GetStatsResponse`` of every frontend that answered. ``own_process``:
    add this (the gateway's) process to the ``process_*`` families."""
    m = model_name
    families: list[Metric] = [*_admission_families(stats, m)]
    families.append(_routing_family(stats, m))
    rows = engine_rows(stats)
    engines = [e for e in rows if _is_engine(e)]
    families.extend(_engine_families(rows, m))
    families.extend(_request_families(stats, m))
    families.append(_iteration_tokens_family(engines, m))
    families.append(_cache_config_family(engines, m))
    families.append(_lora_family(engines, m))
    families.extend(_gate_families(engines, m))
    families.append(_prefill_throughput_family(engines, m))
    families.extend(_spec_decode_families(engines, m))
    families.extend(_kv_connector_families(engines, m))
    families.extend(_session_families(engines, m))
    families.extend(_process_families(stats, engines, own_process))
    return families


def _routing_family(stats: Sequence[Any], m: str) -> Metric:
    """The frontends' engine choices (``frontend.routing``), by cause, summed over them."""
    routing = CounterMetricFamily(
        PREFIX + "routing_decisions_total",
        "Engine choices with data parallelism (--routing), by cause.",
        labels=["model_name", "cause"],
    )
    by_cause: dict[str, int] = {}
    for s in stats:
        for cause, count in s.routing_decisions_total.items():
            by_cause[cause] = by_cause.get(cause, 0) + count
    for cause, count in sorted(by_cause.items()):
        routing.add_metric([m, cause], count)
    return routing


def _admission_families(stats: Sequence[Any], m: str) -> list[Metric]:
    """Admission is the frontends': rejections by reason summed over them, and the TTFT-SLO
    valve's queued-token limit (the frontends' shares summed; absent when the valve is off)."""
    rejections = CounterMetricFamily(
        PREFIX + "admission_rejections_total",
        "Requests rejected at admission (A5), by reason.",
        labels=["model_name", "reason"],
    )
    by_reason = dict.fromkeys(ADMISSION_REASONS, 0)
    for s in stats:
        for reason, count in s.admission_rejections_total.items():
            by_reason[reason] = by_reason.get(reason, 0) + count
    for reason, count in by_reason.items():
        rejections.add_metric([m, reason], count)
    families: list[Metric] = [rejections]
    limits = [s.admission_queued_tokens_limit for s in stats if s.HasField("admission_queued_tokens_limit")]
    if limits:
        limit = GaugeMetricFamily(
            PREFIX + "admission_queued_tokens_limit",
            "Queued prompt tokens the TTFT-SLO valve admits: ttft_slo x measured prefill throughput.",
            labels=["model_name"],
        )
        limit.add_metric([m], sum(limits))
        families.append(limit)
    errors: dict[tuple[str, ...], _Buckets] = {}
    for s in stats:
        for target, h in s.slo_prediction_error_seconds.items():
            errors.setdefault((m, target), _Buckets()).add(h)
    if errors:
        families.append(
            _histogram_family(
                "slo_prediction_error_seconds",
                "How far the goodput valve's (--tpot-slo) predicted TTFT or TPOT of admitted requests was from the "
                "measured one (absolute), by target.",
                ["model_name", "target"],
                errors,
            )
        )
    return families


def _engine_families(rows: Sequence[Any], m: str) -> list[Metric]:
    """One series per engine; the frontends without a breakdown summed under ``engine=""``
    (their ``kv_cache_usage_perc`` averaged)."""
    per_engine = [(str(r.engine_index), r) for r in rows if _is_engine(r)]
    whole = [r for r in rows if not _is_engine(r)]
    families: list[Metric] = []
    for kind, names in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
        for name, doc in names.items():
            family = kind(PREFIX + name, doc, labels=["model_name", "engine"])
            if whole:
                values = [getattr(r, name) for r in whole]
                total = sum(values) / len(values) if name == "kv_cache_usage_perc" else sum(values)
                family.add_metric([m, NO_ENGINE], total)
            for engine, r in per_engine:
                family.add_metric([m, engine], getattr(r, name))
            families.append(family)
    return families


def _request_families(stats: Sequence[Any], m: str) -> list[Metric]:
    """Per-request counts, per engine, summed over frontends: ``request_success_total`` by
    finish reason and the latency, phase and token histograms."""
    success: dict[tuple[str, str], int] = {}
    series: dict[str, dict[tuple[str, ...], _Buckets]] = {name: {} for name in _REQUEST_HISTOGRAMS}
    for s in stats:
        if s.requests_by_engine:
            for entry in s.requests_by_engine:
                engine = str(entry.engine_index)
                for reason in FINISHED_REASONS:
                    success.setdefault((engine, reason), 0)
                for reason, count in entry.request_success_total.items():
                    success[(engine, reason)] = success.get((engine, reason), 0) + count
                for name, h in entry.histograms.items():
                    if name in series:
                        series[name].setdefault((m, engine), _Buckets()).add(h)
        else:
            for name in _LATENCY_HISTOGRAMS:
                series[name].setdefault((m, NO_ENGINE), _Buckets()).add(getattr(s, name))
    counter = CounterMetricFamily(
        PREFIX + "request_success_total",
        "Count of successfully processed requests.",
        labels=["model_name", "engine", "finished_reason"],
    )
    for (engine, reason), count in sorted(success.items()):
        counter.add_metric([m, engine, reason], count)
    families: list[Metric] = [counter]
    for name, doc in _REQUEST_HISTOGRAMS.items():
        families.append(_histogram_family(name, doc, ["model_name", "engine"], series[name]))
    return families


def _iteration_tokens_family(engines: Sequence[Any], m: str) -> Metric:
    series = {}
    for e in engines:
        if e.iteration_tokens.upper_bounds:
            b = series[(m, str(e.engine_index))] = _Buckets()
            b.add(e.iteration_tokens)
    return _histogram_family(
        "iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        ["model_name", "engine"],
        series,
    )


def _cache_config_family(engines: Sequence[Any], m: str) -> Metric:
    """vLLM's info-style gauge: value 1, the KV cache configuration in its labels."""
    keys = sorted({k for e in engines for k in e.cache_config})
    family = GaugeMetricFamily(
        PREFIX + "cache_config_info",
        "Information of the engine's KV cache configuration.",
        labels=["model_name", "engine", *keys],
    )
    for e in engines:
        if e.cache_config:
            family.add_metric([m, str(e.engine_index), *(e.cache_config.get(k, "") for k in keys)], 1.0)
    return family


def _lora_family(engines: Sequence[Any], m: str) -> Metric:
    """vLLM's ``lora_requests_info``: one series per engine serving LoRA, its adapters as
    comma-separated labels, the value the time of this scrape (vLLM: set_to_current_time)."""
    family = GaugeMetricFamily(
        PREFIX + "lora_requests_info",
        "Running stats on lora requests.",
        labels=["model_name", "engine", "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    now = time.time()
    for e in engines:
        if e.max_lora:
            family.add_metric(
                [
                    m,
                    str(e.engine_index),
                    str(e.max_lora),
                    ",".join(e.waiting_lora_adapters),
                    ",".join(e.running_lora_adapters),
                ],
                now,
            )
    return family


def _prefill_throughput_family(engines: Sequence[Any], m: str) -> Metric:
    """The TTFT-SLO valve's input: each engine's measured prefill throughput (once measured)."""
    throughput = GaugeMetricFamily(
        PREFIX + "prefill_throughput_tokens_per_second",
        "Prompt tokens each engine prefills per second while requests wait.",
        labels=["model_name", "engine"],
    )
    for e in engines:
        if e.HasField("prefill_tokens_per_s"):
            throughput.add_metric([m, str(e.engine_index)], e.prefill_tokens_per_s)
    return throughput


def _session_families(engines: Sequence[Any], m: str) -> list[Metric]:
    """S13's pause (one series per engine and mode, 1 for the mode in force) and S15's
    sessions holding their slot while they wait for input."""
    paused = GaugeMetricFamily(
        PREFIX + "engine_paused",
        "1 while the engine is paused in this mode (new: no admissions; all: nothing runs).",
        labels=["model_name", "engine", "mode"],
    )
    waiting = GaugeMetricFamily(
        PREFIX + "num_requests_waiting_for_streaming_input",
        "Streaming-input sessions holding their slot and KV while they wait for input.",
        labels=["model_name", "engine"],
    )
    for e in engines:
        engine = str(e.engine_index)
        for mode in ("new", "all"):
            paused.add_metric([m, engine, mode], 1.0 if e.pause_state == f"paused_{mode}" else 0.0)
        waiting.add_metric([m, engine], e.num_requests_waiting_for_streaming_input)
    return [paused, waiting]


_SPEC_DECODE_COUNTERS = {
    "num_drafts": "Number of spec decoding drafts.",
    "num_draft_tokens": "Number of draft tokens.",
    "num_accepted_tokens": "Number of accepted tokens.",
}


def _spec_decode_families(engines: Sequence[Any], m: str) -> list[Metric]:
    """vLLM's ``spec_decode_*`` counters, for the engines that speculate (none otherwise)."""
    speculating = [e for e in engines if e.HasField("spec_decode")]
    if not speculating:
        return []
    families: list[Metric] = []
    for name, doc in _SPEC_DECODE_COUNTERS.items():
        family = CounterMetricFamily(PREFIX + "spec_decode_" + name, doc, labels=["model_name", "engine"])
        for e in speculating:
            family.add_metric([m, str(e.engine_index)], getattr(e.spec_decode, name))
        families.append(family)
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=["model_name", "engine", "position"],
    )
    for e in speculating:
        for position, count in enumerate(e.spec_decode.num_accepted_tokens_per_pos):
            per_pos.add_metric([m, str(e.engine_index), str(position)], count)
    families.append(per_pos)
    return families


def _gate_families(engines: Sequence[Any], m: str) -> list[Metric]:
    """Which scheduler gate is red, per engine: scan stops and skips, and the last stop as a
    0/1 gauge per gate."""
    labels = ["model_name", "engine"]
    stops = CounterMetricFamily(
        PREFIX + "scheduler_scan_stops_total",
        "Scheduler steps whose waiting-queue scan stopped at each gate.",
        labels=[*labels, "gate"],
    )
    skips = CounterMetricFamily(
        PREFIX + "scheduler_skips_total",
        "Waiting requests skipped for their own reasons (S7).",
        labels=[*labels, "reason"],
    )
    last = GaugeMetricFamily(
        PREFIX + "scheduler_last_scan_stop",
        "1 for the gate that stopped each engine's last scheduler step.",
        labels=[*labels, "gate"],
    )
    for e in engines:
        engine = str(e.engine_index)
        for gate, count in sorted(e.scan_stops_total.items()):
            stops.add_metric([m, engine, gate], count)
            last.add_metric([m, engine, gate], 1.0 if gate == e.last_scan_stop else 0.0)
        for reason, count in sorted(e.skips_total.items()):
            skips.add_metric([m, engine, reason], count)
    return [stops, skips, last]


def _kv_connector_families(engines: Sequence[Any], m: str) -> list[Metric]:
    """The KV connector's counters (``--kv-transfer-config``), per engine that has one."""
    families = []
    for key, (name, doc) in KV_CONNECTOR_COUNTERS.items():
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "engine"])
        for e in engines:
            if key in e.kv_connector:
                family.add_metric([m, str(e.engine_index)], e.kv_connector[key])
        families.append(family)
    return families


def _process_families(stats: Sequence[Any], engines: Sequence[Any], own_process: bool) -> list[Metric]:
    """Prometheus' standard process metrics, one series per fastsched process."""
    processes: list[tuple[str, str, dict[str, float]]] = []
    if own_process and (own := read_process_stats()) is not None:
        processes.append(("gateway", "0", own))
    for position, s in enumerate(stats):
        if s.HasField("process"):
            index = s.frontend_index if s.HasField("frontend_index") else position
            processes.append(("frontend", str(index), _process_values(s.process)))
    for e in engines:
        if e.HasField("process"):
            processes.append(("engine", str(e.engine_index), _process_values(e.process)))
    families: list[Metric] = []
    for name, doc in PROCESS_METRICS.items():
        kind = CounterMetricFamily if name in _PROCESS_COUNTERS else GaugeMetricFamily
        family = kind("process_" + name, doc, labels=["process", "index"])
        for process, index, values in processes:
            if name in values:
                family.add_metric([process, index], values[name])
        families.append(family)
    return families


def _process_values(msg: Any) -> dict[str, float]:
    return {name: getattr(msg, name) for name in PROCESS_METRICS}


class _Snapshot:
    """A prometheus_client collector over one scrape's stats."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def render(
    stats: Sequence[Any], model_name: str = "", own_process: bool = True, extra: Iterable[Metric] = ()
) -> bytes:
    """The Prometheus text exposition of the frontends' stats, and the gateway's own ``extra`` families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([*metric_families(stats, model_name, own_process), *extra]))
    return generate_latest(registry)
