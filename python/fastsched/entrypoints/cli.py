"""The ``fastsched`` command: serve, bench serve, generate, make-tiny-model."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

DEFAULT_QUESTION = "What is the capital of France?"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that runs a model (see fastsched.config.EngineConfig)."""
    g = parser.add_argument_group("model and device")
    g.add_argument("--model", default=None,
                   help="HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda when available)")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton", "flashinfer"],
                   help="attention implementation (default: flashinfer, else triton on CUDA; torch on CPU)")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that do not set their own")
    s = parser.add_argument_group("scheduler (DESIGN.md §3)")
    s.add_argument("--max-num-seqs", type=int, default=256, help="model-runner request slots")
    s.add_argument("--max-num-active-seqs", type=int, default=None,
                   help="cap on requests admitted into RUNNING (default: --max-num-seqs)")
    s.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output limit per request (default: the model's context length)")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one long prefill's tokens per step when several requests compete (0: off)")
    s.add_argument("--long-prefill-token-threshold-adaptive", action="store_true",
                   help="raise that cap to the fair share of the budget")
    s.add_argument("--prefill-schedule-interval", type=int, default=1,
                   help="run prefill work only every k-th step while decodes run (1: every step)")
    s.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="never split a prompt across steps")
    s.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"], help="waiting-queue order")
    s.add_argument("--priority-preemption", action="store_true",
                   help="with --policy priority: when the active set is full, a more urgent waiting "
                        "request preempts the least urgent running one (recompute, capped per request)")
    s.add_argument("--watermark", type=float, default=0.0,
                   help="fraction of the KV pool kept free when admitting requests")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and prepare step N+1 while step N's forward pass runs (docs/scheduler.md)")
    k = parser.add_argument_group("KV cache")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    k.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse KV blocks of identical prompt prefixes")
    k.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks in the pool, the null block included (default: from memory)")
    k.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and the KV pool (CUDA)")
    k.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for the KV pool on CPU (default: 1 GiB)")
    d = parser.add_argument_group("diagnostics")
    d.add_argument("--step-trace", default=None, metavar="FILE",
                   help="append one JSON line per engine step (shape and duration) to FILE, to fit a step-cost "
                        "model with `fastsched bench fit-step-cost` for `fastsched simulate`")


ENGINE_ARG_NAMES = (
    "model", "dtype", "device", "attention_backend", "seed", "max_num_seqs", "max_num_active_seqs",
    "max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive", "prefill_schedule_interval", "enable_chunked_prefill",
    "policy", "priority_preemption", "watermark", "block_size", "enable_prefix_caching", "num_gpu_blocks",
    "gpu_memory_utilization", "kv_cache_memory",
    "step_trace", "async_scheduling",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}


