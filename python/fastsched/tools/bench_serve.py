"""``fastsched bench serve``: open-loop load against a running gateway, vLLM's way.

For each ``--qps`` (``--request-rate``) rate, ``--num-requests`` (``--num-prompts``)
streaming requests are sent at Poisson arrivals (exponential gaps, seeded) whether or
not earlier ones have finished — an open loop, as real clients behave, so an
overloaded server shows up as growing latency or as rejections, never as a politely
slowed-down client. Every rate sends the same requests (same seed): only the rate
differs. ``--max-concurrency N`` caps the requests in flight (a request waits for a
free slot; its latencies count from when it is sent).

Workloads (``--dataset-name``):

- ``random`` (default): prompts of token ids (the completions API takes ``prompt`` as
  a list of ints), so prompt lengths are exact; ids are drawn from ``--token-id-range``
  (default 10..249, byte tokens that every byte-level BPE vocabulary has). Lengths are
  uniform within ±``--random-range-ratio`` (default 0.5, i.e. ±50 %; vLLM's default is
  0) of ``--prompt-len`` / ``--output-len``. On ``--endpoint /v1/chat/completions`` the
  ids are decoded to text with ``--tokenizer`` and sent as one user message.
- ``sharegpt``: ``--dataset-path`` is a ShareGPT JSON file (a list of
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}``);
  as vLLM does, each conversation's first turn is the prompt (sent as text) and the
  second's length in tokens (``--tokenizer``'s) the output length (or
  ``--sharegpt-output-len``); too short (< 4 tokens) or too long (prompt > 1024, total >
  2048, or over the server's max_model_len) pairs are skipped; the rest are shuffled
  with ``--seed``.

Outputs are forced to their length with ``ignore_eos``.

Measured per request, on the client: TTFT (send → first streamed chunk with a token),
the gaps between later chunks (inter-token latency; a chunk may carry several tokens
when the server coalesces steps), TPOT ((e2e − TTFT) / (output tokens − 1)),
end-to-end latency (E2EL), and for a 503 its reason (the error's ``code``:
``max_num_queued_reqs``, ``max_num_queued_tokens``, ``ttft_slo``, ``engine_faulted``)
and how fast it came back. ``--goodput ttft:MS tpot:MS e2el:MS`` counts the completed
requests within every given bound (vLLM's ``request_goodput``).

The result of each rate is a flat dict whose keys for what vLLM's ``vllm bench serve``
also measures are vLLM's (``request_throughput``, ``mean_ttft_ms``, ``p99_e2el_ms``,
``completed``, ``failed`` (every request not completed, 503s included), ...), plus our
own (``rejected`` by reason, ``num_rejected``, ``num_errors``, ...). ``--save-result``
writes one vLLM-style JSON file per rate (``--result-dir``, ``--result-filename``);
``--out`` writes every rate in one report.
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
PERCENTILES = (50, 90, 99)  # the default --metric-percentiles
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # the default --percentile-metrics (vLLM's: ttft,tpot,itl)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT_COMPLETIONS}
DEFAULT_RANGE_RATIO = 0.5
# vLLM's ShareGPT filter (vllm/benchmarks/datasets.py, is_valid_sequence).
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    text: str | None = None  # sent instead of the ids when set (ShareGPT, or a chat prompt)


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


# ------------------------------------------------------------------ workloads


def make_requests(num_requests: int, prompt_len: int, output_len: int, seed: int,
                  token_id_range: tuple[int, int], range_ratio: float = DEFAULT_RANGE_RATIO) -> list[BenchRequest]:
    """Lengths uniform in [mean·(1 − ratio), mean·(1 + ratio)] (rounded, at least 1); ids
    uniform in the range. The default ratio, 0.5, is fastsched's ±50 % of old."""
    rng = random.Random(seed)
    lo_id, hi_id = token_id_range
    out = []
    for _ in range(num_requests):
        p = rng.randint(*_spread(prompt_len, range_ratio))
        o = rng.randint(*_spread(output_len, range_ratio))
        out.append(BenchRequest([rng.randrange(lo_id, hi_id) for _ in range(p)], o))
    return out


