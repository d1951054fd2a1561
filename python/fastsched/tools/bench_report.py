"""What a benchmark run measured, summarized the way ``vllm bench serve`` reports it (flat
keys such as ``median_ttft_ms``, ``request_throughput``, goodput), plus fastsched's own
figures (503s by reason); the table ``bench serve`` and ``simulate`` print; the result file."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)  # the default --metric-percentiles
PERCENTILE_METRICS = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
)  # the default --percentile-metrics (vLLM's: ttft,tpot,itl)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    status: int  # HTTP status; 0 when no response came (connection error, timeout)
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0  # seconds since the rate's first send
    reason: str | None = None  # the error code of a non-200 (503: the admission reason)
    error: str | None = None
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


# ------------------------------------------------------------------ the numbers


def _percentile_name(p: float) -> str:
    """vLLM's key: p99, p99.9."""
    return str(int(p)) if int(p) == p else str(p)


def _stats_ms(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """mean, median, std and the percentiles of ``values`` (seconds) in ms; None without values."""
    import numpy as np

    names = ["mean", "median", "std", *(f"p{_percentile_name(p)}" for p in percentiles)]
    if not values:
        return dict.fromkeys(names)
    arr = np.asarray(values, dtype=float) * 1000.0
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        **{f"p{_percentile_name(p)}": float(np.percentile(arr, p)) for p in percentiles},
    }


def _tpot(r: RequestResult) -> float | None:
    if r.ttft is None or r.e2e is None or r.output_tokens <= 1:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "e2el:3000"]`` -> ``{"ttft": 500.0, "e2el": 3000.0}`` (milliseconds), as vLLM's."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or name not in GOODPUT_METRICS or slos[name] < 0:
            raise ValueError(
                f"--goodput takes METRIC:MILLISECONDS with METRIC one of {', '.join(GOODPUT_METRICS)} "
                f"and a value >= 0, got {pair!r}"
            )
    return slos


def _is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    """Within every SLO (ms); a request of one output token has a TPOT of 0, as in vLLM."""
    values = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.e2e}
    return all(values[name] is not None and values[name] * 1000.0 <= slo for name, slo in slos.items())


