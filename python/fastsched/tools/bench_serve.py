"""``fastsched bench serve``: open-loop load against a running gateway, vLLM's way.

For each ``--qps`` (``--request-rate``) rate, ``--num-requests`` (``--num-prompts``)
streaming requests are sent at Poisson arrivals (exponential gaps, seeded) whether or
not earlier ones have finished — an open loop, as real clients behave, so an
overloaded server shows up as growing latency or as rejections, never as a politely
slowed-down client. Each rate draws its own requests from the workload (seed
``--seed`` + its position): sending the same prompts again would find them in the
server's prefix cache and report a flattering TTFT for every rate after the first. The
prefix-cache hit rate the server saw during each rate (from ``/metrics``) is recorded as
``prefix_cache_hit_rate``; ``--reset-prefix-cache`` also empties the server's cache before
each rate (vLLM's ``POST /reset_prefix_cache``, served with ``--enable-admin-api``).
``--max-concurrency N`` caps the requests in flight (a request waits for a free slot; its
latencies count from when it is sent).

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

Outputs are forced to their length with ``ignore_eos`` and ``min_tokens`` (a server without
``ignore_eos``, llama-cpp-python's, honours ``min_tokens``). A stream without a usage chunk
(llama-cpp-python sends none) counts one output token per chunk that carries text.

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
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastsched.tools.bench_report import (
    PERCENTILE_METRICS,
    PERCENTILES,
    RequestResult,
    format_table,
    parse_goodput,
    plot_latency_cdf,
    result_path,
    summarize,
    vllm_result,
)
from fastsched.tools.http_client import HttpClient
from fastsched.tools.workload import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    DEFAULT_RANGE_RATIO,
    BenchRequest,
    PrefixRepetition,
    add_workload_args,
    arrival_times,
    build_workload,
    check_range_ratio,
    parse_token_id_range,
)

DEFAULT_URL = "http://127.0.0.1:8000"
BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT_COMPLETIONS}


def request_body(model: str, req: BenchRequest, endpoint: str) -> dict[str, Any]:
    """The streaming request for ``endpoint``: greedy, EOS ignored, usage in the last chunk."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "min_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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


async def send_request(
    client: HttpClient, model: str, req: BenchRequest, endpoint: str = COMPLETIONS
) -> RequestResult:
    result = RequestResult(0, len(req.prompt_token_ids), req.max_tokens)
    chat = endpoint == CHAT_COMPLETIONS
    start = time.perf_counter()
    last = start
    writer = None
    complete = False
    try:
        result.status, headers, reader, writer = await client.open(
            "POST", endpoint, request_body(model, req, endpoint)
        )
        if result.status != 200:
            text = b"".join([c async for c in client.chunks(reader, headers)]).decode(errors="replace")
            result.e2e = time.perf_counter() - start
            result.reason = _error_code(text) or f"http_{result.status}"
            complete = True
            return result
        pending = b""
        token_chunks = 0
        async for data in client.chunks(reader, headers):
            now = time.perf_counter()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: ") :].strip()
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
                    token_chunks += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        complete = True
        if result.error is None and result.output_tokens == 0:
            result.output_tokens = token_chunks  # no usage chunk: one token a chunk
        if result.error is None and result.output_tokens == 0:
            result.error = "the stream ended without a token"
    except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.reason = result.reason or "client_error"
    finally:
        if writer is not None:
            client.release(headers, reader, writer, complete)
    result.e2e = time.perf_counter() - start
    return result