def _spread(mean: int, range_ratio: float = DEFAULT_RANGE_RATIO) -> tuple[int, int]:
    return max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))


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


def load_sharegpt(path: str | Path, num_requests: int, tokenizer: Any, seed: int, output_len: int | None = None,
                  max_model_len: int | None = None) -> list[BenchRequest]:
    """``num_requests`` prompts of a ShareGPT file (see the module docstring), in a seeded
    shuffle; drawn again (seeded) when the file has fewer valid ones, as vLLM oversamples."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            continue
        pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, completion in pairs:
        if len(requests) == num_requests:
            break
        ids = tokenizer.encode(prompt)
        out = output_len if output_len is not None else len(tokenizer.encode(completion, add_special_tokens=False))
        too_short = len(ids) < SHAREGPT_MIN_LEN or (output_len is None and out < SHAREGPT_MIN_LEN)
        too_long = len(ids) > SHAREGPT_MAX_PROMPT_LEN or len(ids) + out > SHAREGPT_MAX_TOTAL_LEN
        if too_short or too_long or (max_model_len is not None and len(ids) + out > max_model_len):
            continue
        requests.append(BenchRequest(ids, out, text=prompt))
    if not requests:
        raise ValueError(f"{path}: no conversation has a prompt and a reply of usable lengths")
    if len(requests) < num_requests:
        rng = random.Random(seed + 1)
        requests += [rng.choice(requests) for _ in range(num_requests - len(requests))]
    return requests


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


def request_body(model: str, req: BenchRequest, endpoint: str) -> dict[str, Any]:
    """The streaming request for ``endpoint``: greedy, EOS ignored, usage in the last chunk."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": req.text}]
    else:
        body["prompt"] = req.text if req.text is not None else req.prompt_token_ids
    return body


