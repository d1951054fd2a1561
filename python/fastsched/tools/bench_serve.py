"""``fastsched bench serve``: open-loop load against a running gateway.

For each ``--qps`` rate, ``--num-requests`` streaming completions are sent at Poisson
arrivals (exponential gaps, seeded) whether or not earlier ones have finished — an
open loop, as real clients behave, so an overloaded server shows up as growing
latency or as rejections, never as a politely slowed-down client. Every rate sends
the same requests (same seed): only the rate differs.

Prompts are token ids (the completions API takes ``prompt`` as a list of ints), so
prompt lengths are exact; ids are drawn from ``--token-id-range`` (default 10..249,
byte tokens that every byte-level BPE vocabulary has). Outputs are forced to their
sampled length with ``ignore_eos``. Both lengths are uniform within ±50 % of
``--prompt-len`` / ``--output-len``.

Measured per request, on the client: TTFT (send → first streamed chunk), the gaps
between later chunks (inter-token latency; a chunk may carry several tokens when the
server coalesces steps), TPOT ((e2e − TTFT) / (output tokens − 1)), end-to-end
latency, and for a 503 its reason (the error's ``code``: ``max_num_queued_reqs``,
``max_num_queued_tokens``, ``engine_faulted``) and how fast it came back.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000"
PERCENTILES = (50, 90, 99)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


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


def make_requests(num_requests: int, prompt_len: int, output_len: int, seed: int,
                  token_id_range: tuple[int, int]) -> list[BenchRequest]:
    """Lengths uniform in [mean/2, 3·mean/2] (at least 1); ids uniform in the range."""
    rng = random.Random(seed)
    lo_id, hi_id = token_id_range
    out = []
    for _ in range(num_requests):
        p = rng.randint(*_spread(prompt_len))
        o = rng.randint(*_spread(output_len))
        out.append(BenchRequest([rng.randrange(lo_id, hi_id) for _ in range(p)], o))
    return out


def _spread(mean: int) -> tuple[int, int]:
    return max(1, round(mean * 0.5)), max(1, round(mean * 1.5))


def arrival_times(num_requests: int, qps: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps of mean 1/qps (all at 0 for qps=inf)."""
    if math.isinf(qps):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(qps)
        times.append(t)
    return times