def _peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (the most token-bearing chunks in one second since the
    first send) and max_concurrent_requests (the most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    first = min(r.send_time for r in ok)
    per_second: Counter[int] = Counter()
    events = []
    for r in ok:
        t = r.send_time + (r.ttft or 0.0)
        per_second[int(t - first)] += 1
        for gap in r.itl:
            t += gap
            per_second[int(t - first)] += 1
        events += [(r.send_time, 1), (r.send_time + (r.e2e or 0.0), -1)]
    in_flight = peak = 0
    for _, delta in sorted(events):  # an end before a start at the same instant
        in_flight += delta
        peak = max(peak, in_flight)
    return float(max(per_second.values(), default=0)), peak


def summarize(
    qps: float,
    results: Sequence[RequestResult],
    duration: float,
    *,
    percentiles: Sequence[float] = PERCENTILES,
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One rate's result: vLLM's keys for what vLLM measures too, then fastsched's own."""
    ok = [r for r in results if r.ok]
    rejected = Counter(r.reason for r in results if r.status == 503)
    errors = [r for r in results if not r.ok and r.status != 503]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    sends = [r.send_time for r in results]
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    max_tokens_per_s, max_concurrent = _peaks(ok)
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := _tpot(r)) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e for r in ok if r.e2e is not None],
    }
    summary: dict[str, Any] = {
        # vLLM's keys (vllm bench serve's result JSON)
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "request_goodput": per_second(sum(_is_good(r, goodput) for r in ok)) if goodput else None,
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
    }
    for metric in percentile_metrics:
        for stat, value in _stats_ms(values[metric], percentiles).items():
            summary[f"{stat}_{metric}_ms"] = value
    summary.update(
        {
            # fastsched's own
            "qps": qps if not math.isinf(qps) else "inf",
            "num_requests": len(results),
            "offered_qps": len(results) / max(sends) if sends and max(sends) > 0 else None,
            "num_rejected": sum(rejected.values()),
            "rejected": dict(sorted(rejected.items())),
            "num_errors": len(errors),
            "errors": sorted({r.error or r.reason or f"http_{r.status}" for r in errors})[:5],
            "rejection_latency_ms": _stats_ms(
                [r.e2e for r in results if r.status == 503 and r.e2e is not None]
            ),
            "e2e_latencies_s": sorted(values["e2el"]),
        }
    )
    return summary


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def format_table(
    summaries: Sequence[dict[str, Any]],
    percentiles: Sequence[float] = PERCENTILES,
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
) -> str:
    """A Markdown table: one row per rate; TTFT, ITL and E2E latency at each percentile, in ms."""
    names = [f"p{_percentile_name(p)}" for p in percentiles]
    shown = [
        (m, label)
        for m, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2el", "E2E"))
        if m in percentile_metrics
    ]
    goodput = any(s.get("request_goodput") is not None for s in summaries)
    header = [
        "QPS",
        "sent",
        "ok",
        "503 (reason: n)",
        "req/s",
        *(["goodput req/s"] * goodput),
        "out tok/s",
        *(f"{label} {'/'.join(names)} ms" for _, label in shown),
        "503 latency p50/p99 ms",
        "prefix cache hits",
    ]
    rows = []
    for s in summaries:
        reasons = ", ".join(f"{k}: {v}" for k, v in s["rejected"].items()) or "0"
        if s["num_errors"]:
            reasons += f"; other errors: {s['num_errors']}"
        rej = s["rejection_latency_ms"]
        rows.append(
            [
                str(s["qps"]),
                str(s["num_requests"]),
                str(s["completed"]),
                reasons,
                f"{s['request_throughput']:.2f}",
                *([f"{s['request_goodput']:.2f}" if s.get("request_goodput") is not None else "-"] * goodput),
                f"{s['output_throughput']:.1f}",
                *("/".join(_ms(s.get(f"{n}_{m}_ms")) for n in names) for m, _ in shown),
                "-" if rej["p50"] is None else f"{_ms(rej['p50'])}/{_ms(rej['p99'])}",
                "-" if s.get("prefix_cache_hit_rate") is None else f"{s['prefix_cache_hit_rate']:.1%}",
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def plot_latency_cdf(summaries: Sequence[dict[str, Any]], path: str | Path) -> bool:
    """The e2e latency CDF of completed requests, one curve per rate; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fastsched bench serve: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        lat = s["e2e_latencies_s"]
        if not lat:
            continue
        y = [(i + 1) / len(lat) for i in range(len(lat))]
        label = f"{s['qps']} req/s ({s['completed']} ok, {s['num_rejected']} rejected)"
        ax.step(lat, y, where="post", label=label)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title("fastsched bench serve: e2e latency CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ vLLM's result files


DETAIL_KEYS = ("e2e_latencies_s",)  # per-request lists: in --save-result files only with --save-detailed


def vllm_result(
    report: dict[str, Any],
    summary: dict[str, Any],
    *,
    backend: str,
    label: str | None,
    tokenizer_id: str | None,
    date: str,
    detailed: bool = False,
) -> dict[str, Any]:
    """One rate as ``vllm bench serve --save-result`` writes a run: its setup keys, then the
    result (vLLM's keys and fastsched's own)."""
    qps = summary["qps"]
    setup = {
        "date": date,
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": report["model"],
        "tokenizer_id": tokenizer_id,
        "num_prompts": report["config"]["num_requests"],
        "request_rate": qps,
        "burstiness": 1.0,  # Poisson arrivals
        "max_concurrency": report["config"]["max_concurrency"],
        "url": report["url"],
        "endpoint": report["endpoint"],
        "dataset_name": report["config"]["dataset_name"],
    }
    return {**setup, **{k: v for k, v in summary.items() if detailed or k not in DETAIL_KEYS}}


def result_path(
    *,
    label: str,
    qps: float | str,
    max_concurrency: int | None,
    model: str,
    date: str,
    result_dir: str | None,
    result_filename: str | None,
    num_rates: int,
) -> Path:
    """vLLM's ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`` in ``result_dir``,
    or ``result_filename`` there (with ``-{rate}qps`` before its suffix when several rates run)."""
    rate = f"{float(qps)}qps" if qps != "inf" else "infqps"
    if result_filename:
        path = Path(result_filename)
        if num_rates > 1:
            path = path.with_name(f"{path.stem}-{rate}{path.suffix}")
    else:
        concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
        path = Path(f"{label}-{rate}{concurrency}-{model.split('/')[-1]}-{date}.json")
    return Path(result_dir) / path if result_dir else path