def _has_token(chunk: dict[str, Any], chat: bool) -> bool:
    """A chunk that brings output: any choice (completions), or a delta with content (chat:
    not a server's role-only first chunk)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    return not chat or any((c.get("delta") or {}).get("content") for c in choices)


async def send_request(client: HttpClient, model: str, req: BenchRequest,
                       endpoint: str = COMPLETIONS) -> RequestResult:
    result = RequestResult(0, len(req.prompt_token_ids), req.max_tokens)
    chat = endpoint == CHAT_COMPLETIONS
    start = time.perf_counter()
    last = start
    writer = None
    try:
        result.status, headers, reader, writer = await client.open("POST", endpoint, request_body(model, req, endpoint))
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
                    result.prompt_len = chunk["usage"].get("prompt_tokens") or result.prompt_len
                if _has_token(chunk, chat):
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
                   timeout: float, progress: bool, endpoint: str = COMPLETIONS,
                   max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Sends ``requests`` at Poisson arrivals of rate ``qps`` (at most ``max_concurrency`` in
    flight: a request due while all slots are busy waits for one, and is timed from when it
    is sent); returns the results (in arrival order) and the wall time from the first
    arrival to the last answer."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=f"qps {qps:g}", unit="req", disable=not progress, file=sys.stderr)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestResult:
        if slots is not None:
            await slots.acquire()
        send_time = time.perf_counter() - start
        try:
            result = await asyncio.wait_for(send_request(client, model, req, endpoint), timeout)
        except TimeoutError:
            result = RequestResult(0, len(req.prompt_token_ids), req.max_tokens, reason="client_timeout",
                                   error=f"no answer within {timeout:g} s")
        finally:
            if slots is not None:
                slots.release()
        result.send_time = send_time
        bar.update(1)
        return result

    tasks = []
    for req, at in zip(requests, arrival_times(len(requests), qps, seed)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


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
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std()),
            **{f"p{_percentile_name(p)}": float(np.percentile(arr, p)) for p in percentiles}}


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
            raise ValueError(f"--goodput takes METRIC:MILLISECONDS with METRIC one of {', '.join(GOODPUT_METRICS)} "
                             f"and a value >= 0, got {pair!r}")
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


def summarize(qps: float, results: Sequence[RequestResult], duration: float, *,
              percentiles: Sequence[float] = PERCENTILES, percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
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
    summary.update({
        # fastsched's own
        "qps": qps if not math.isinf(qps) else "inf",
        "num_requests": len(results),
        "offered_qps": len(results) / max(sends) if sends and max(sends) > 0 else None,
        "num_rejected": sum(rejected.values()),
        "rejected": dict(sorted(rejected.items())),
        "num_errors": len(errors),
        "errors": sorted({r.error or r.reason or f"http_{r.status}" for r in errors})[:5],
        "rejection_latency_ms": _stats_ms([r.e2e for r in results if r.status == 503 and r.e2e is not None]),
        "e2e_latencies_s": sorted(values["e2el"]),
    })
    return summary


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def format_table(summaries: Sequence[dict[str, Any]], percentiles: Sequence[float] = PERCENTILES,
                 percentile_metrics: Sequence[str] = PERCENTILE_METRICS) -> str:
    """A Markdown table: one row per rate; TTFT, ITL and E2E latency at each percentile, in ms."""
    names = [f"p{_percentile_name(p)}" for p in percentiles]
    shown = [(m, label) for m, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2el", "E2E")) if m in percentile_metrics]
    goodput = any(s.get("request_goodput") is not None for s in summaries)
    header = ["QPS", "sent", "ok", "503 (reason: n)", "req/s", *(["goodput req/s"] * goodput), "out tok/s",
              *(f"{label} {'/'.join(names)} ms" for _, label in shown), "503 latency p50/p99 ms"]
    rows = []
    for s in summaries:
        reasons = ", ".join(f"{k}: {v}" for k, v in s["rejected"].items()) or "0"
        if s["num_errors"]:
            reasons += f"; other errors: {s['num_errors']}"
        rej = s["rejection_latency_ms"]
        rows.append([
            str(s["qps"]), str(s["num_requests"]), str(s["completed"]), reasons, f"{s['request_throughput']:.2f}",
            *([f"{s['request_goodput']:.2f}" if s.get("request_goodput") is not None else "-"] * goodput),
            f"{s['output_throughput']:.1f}",
            *("/".join(_ms(s.get(f"{n}_{m}_ms")) for n in names) for m, _ in shown),
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


def load_tokenizer(name: str | None) -> Any:
    """``--tokenizer``: a checkpoint directory or ``.gguf`` file; None: the embedded default
    model's. Loaded only when a workload needs one (ShareGPT, or chat prompts)."""
    from fastsched.model_loader import load_tokenizer as load

    return load(name)


def _workload(dataset_name: str, dataset_path: str | None, num_requests: int, prompt_len: int, output_len: int,
              seed: int, token_id_range: tuple[int, int], range_ratio: float, max_model_len: int | None,
              tokenizer: Any, sharegpt_output_len: int | None, endpoint: str) -> list[BenchRequest]:
    if dataset_name == "sharegpt":
        if dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        return load_sharegpt(dataset_path, num_requests, tokenizer, seed, sharegpt_output_len, max_model_len)
    if dataset_name != "random":
        raise ValueError(f"--dataset-name must be random or sharegpt, got {dataset_name!r}")
    if dataset_path is not None:
        raise ValueError("--dataset-path is for --dataset-name sharegpt; the random workload is generated")
    longest = _spread(prompt_len, range_ratio)[1] + _spread(output_len, range_ratio)[1]
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(f"the longest request ({_spread(prompt_len, range_ratio)[1]} prompt + "
                         f"{_spread(output_len, range_ratio)[1]} output tokens) would exceed the server's "
                         f"max_model_len ({max_model_len}); lower --prompt-len or --output-len")
    requests = make_requests(num_requests, prompt_len, output_len, seed, token_id_range, range_ratio)
    if endpoint == CHAT_COMPLETIONS:  # a chat message is text: the same ids, decoded
        for r in requests:
            r.text = tokenizer.decode(r.prompt_token_ids)
    return requests