class HttpClient:
    """A lean HTTP/1.1 client on asyncio streams: one connection per request
    (``Connection: close``), chunked or sized bodies. httpx spends ~10 ms of CPU per
    streamed request, so at a few hundred requests/s a load generator built on it
    measures its own queue, not the server's; this one spends well under 1 ms."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http(s)://host[:port], got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.base_path = parts.path.rstrip("/")
        self.head = f"Host: {parts.netloc}\r\nConnection: close\r\nAccept: */*\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in (headers or {}).items())

    async def open(self, method: str, path: str, payload: Any = None) -> tuple[int, dict[str, str], Any, Any]:
        """Sends the request; returns (status, headers, reader, writer) once the headers are in."""
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None)
        try:
            body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
            head = f"{method} {self.base_path}{path} HTTP/1.1\r\n{self.head}"
            if payload is not None:
                head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode("latin-1") + b"\r\n" + body)
            status_line = await reader.readline()
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
                raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            return int(parts[1]), headers, reader, writer
        except BaseException:
            writer.close()
            raise

    @staticmethod
    async def chunks(reader: Any, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    return
                data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data

    async def get_json(self, path: str) -> tuple[int, Any]:
        status, headers, reader, writer = await self.open("GET", path)
        try:
            body = b"".join([chunk async for chunk in self.chunks(reader, headers)])
        finally:
            writer.close()
        return status, json.loads(body) if body else None


async def send_request(client: HttpClient, model: str, req: BenchRequest) -> RequestResult:
    result = RequestResult(0, len(req.prompt_token_ids), req.max_tokens)
    body = {
        "model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    writer = None
    try:
        result.status, headers, reader, writer = await client.open("POST", "/v1/completions", body)
        if result.status != 200:
            text = b"".join([c async for c in client.chunks(reader, headers)]).decode(errors="replace")
            result.e2e = time.perf_counter() - start
            result.reason = _error_code(text) or f"http_{result.status}"
            return result
        pending = b""
        async for data in client.chunks(reader, headers):
            now = time.perf_counter()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"error inside the stream: {chunk['error'].get('message')}"
                    result.reason = chunk["error"].get("code") or "stream_error"
                    break
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if chunk.get("choices"):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        if result.error is None and result.output_tokens == 0:
            result.error = "the stream ended without a usage chunk"
    except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.reason = result.reason or "client_error"
    finally:
        if writer is not None:
            writer.close()
    result.e2e = time.perf_counter() - start
    return result


def _error_code(text: str) -> str | None:
    try:
        error = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def run_rate(client: Any, model: str, requests: Sequence[BenchRequest], qps: float, seed: int,
                   timeout: float, progress: bool) -> tuple[list[RequestResult], float]:
    """Sends ``requests`` at Poisson arrivals of rate ``qps``; returns the results (in
    send order) and the wall time from the first send to the last answer."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=f"qps {qps:g}", unit="req", disable=not progress, file=sys.stderr)

    async def one(req: BenchRequest, send_time: float) -> RequestResult:
        try:
            result = await asyncio.wait_for(send_request(client, model, req), timeout)
        except TimeoutError:
            result = RequestResult(0, len(req.prompt_token_ids), req.max_tokens, reason="client_timeout",
                                   error=f"no answer within {timeout:g} s")
        result.send_time = send_time
        bar.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    for req, at in zip(requests, arrival_times(len(requests), qps, seed)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, time.perf_counter() - start)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def _stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(qps: float, results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    rejected = Counter(r.reason for r in results if r.status == 503)
    failed = [r for r in results if not r.ok and r.status != 503]
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.e2e is not None and r.output_tokens > 1]
    sends = [r.send_time for r in results]
    return {
        "qps": qps if not math.isinf(qps) else "inf",
        "num_requests": len(results),
        "offered_qps": len(results) / max(sends) if sends and max(sends) > 0 else None,
        "completed": len(ok),
        "num_rejected": sum(rejected.values()),
        "rejected": dict(sorted(rejected.items())),
        "failed": len(failed),
        "errors": sorted({r.error or r.reason or f"http_{r.status}" for r in failed})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(r.prompt_len for r in ok),
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats_ms(tpot),
        "e2e_ms": _stats_ms([r.e2e for r in ok if r.e2e is not None]),
        "rejection_latency_ms": _stats_ms([r.e2e for r in results if r.status == 503 and r.e2e is not None]),
        "e2e_latencies_s": sorted(r.e2e for r in ok if r.e2e is not None),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def _pcts(stats: dict[str, float | None]) -> str:
    return "/".join(_ms(stats[f"p{p}"]) for p in PERCENTILES)


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per rate; latencies p50/p90/p99 in ms."""
    header = ["QPS", "sent", "ok", "503 (reason: n)", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
              "ITL p50/p90/p99 ms", "E2E p50/p90/p99 ms", "503 latency p50/p99 ms"]
    rows = []
    for s in summaries:
        reasons = ", ".join(f"{k}: {v}" for k, v in s["rejected"].items()) or "0"
        if s["failed"]:
            reasons += f"; other errors: {s['failed']}"
        rej = s["rejection_latency_ms"]
        rows.append([
            str(s["qps"]), str(s["num_requests"]), str(s["completed"]), reasons, f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}", _pcts(s["ttft_ms"]), _pcts(s["itl_ms"]), _pcts(s["e2e_ms"]),
            "-" if rej["p50"] is None else f"{_ms(rej['p50'])}/{_ms(rej['p99'])}",
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
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


async def server_model(client: HttpClient) -> tuple[str, int | None]:
    """The served model's name and max_model_len, from /v1/models."""
    status, body = await client.get_json("/v1/models")
    if status != 200:
        raise ConnectionError(f"GET /v1/models answered {status}: {body}")
    card = body["data"][0]
    return card["id"], card.get("max_model_len")


async def run_bench(url: str, qps_values: Sequence[float], num_requests: int, prompt_len: int, output_len: int,
                    seed: int = 0, *, model: str | None = None, api_key: str | None = None,
                    token_id_range: tuple[int, int] = (10, 250), timeout: float = 600.0,
                    progress: bool = True) -> dict[str, Any]:
    """Runs every rate in turn against the gateway at ``url``; returns the JSON report."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = HttpClient(url, headers)
    served, max_model_len = await asyncio.wait_for(server_model(client), 30)
    model = model or served
    longest = _spread(prompt_len)[1] + _spread(output_len)[1]
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(f"the longest request ({_spread(prompt_len)[1]} prompt + {_spread(output_len)[1]} "
                         f"output tokens) would exceed the server's max_model_len ({max_model_len}); "
                         "lower --prompt-len or --output-len")
    requests = make_requests(num_requests, prompt_len, output_len, seed, token_id_range)
    summaries = []
    for i, qps in enumerate(qps_values):
        results, duration = await run_rate(client, model, requests, qps, seed + 1 + i, timeout, progress)
        summaries.append(summarize(qps, results, duration))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": url,
        "model": model,
        "config": {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len,
                   "seed": seed, "token_id_range": list(token_id_range), "qps": [str(q) for q in qps_values]},
        "results": summaries,
    }


def add_workload_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The random workload's flags, shared by ``bench serve`` and ``simulate``: the same
    values give the same requests at the same instants in both (``make_requests``,
    ``arrival_times``). vLLM's ``bench serve`` names are accepted as aliases."""
    group.add_argument("--qps", "--request-rate", dest="qps", type=float, nargs="+", default=[1.0],
                       help="Poisson request rates, run in turn (requests/s; 'inf' sends all at once)")
    group.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=100,
                       help="requests sent at each rate")
    group.add_argument("--prompt-len", "--random-input-len", dest="prompt_len", type=int, default=128,
                       help="mean prompt length in tokens (uniform within ±50%%)")
    group.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64,
                       help="mean output length in tokens (uniform within ±50%%, EOS ignored)")
    group.add_argument("--seed", type=int, default=0, help="seed of lengths, prompt token ids and arrival times")
    group.add_argument("--token-id-range", default="10:250",
                       help="prompt token ids are drawn from LO:HI (HI excluded; default 10:250)")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", "--base-url", dest="url", default=DEFAULT_URL,
                        help=f"the gateway's base URL (default: {DEFAULT_URL})")
    add_workload_args(parser)
    parser.add_argument("--model", default=None, help="model name to send (default: the one /v1/models lists)")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one request")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    parser.add_argument("--plot", default=None, help="write the e2e latency CDF (PNG, needs matplotlib) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_token_id_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or int(lo) >= int(hi):
        raise ValueError(f"--token-id-range must be LO:HI with 0 <= LO < HI, got {text!r}")
    return int(lo), int(hi)


def run_from_args(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --prompt-len and --output-len must be at least 1")
    if any(not q > 0 for q in args.qps):
        raise ValueError(f"--qps values must be positive, got {args.qps}")
    try:
        report = asyncio.run(run_bench(
            args.url.rstrip("/"), args.qps, args.num_requests, args.prompt_len, args.output_len, args.seed,
            model=args.model, api_key=args.api_key, token_id_range=parse_token_id_range(args.token_id_range),
            timeout=args.timeout, progress=not args.no_progress,
        ))
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
        print(f"fastsched bench serve: error: cannot query {args.url}/v1/models: {e}", file=sys.stderr)
        return 1
    print(f"\nfastsched bench serve: {report['url']} model={report['model']} "
          f"prompt_len~{args.prompt_len} output_len~{args.output_len} requests/rate={args.num_requests}")
    print(format_table(report["results"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot and plot_latency_cdf(report["results"], args.plot):
        print(f"wrote {args.plot}")
    return 0


__all__ = ["BenchRequest", "RequestResult", "add_bench_serve_args", "add_workload_args", "arrival_times",
           "format_table",
           "make_requests", "plot_latency_cdf", "run_bench", "run_from_args", "summarize"]