def _error_code(text: str) -> str | None:
    try:
        error = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def run_rate(
    client: Any,
    model: str,
    requests: Sequence[BenchRequest],
    qps: float,
    seed: int,
    timeout: float,
    progress: bool,
    endpoint: str = COMPLETIONS,
    max_concurrency: int | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends ``requests`` at Poisson arrivals of rate ``qps`` (at most ``max_concurrency`` in
    flight: a request due while all slots are busy waits for one, and is timed from when it
    is sent); returns the results (in arrival order) and the wall time from the first
    arrival to the last answer."""
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (no \r fragments in a redirected log).
    bar = tqdm(
        total=len(requests),
        desc=f"qps {qps:g}",
        unit="req",
        disable=None if progress else True,
        file=sys.stderr,
    )
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestResult:
        if slots is not None:
            await slots.acquire()
        send_time = time.perf_counter() - start
        try:
            result = await asyncio.wait_for(send_request(client, model, req, endpoint), timeout)
        except TimeoutError:
            result = RequestResult(
                0,
                len(req.prompt_token_ids),
                req.max_tokens,
                reason="client_timeout",
                error=f"no answer within {timeout:g} s",
            )
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


PREFIX_CACHE_QUERIES = "fastsched:prefix_cache_queries_total"  # tokens looked up (vLLM's counter names)
PREFIX_CACHE_HITS = "fastsched:prefix_cache_hits_total"  # tokens found


async def prefix_cache_counters(client: Any) -> tuple[float, float] | None:
    """(queried, hit) prompt tokens of the server's prefix cache so far, summed over its
    engines; None when ``/metrics`` does not say (another server, or no such counters)."""
    from fastsched.tools.metrics_snapshot import parse_metrics

    try:
        status, body = await client.get("/metrics")
        snapshot = parse_metrics(body.decode(), time.monotonic()) if status == 200 else None
    except (OSError, ValueError, asyncio.IncompleteReadError):
        return None
    if snapshot is None:
        return None
    queries, hits = snapshot.value(PREFIX_CACHE_QUERIES), snapshot.value(PREFIX_CACHE_HITS)
    return None if queries is None or hits is None else (queries, hits)


def prefix_cache_hit_rate(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """Hit tokens / queried tokens between two readings (None without both, or no query)."""
    if before is None or after is None:
        return None
    from fastsched.tools.metrics_snapshot import counter_increase

    queries = counter_increase(after[0], before[0])
    return counter_increase(after[1], before[1]) / queries if queries > 0 else None


async def reset_prefix_cache(client: Any) -> None:
    """Empties the server's prefix cache (``POST /reset_prefix_cache``); a ConnectionError
    saying how to offer it when the server does not."""
    status, body = await client.post_json("/reset_prefix_cache", {})
    if status == 404:
        raise ConnectionError(
            "the server does not offer POST /reset_prefix_cache (--reset-prefix-cache): start it "
            "with --enable-admin-api, or leave the flag out (each rate sends its own prompts)"
        )
    if status != 200:
        raise ConnectionError(f"POST /reset_prefix_cache answered {status}: {body[:200]!r}")


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


async def run_bench(
    url: str,
    qps_values: Sequence[float],
    num_requests: int,
    prompt_len: int,
    output_len: int,
    seed: int = 0,
    *,
    model: str | None = None,
    api_key: str | None = None,
    token_id_range: tuple[int, int] = (10, 250),
    timeout: float = 600.0,
    progress: bool = True,
    endpoint: str = COMPLETIONS,
    range_ratio: float = DEFAULT_RANGE_RATIO,
    max_concurrency: int | None = None,
    dataset_name: str = "random",
    dataset_path: str | None = None,
    tokenizer: Any = None,
    sharegpt_output_len: int | None = None,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
    reset_cache: bool = False,
    admin_api_key: str | None = None,
    prefix_repetition: PrefixRepetition | None = None,
) -> dict[str, Any]:
    """Runs every rate in turn against the gateway at ``url``; returns the JSON report.
    ``tokenizer`` (a ``Tokenizer``) is needed for ShareGPT and for chat prompts; ``reset_cache``
    empties the server's prefix cache before each rate, sending ``admin_api_key`` (an admin
    route: the API key never grants it) or, without one, ``api_key``."""
    if endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
        raise ValueError(f"--endpoint must be {COMPLETIONS} or {CHAT_COMPLETIONS}, got {endpoint!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = HttpClient(url, headers)
    admin = HttpClient(url, {"Authorization": f"Bearer {admin_api_key}"}) if admin_api_key else client
    try:
        served, max_model_len = await asyncio.wait_for(server_model(client), 30)
        model = model or served
        summaries = []
        for i, qps in enumerate(qps_values):
            # Each rate its own prompts: the same ones again would be prefix-cache hits.
            requests = build_workload(
                dataset_name,
                dataset_path,
                num_requests,
                prompt_len,
                output_len,
                seed + i,
                token_id_range,
                range_ratio,
                max_model_len,
                tokenizer,
                sharegpt_output_len,
                endpoint,
                prefix_repetition,
            )
            if reset_cache:
                await reset_prefix_cache(admin)
            before = await prefix_cache_counters(client)
            results, duration = await run_rate(
                client, model, requests, qps, seed + 1 + i, timeout, progress, endpoint, max_concurrency
            )
            summary = summarize(
                qps,
                results,
                duration,
                percentiles=percentiles,
                percentile_metrics=percentile_metrics,
                goodput=goodput,
            )
            summary["prefix_cache_hit_rate"] = prefix_cache_hit_rate(
                before, await prefix_cache_counters(client)
            )
            summaries.append(summary)
    finally:
        client.close()
        if admin is not client:
            admin.close()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "url": url,
        "model": model,
        "endpoint": endpoint,
        "config": {
            "num_requests": num_requests,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "random_range_ratio": range_ratio,
            "seed": seed,
            "token_id_range": list(token_id_range),
            "qps": [str(q) for q in qps_values],
            "max_concurrency": max_concurrency,
            "dataset_name": dataset_name,
            "dataset_path": dataset_path,
            "goodput": goodput or None,
            "percentiles": list(percentiles),
            "percentile_metrics": list(percentile_metrics),
            "reset_prefix_cache": reset_cache,
            "prefix_repetition": None if prefix_repetition is None else vars(prefix_repetition),
        },
        "results": summaries,
    }


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags: fastsched's, with vLLM's ``vllm bench serve`` names as aliases
    or of their own."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--url",
        "--base-url",
        dest="url",
        default=None,
        help=f"the gateway's base URL (default: {DEFAULT_URL}, or http://--host:--port)",
    )
    server.add_argument("--host", default=None, help="with --port, the gateway at http://HOST:PORT (vLLM's)")
    server.add_argument("--port", type=int, default=None, help="see --host")
    server.add_argument(
        "--endpoint",
        default=None,
        choices=(COMPLETIONS, CHAT_COMPLETIONS),
        help=f"the API to load (default: {COMPLETIONS}; chat prompts are one user message)",
    )
    server.add_argument(
        "--backend",
        default=None,
        choices=tuple(BACKENDS),
        help="vLLM's name for the API: openai (or vllm) = /v1/completions, "
        "openai-chat = /v1/chat/completions",
    )
    server.add_argument(
        "--model", default=None, help="model name to send (default: the one /v1/models lists)"
    )
    server.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one request")
    server.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="empty the server's prefix cache before each rate (POST /reset_prefix_cache, which a "
        "fastsched server offers with --enable-admin-api)",
    )
    server.add_argument(
        "--admin-api-key",
        default=None,
        help="the server's --admin-api-key, sent with --reset-prefix-cache (default: --api-key)",
    )
    load = parser.add_argument_group("load")
    add_workload_args(load)
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most N requests in flight; a request due while N are waits for one to end "
        "(its latencies count from when it is sent). Default: no limit (open loop)",
    )
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "sharegpt", "prefix_repetition"),
        help="random: generated token-id prompts (the load flags above); sharegpt: the first two "
        "turns of each conversation of --dataset-path, as vLLM reads them; prefix_repetition "
        "(vLLM's): each prompt one of a few shared prefixes plus a suffix of its own, the "
        "--prefix-repetition-* flags (tenants' system prompts and short user turns)",
    )
    data.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        default=256,
        help="prefix_repetition: tokens of each shared prefix (default: 256)",
    )
    data.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        help="prefix_repetition: tokens each request adds after its prefix (default: 256)",
    )
    data.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="prefix_repetition: distinct prefixes; each request takes one at random (default: 10)",
    )
    data.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt)")
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length of every ShareGPT request (default: its reply's length in tokens)",
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint directory or .gguf whose tokenizer counts ShareGPT lengths and decodes chat "
        "prompts (default: the embedded SmolLM2's)",
    )
    data.add_argument(
        "--ignore-eos",
        action="store_true",
        help="accepted for vLLM's command lines: every request already ignores EOS",
    )
    report = parser.add_argument_group("results")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="request_goodput: completed requests per second within every given bound, "
        "e.g. ttft:500 tpot:50 e2el:5000 (milliseconds; ttft, tpot, e2el)",
    )
    report.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help="comma-separated metrics to report mean/median/std/percentiles of: "
        f"{', '.join(PERCENTILE_METRICS)} (default: all; vLLM's: ttft,tpot,itl)",
    )
    report.add_argument(
        "--metric-percentiles",
        default=",".join(map(str, PERCENTILES)),
        help="comma-separated percentiles of those metrics (default: 50,90,99; vLLM's: 99)",
    )
    report.add_argument(
        "--save-result",
        action="store_true",
        help="write each rate's result as vLLM's result JSON: "
        "{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json",
    )
    report.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result, also the per-request latencies (e2e_latencies_s)",
    )
    report.add_argument(
        "--result-dir", default=None, help="directory of the --save-result files (default: .)"
    )
    report.add_argument(
        "--result-filename",
        default=None,
        help="name of the --save-result file (with -{rate}qps before its suffix for several rates)",
    )
    report.add_argument(
        "--label", default=None, help="prefix of the --save-result file names (default: the backend)"
    )
    report.add_argument(
        "--out", default=None, help="write every rate's result in one JSON report to this file"
    )
    report.add_argument("--plot", default=None, help="write the e2e latency CDF (PNG, needs matplotlib) here")
    report.add_argument(
        "--no-progress", "--disable-tqdm", dest="no_progress", action="store_true", help="no progress bar"
    )


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
        raise ValueError(
            f"{what} takes a comma-separated list of {', '.join(allowed or ('numbers',))}, got {text!r}"
        )
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
        raise ValueError(
            f"--metric-percentiles takes comma-separated numbers in (0, 100], got {args.metric_percentiles!r}"
        )
    goodput = parse_goodput(args.goodput)
    needs_tokenizer = args.dataset_name == "sharegpt" or endpoint == CHAT_COMPLETIONS
    tokenizer = load_tokenizer(args.tokenizer) if needs_tokenizer else None
    try:
        report = asyncio.run(
            run_bench(
                url,
                args.qps,
                args.num_requests,
                args.prompt_len,
                args.output_len,
                args.seed,
                model=args.model,
                api_key=args.api_key,
                token_id_range=parse_token_id_range(args.token_id_range),
                timeout=args.timeout,
                progress=not args.no_progress,
                endpoint=endpoint,
                range_ratio=check_range_ratio(args.range_ratio),
                max_concurrency=args.max_concurrency,
                dataset_name=args.dataset_name,
                dataset_path=args.dataset_path,
                tokenizer=tokenizer,
                sharegpt_output_len=args.sharegpt_output_len,
                goodput=goodput,
                percentiles=percentiles,
                percentile_metrics=metrics,
                reset_cache=args.reset_prefix_cache,
                admin_api_key=args.admin_api_key,
                prefix_repetition=PrefixRepetition(
                    args.prefix_repetition_prefix_len,
                    args.prefix_repetition_suffix_len,
                    args.prefix_repetition_num_prefixes,
                ),
            )
        )
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
        print(f"fastsched bench serve: error: {url}: {e}", file=sys.stderr)
        return 1
    workload = (
        f"sharegpt {args.dataset_path}"
        if args.dataset_name == "sharegpt"
        else f"prefix_repetition {args.prefix_repetition_num_prefixes} x {args.prefix_repetition_prefix_len} "
        f"+ {args.prefix_repetition_suffix_len} output_len~{args.output_len}"
        if args.dataset_name == "prefix_repetition"
        else f"prompt_len~{args.prompt_len} output_len~{args.output_len}"
    )
    print(
        f"\nfastsched bench serve: {report['url']}{endpoint} model={report['model']} {workload} "
        f"requests/rate={args.num_requests}"
        + (f" max_concurrency={args.max_concurrency}" if args.max_concurrency else "")
    )
    print(format_table(report["results"], percentiles, metrics))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.save_result:
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")  # vLLM's format, local time
        label = args.label or backend
        tokenizer_id = (args.tokenizer or "SmolLM2-135M-Instruct (embedded)") if needs_tokenizer else None
        for summary in report["results"]:
            path = result_path(
                label=label,
                qps=summary["qps"],
                max_concurrency=args.max_concurrency,
                model=report["model"],
                date=date,
                result_dir=args.result_dir,
                result_filename=args.result_filename,
                num_rates=len(report["results"]),
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            result = vllm_result(
                report,
                summary,
                backend=backend,
                label=args.label,
                tokenizer_id=tokenizer_id,
                date=date,
                detailed=args.save_detailed,
            )
            path.write_text(json.dumps(result) + "\n")
            print(f"wrote {path}")
    if args.plot and plot_latency_cdf(report["results"], args.plot):
        print(f"wrote {args.plot}")
    return 0


__all__ = [
    "DEFAULT_URL",
    "HttpClient",
    "add_bench_serve_args",
    "request_body",
    "run_bench",
    "run_from_args",
    "run_rate",
    "send_request",
    "server_model",
]