async def run_bench(url: str, qps_values: Sequence[float], num_requests: int, prompt_len: int, output_len: int,
                    seed: int = 0, *, model: str | None = None, api_key: str | None = None,
                    token_id_range: tuple[int, int] = (10, 250), timeout: float = 600.0,
                    progress: bool = True, endpoint: str = COMPLETIONS, range_ratio: float = DEFAULT_RANGE_RATIO,
                    max_concurrency: int | None = None, dataset_name: str = "random",
                    dataset_path: str | None = None, tokenizer: Any = None,
                    sharegpt_output_len: int | None = None, goodput: dict[str, float] | None = None,
                    percentiles: Sequence[float] = PERCENTILES,
                    percentile_metrics: Sequence[str] = PERCENTILE_METRICS) -> dict[str, Any]:
    """Runs every rate in turn against the gateway at ``url``; returns the JSON report.
    ``tokenizer`` (a ``Tokenizer``) is needed for ShareGPT and for chat prompts."""
    if endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
        raise ValueError(f"--endpoint must be {COMPLETIONS} or {CHAT_COMPLETIONS}, got {endpoint!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = HttpClient(url, headers)
    served, max_model_len = await asyncio.wait_for(server_model(client), 30)
    model = model or served
    requests = _workload(dataset_name, dataset_path, num_requests, prompt_len, output_len, seed, token_id_range,
                         range_ratio, max_model_len, tokenizer, sharegpt_output_len, endpoint)
    summaries = []
    for i, qps in enumerate(qps_values):
        results, duration = await run_rate(client, model, requests, qps, seed + 1 + i, timeout, progress, endpoint,
                                           max_concurrency)
        summaries.append(summarize(qps, results, duration, percentiles=percentiles,
                                   percentile_metrics=percentile_metrics, goodput=goodput))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": url,
        "model": model,
        "endpoint": endpoint,
        "config": {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len,
                   "random_range_ratio": range_ratio, "seed": seed, "token_id_range": list(token_id_range),
                   "qps": [str(q) for q in qps_values], "max_concurrency": max_concurrency,
                   "dataset_name": dataset_name, "dataset_path": dataset_path, "goodput": goodput or None,
                   "percentiles": list(percentiles), "percentile_metrics": list(percentile_metrics)},
        "results": summaries,
    }


# ------------------------------------------------------------------ vLLM's result files


DETAIL_KEYS = ("e2e_latencies_s",)  # per-request lists: in --save-result files only with --save-detailed


def vllm_result(report: dict[str, Any], summary: dict[str, Any], *, backend: str, label: str | None,
                tokenizer_id: str | None, date: str, detailed: bool = False) -> dict[str, Any]:
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


def result_path(*, label: str, qps: float | str, max_concurrency: int | None, model: str, date: str,
                result_dir: str | None, result_filename: str | None, num_rates: int) -> Path:
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


# ------------------------------------------------------------------ command line