def cmd_generate(args: argparse.Namespace) -> int:
    from fastsched.entrypoints.llm import LLM
    from fastsched.sampling_params import SamplingParams

    prompts = args.prompts or [DEFAULT_QUESTION]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.request_seed,
        stop=args.stop,
    )
    llm = LLM(**engine_kwargs(args))
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
    for prompt, out in zip(prompts, outputs):
        for completion in out.outputs:
            print(f"### {prompt}\n{completion.text.strip()}\n[{completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens]")
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from fastsched.tools.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, seed=args.seed)
    print(f"wrote a random-weight Llama checkpoint to {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fastsched.launcher.serve import ServeConfig, ServeError, serve

    config = ServeConfig(
        engine_config=engine_kwargs(args),
        host=args.host,
        port=args.port,
        grpc_host=args.grpc_host,
        grpc_port=args.grpc_port,
        data_parallel_size=args.data_parallel_size,
        api_server_count=args.api_server_count,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        ttft_slo=args.ttft_slo,
        enable_fault_tolerance=args.enable_fault_tolerance,
        api_key=args.api_key,
        engine_timeout=args.engine_timeout,
        ready_timeout=args.ready_timeout,
        served_model_name=args.served_model_name,
        torch_num_threads=args.torch_num_threads,
        access_log=not args.disable_access_log,
        log_level=args.log_level,
    )
    try:
        return serve(config)
    except ServeError as e:
        print(f"fastsched serve: error: {e}", file=sys.stderr)
        return 1


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``fastsched serve``'s own flags (the engine's come from add_engine_args)."""
    n = parser.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address the HTTP gateway listens on")
    n.add_argument("--port", type=int, default=8000, help="port of the HTTP gateway (OpenAI API, /health, /metrics)")
    n.add_argument("--grpc-host", default="127.0.0.1", help="address the gRPC frontends listen on")
    n.add_argument("--grpc-port", type=int, default=50051,
                   help="gRPC port of frontend 0; frontend k listens on this port + k")
    n.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* and /debug/* (/health and /metrics stay open)")
    n.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint's directory or file name)")
    n.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    p = parser.add_argument_group("processes (DESIGN §1)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine processes (D), each a full copy of the model with its own scheduler and KV pool")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="gRPC frontend processes (K), sharing the admission limits through shared memory (A6)")
    p.add_argument("--torch-num-threads", type=int, default=None,
                   help="CPU threads of each engine's torch (default: torch's choice)")
    p.add_argument("--engine-timeout", type=float, default=5.0,
                   help="seconds without a message (heartbeats are sent each second) before a frontend "
                        "declares an engine dead")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds allowed for the engines (model load) and frontends to start")
    a = parser.add_argument_group("admission control (DESIGN §6)")
    add_admission_limit_args(a)
    a.add_argument("--enable-fault-tolerance", action="store_true",
                   help="A1: keep serving when an engine dies, answering 503 engine_faulted and /health 503 "
                        "(default: the whole server exits)")


def add_admission_limit_args(group: argparse._ArgumentGroup) -> None:
    """The admission limits, shared by ``serve`` and ``simulate`` (which applies them as one frontend)."""
    group.add_argument("--max-num-queued-reqs", type=int, default=None,
                       help="A2: reject (503) a request when the requests in flight over all frontends would "
                            "exceed this (default: no limit)")
    group.add_argument("--max-num-queued-tokens", type=int, default=None,
                       help="A3: reject (503) a request when the prompt tokens still in prefill reach this "
                            "(default: no limit)")
    group.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                       help="TTFT target: reject (503, reason ttft_slo) a request when the prompt tokens in "
                            "prefill, its own included, exceed SECONDS x the prefill throughput the engines measure "
                            "while requests wait (until measured: two scheduler steps' worth per engine). "
                            "The limit is the metric fastsched:admission_queued_tokens_limit (default: off)")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from fastsched.tools.bench_serve import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastsched",
        description="fastsched: an admission-controlled LLM inference server with a Rust scheduler.",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline for a few prompts",
                         description="Load a model and answer prompts (as chat messages unless --raw).")
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {DEFAULT_QUESTION!r})")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text, not chat messages")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per completion")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    gen.add_argument("-n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--request-seed", type=int, default=None, help="seed for every request's sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny-model", help="write a small random-weight Llama checkpoint for tests",
                          description="Write a seeded random-weight Llama checkpoint (HF format, ~1 MB).")
    tiny.add_argument("dir", help="directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed")
    tiny.set_defaults(func=cmd_make_tiny_model)

    srv = sub.add_parser(
        "serve", help="serve a model over OpenAI's HTTP API (gateway, gRPC frontends, engines)",
        description="Start D engine processes, K gRPC frontends and the HTTP gateway; Ctrl-C or SIGTERM "
                    "stops them all (gateway, then frontends, then engines).",
    )
    add_serve_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks against a running server; step-cost fits for simulate",
                           description="Benchmarks against a running server (serve); the step-cost model of "
                                       "`fastsched simulate` (fit-step-cost, steps).")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from fastsched.tools.bench_serve import add_bench_serve_args

    bench_serve = bench_sub.add_parser(
        "serve", help="open-loop Poisson load at one or more request rates against a gateway",
        description="Send streaming completions at Poisson arrivals (open loop) for each --qps; report TTFT, "
                    "inter-token and end-to-end latency percentiles, throughput and 503s by reason.",
    )
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    from fastsched.tools.bench_steps import add_bench_steps_parsers

    add_bench_steps_parsers(bench_sub)

    from fastsched.tools.plan import add_plan_parser

    add_plan_parser(sub)

    from fastsched.tools.simulate import add_simulate_parser

    add_simulate_parser(sub)
    from fastsched.tools.top import add_top_parser

    add_top_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"fastsched: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