def add_workload_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The random workload's flags, shared by ``bench serve`` and ``simulate``: the same
    values give the same requests at the same instants in both (``make_requests``,
    ``arrival_times``). vLLM's ``bench serve`` names are accepted as aliases."""
    group.add_argument("--qps", "--request-rate", dest="qps", type=float, nargs="+", default=[1.0],
                       help="Poisson request rates, run in turn (requests/s; 'inf' sends all at once)")
    group.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=100,
                       help="requests sent at each rate")
    group.add_argument("--prompt-len", "--random-input-len", "--input-len", dest="prompt_len", type=int, default=128,
                       help="mean prompt length in tokens (uniform within ±--random-range-ratio)")
    group.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64,
                       help="mean output length in tokens (uniform within ±--random-range-ratio, EOS ignored)")
    group.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=DEFAULT_RANGE_RATIO,
                       help="lengths are uniform in [len·(1 − R), len·(1 + R)], 0 <= R < 1 "
                            f"(default {DEFAULT_RANGE_RATIO}: ±50 %%; vLLM's default is 0, every length exact)")
    group.add_argument("--seed", type=int, default=0, help="seed of lengths, prompt token ids and arrival times")
    group.add_argument("--token-id-range", default="10:250",
                       help="prompt token ids are drawn from LO:HI (HI excluded; default 10:250)")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags: fastsched's, with vLLM's ``vllm bench serve`` names as aliases
    or of their own."""
    server = parser.add_argument_group("server")
    server.add_argument("--url", "--base-url", dest="url", default=None,
                        help=f"the gateway's base URL (default: {DEFAULT_URL}, or http://--host:--port)")
    server.add_argument("--host", default=None, help="with --port, the gateway at http://HOST:PORT (vLLM's)")
    server.add_argument("--port", type=int, default=None, help="see --host")
    server.add_argument("--endpoint", default=None, choices=(COMPLETIONS, CHAT_COMPLETIONS),
                        help=f"the API to load (default: {COMPLETIONS}; chat prompts are one user message)")
    server.add_argument("--backend", default=None, choices=tuple(BACKENDS),
                        help="vLLM's name for the API: openai (or vllm) = /v1/completions, "
                             "openai-chat = /v1/chat/completions")
    server.add_argument("--model", default=None, help="model name to send (default: the one /v1/models lists)")
    server.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one request")
    load = parser.add_argument_group("load")
    add_workload_args(load)
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most N requests in flight; a request due while N are waits for one to end "
                           "(its latencies count from when it is sent). Default: no limit (open loop)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=("random", "sharegpt"),
                      help="random: generated token-id prompts (the load flags above); sharegpt: the first two "
                           "turns of each conversation of --dataset-path, as vLLM reads them")
    data.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt)")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="output length of every ShareGPT request (default: its reply's length in tokens)")
    data.add_argument("--tokenizer", default=None,
                      help="checkpoint directory or .gguf whose tokenizer counts ShareGPT lengths and decodes chat "
                           "prompts (default: the embedded SmolLM2's)")
    data.add_argument("--ignore-eos", action="store_true",
                      help="accepted for vLLM's command lines: every request already ignores EOS")
    report = parser.add_argument_group("results")
    report.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="request_goodput: completed requests per second within every given bound, "
                             "e.g. ttft:500 tpot:50 e2el:5000 (milliseconds; ttft, tpot, e2el)")
    report.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                        help="comma-separated metrics to report mean/median/std/percentiles of: "
                             f"{', '.join(PERCENTILE_METRICS)} (default: all; vLLM's: ttft,tpot,itl)")
    report.add_argument("--metric-percentiles", default=",".join(map(str, PERCENTILES)),
                        help="comma-separated percentiles of those metrics (default: 50,90,99; vLLM's: 99)")
    report.add_argument("--save-result", action="store_true",
                        help="write each rate's result as vLLM's result JSON: "
                             "{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    report.add_argument("--save-detailed", action="store_true",
                        help="with --save-result, also the per-request latencies (e2e_latencies_s)")
    report.add_argument("--result-dir", default=None, help="directory of the --save-result files (default: .)")
    report.add_argument("--result-filename", default=None,
                        help="name of the --save-result file (with -{rate}qps before its suffix for several rates)")
    report.add_argument("--label", default=None, help="prefix of the --save-result file names (default: the backend)")
    report.add_argument("--out", default=None, help="write every rate's result in one JSON report to this file")
    report.add_argument("--plot", default=None, help="write the e2e latency CDF (PNG, needs matplotlib) here")
    report.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                        help="no progress bar")


def parse_token_id_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or int(lo) >= int(hi):
        raise ValueError(f"--token-id-range must be LO:HI with 0 <= LO < HI, got {text!r}")
    return int(lo), int(hi)


def check_range_ratio(ratio: float) -> float:
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return ratio


def _endpoint(args: argparse.Namespace) -> tuple[str, str]:
    """(endpoint, backend) from --endpoint and vLLM's --backend, which must agree."""
    endpoint = args.endpoint or BACKENDS[args.backend or "openai"]
    if args.backend is not None and BACKENDS[args.backend] != endpoint:
        raise ValueError(f"--backend {args.backend} is {BACKENDS[args.backend]}, not --endpoint {endpoint}")
    return endpoint, args.backend or ("openai-chat" if endpoint == CHAT_COMPLETIONS else "openai")


def _url(args: argparse.Namespace) -> str:
    if args.url is not None:
        return args.url.rstrip("/")
    if args.host is not None or args.port is not None:
        host = args.host or "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{args.port or 8000}"
    return DEFAULT_URL


def _list(text: str, what: str, allowed: Sequence[str] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if not items or bad:
        raise ValueError(f"{what} takes a comma-separated list of {', '.join(allowed or ('numbers',))}, got {text!r}")
    return items


def run_from_args(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --prompt-len and --output-len must be at least 1")
    if any(not q > 0 for q in args.qps):
        raise ValueError(f"--qps values must be positive, got {args.qps}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    endpoint, backend = _endpoint(args)
    url = _url(args)
    metrics = _list(args.percentile_metrics, "--percentile-metrics", PERCENTILE_METRICS)
    try:
        percentiles = [float(p) for p in _list(args.metric_percentiles, "--metric-percentiles")]
    except ValueError:
        percentiles = []
    if not percentiles or any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], "
                         f"got {args.metric_percentiles!r}")
    goodput = parse_goodput(args.goodput)
    needs_tokenizer = args.dataset_name == "sharegpt" or endpoint == CHAT_COMPLETIONS
    tokenizer = load_tokenizer(args.tokenizer) if needs_tokenizer else None
    try:
        report = asyncio.run(run_bench(
            url, args.qps, args.num_requests, args.prompt_len, args.output_len, args.seed,
            model=args.model, api_key=args.api_key, token_id_range=parse_token_id_range(args.token_id_range),
            timeout=args.timeout, progress=not args.no_progress, endpoint=endpoint,
            range_ratio=check_range_ratio(args.range_ratio), max_concurrency=args.max_concurrency,
            dataset_name=args.dataset_name, dataset_path=args.dataset_path, tokenizer=tokenizer,
            sharegpt_output_len=args.sharegpt_output_len, goodput=goodput, percentiles=percentiles,
            percentile_metrics=metrics,
        ))
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
        print(f"fastsched bench serve: error: cannot query {url}/v1/models: {e}", file=sys.stderr)
        return 1
    workload = (f"sharegpt {args.dataset_path}" if args.dataset_name == "sharegpt"
                else f"prompt_len~{args.prompt_len} output_len~{args.output_len}")
    print(f"\nfastsched bench serve: {report['url']}{endpoint} model={report['model']} {workload} "
          f"requests/rate={args.num_requests}"
          + (f" max_concurrency={args.max_concurrency}" if args.max_concurrency else ""))
    print(format_table(report["results"], percentiles, metrics))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.save_result:
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")  # vLLM's format, local time
        label = args.label or backend
        tokenizer_id = (args.tokenizer or "SmolLM2-135M-Instruct (embedded)") if needs_tokenizer else None
        for summary in report["results"]:
            path = result_path(label=label, qps=summary["qps"], max_concurrency=args.max_concurrency,
                               model=report["model"], date=date, result_dir=args.result_dir,
                               result_filename=args.result_filename, num_rates=len(report["results"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            result = vllm_result(report, summary, backend=backend, label=args.label, tokenizer_id=tokenizer_id,
                                 date=date, detailed=args.save_detailed)
            path.write_text(json.dumps(result) + "\n")
            print(f"wrote {path}")
    if args.plot and plot_latency_cdf(report["results"], args.plot):
        print(f"wrote {args.plot}")
    return 0


__all__ = ["BenchRequest", "RequestResult", "add_bench_serve_args", "add_workload_args", "arrival_times",
           "format_table", "load_sharegpt", "make_requests", "parse_goodput", "plot_latency_cdf", "run_bench",
           "run_from_args", "summarize"]
