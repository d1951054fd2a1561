"""The ``fastsched`` command: serve, generate, bench, plan, simulate, top, export-hf,
make-tiny-model, version. Flags follow ``vllm serve``'s names where the concept is shared;
every subcommand takes ``--log-level`` and shows each flag's default in ``--help``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from fastsched.admin import AdminSettings
from fastsched.config import EngineConfig, add_engine_args, engine_kwargs
from fastsched.entrypoints.vllm_compat import (
    add_vllm_engine_compat_args,
    add_vllm_serve_compat_args,
    check_vllm_compat_args,
    closest_flag,
    command_parser,
)
from fastsched.frontend.cli_args import add_admission_limit_args, add_routing_args, frontend_settings
from fastsched.frontend.settings import DEFAULT_SESSION_IDLE_TIMEOUT_S, SESSION_OPEN_TIMEOUT_S
from fastsched.limits import add_request_limit_args
from fastsched.lora.request import TARGET_MODULES
from fastsched.units import parse_count

API_KEY_ENV = "FASTSCHED_API_KEY"  # as vLLM's VLLM_API_KEY: a key kept out of argv (/proc/PID/cmdline)

DEFAULT_QUESTION = "What is the capital of France?"
CHAT_TEMPLATE_HELP = (
    "the Jinja chat template that renders chat messages (a file, or the template itself) "
    "instead of the checkpoint's; a model without one (a base model, such as a GGUF file "
    "with no tokenizer.chat_template) answers chat requests only with it (without: a 400 "
    "naming this flag; plain-text prompts work either way)"
)


def cmd_generate(args: argparse.Namespace) -> int:
    from fastsched.entrypoints.llm import LLM
    from fastsched.model_loader.tokenizer import NoChatTemplateError, resolve_chat_template
    from fastsched.sampling_params import SamplingParams

    prompts = args.prompt or [DEFAULT_QUESTION]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.request_seed,
        stop=args.stop,
    )
    chat_template = resolve_chat_template(args.chat_template) if args.chat_template is not None else None
    llm = LLM(**engine_kwargs(args))
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        try:
            outputs = [
                llm.chat(
                    [{"role": "user", "content": p}], params, use_tqdm=False, chat_template=chat_template
                )[0]
                for p in prompts
            ]
        except NoChatTemplateError as e:
            print(f"fastsched generate: error: {e}", file=sys.stderr)
            return 2
    for prompt, out in zip(prompts, outputs):
        for completion in out.outputs:
            print(
                f"### {prompt}\n{completion.text.strip()}\n[{completion.finish_reason}, "
                f"{len(completion.token_ids)} tokens]"
            )
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from fastsched.model_loader.export import export_hf

    out = export_hf(args.model, args.dir, weights=args.weights)
    print(f"wrote a Hugging Face directory ({'with' if args.weights else 'without'} weights) to {out}")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(_version())
    return 0


def _version() -> str:
    from importlib.metadata import version

    from fastsched import _core

    return f"fastsched {version('fastsched')} (scheduler core {_core.__version__})"


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from fastsched.tools.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, seed=args.seed)
    print(f"wrote a random-weight Llama checkpoint to {path}")
    return 0


def cmd_make_tiny_lora(args: argparse.Namespace) -> int:
    from fastsched.tools.tiny_lora import make_tiny_lora

    path = make_tiny_lora(
        args.base_dir, args.out_dir, rank=args.rank, seed=args.seed, target_modules=args.target_modules
    )
    print(f"wrote a random rank-{args.rank} LoRA adapter (PEFT format) for {args.base_dir} to {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fastsched.launcher.serve import serve
    from fastsched.launcher.serve_config import ServeConfig, ServeError
    from fastsched.model_loader.tokenizer import resolve_chat_template

    engine_config = engine_kwargs(args)
    # Every check that needs no model runs here, before anything is spawned (issue 28).
    EngineConfig.from_kwargs(**engine_config).check_scheduler_knobs()
    config = ServeConfig(
        engine_config=engine_config,
        host=args.host,
        port=args.port,
        grpc_host=args.grpc_host,
        grpc_port=args.grpc_port,
        data_parallel_size=args.data_parallel_size,
        api_server_count=args.api_server_count,
        frontend=frontend_settings(args),
        allowed_origins=tuple(args.allowed_origins),
        admin=admin_settings(args),
        max_engine_restarts=args.max_engine_restarts,
        api_key=resolve_api_key(args),
        shutdown_timeout=args.shutdown_timeout,
        served_model_name=args.served_model_name,
        chat_template=resolve_chat_template(args.chat_template) if args.chat_template is not None else None,
        torch_num_threads=args.torch_num_threads,
        access_log=not args.disable_access_log,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        responses_store_size=args.responses_store_size,
        log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    )
    try:
        return serve(config)
    except ServeError as e:
        print(f"fastsched serve: error: {e}", file=sys.stderr)
        return 1


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key``, ``--api-key-file`` (its first line) or the
    ``FASTSCHED_API_KEY`` environment variable, in that order; at most one flag."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        lines = Path(args.api_key_file).read_text().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    if args.api_key is not None:
        return args.api_key
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty: unset it to serve without a key, or give the key")
    return key


def admin_settings(args: argparse.Namespace) -> AdminSettings:
    """``--enable-admin-api``, ``--enable-runtime-lora-updating``, the admin key (``--admin-api-key``
    or the first line of ``--admin-api-key-file``, at most one) and ``--allowed-local-paths``."""
    if args.admin_api_key is not None and args.admin_api_key_file is not None:
        raise ValueError("give the admin API key once: --admin-api-key or --admin-api-key-file, not both")
    key = args.admin_api_key
    if args.admin_api_key_file is not None:
        lines = Path(args.admin_api_key_file).read_text().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--admin-api-key-file {args.admin_api_key_file} is empty")
    return AdminSettings(
        args.enable_admin_api,
        args.enable_runtime_lora_updating,
        key,
        tuple(os.path.abspath(p) for p in args.allowed_local_paths),
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``fastsched serve``'s own flags (the engine's come from add_engine_args)."""
    n = parser.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address the HTTP gateway listens on")
    n.add_argument(
        "--port", type=int, default=8000, help="port of the HTTP gateway (OpenAI API, /health, /metrics)"
    )
    n.add_argument("--grpc-host", default="127.0.0.1", help="address the gRPC frontends listen on")
    n.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="gRPC port of frontend 0; frontend k listens on this port + k",
    )
    n.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (/health and /metrics "
        "stay open; admin routes take --admin-api-key) and metadata `authorization: Bearer KEY` on "
        "the gRPC ports (all but Health and the admin methods). Visible to "
        f"other local users in the process list: prefer --api-key-file or ${API_KEY_ENV}",
    )
    n.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"read the API key from the first line of PATH (instead of --api-key; ${API_KEY_ENV} is "
        "used when neither is given)",
    )
    n.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="origins (scheme://host[:port], or * for any) whose web pages may open a /v1/sessions "
        "WebSocket besides the gateway's own; a WebSocket whose Origin header is another is refused "
        "(403). Clients that send no Origin (not browsers) are not asked (default: none)",
    )
    n.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) clients may send; responses and /v1/models use the first "
        "(default: the checkpoint's directory or file name)",
    )
    n.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING", help=CHAT_TEMPLATE_HELP)
    n.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    n.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request when a frontend admits it (prompt, parameters) and when it ends",
    )
    n.add_argument(
        "--max-log-len",
        type=parse_count,
        default=None,
        help="with --enable-log-requests: characters (or token ids) logged of each thing a request "
        "sent: its prompt, prompt token ids, parameters, error (default: all)",
    )
    n.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="report usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix "
        "cache) in responses",
    )
    n.add_argument(
        "--responses-store-size",
        type=int,
        default=0,
        help="/v1/responses answers the gateway keeps for GET /v1/responses/{id} and "
        "previous_response_id, the oldest forgotten first (default 0: none, as in vLLM)",
    )
    p = parser.add_argument_group("processes (docs/design.md §1)")
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine processes (D), each a full copy of the model with its own scheduler and KV pool",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="gRPC frontend processes (K), sharing the admission limits through shared memory (A6)",
    )
    add_routing_args(p)
    p.add_argument(
        "--torch-num-threads",
        type=int,
        default=None,
        help="CPU threads of each engine's torch (default: torch's choice)",
    )
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=5.0,
        help="seconds without a message (heartbeats are sent each second) before a frontend "
        "declares an engine dead",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds allowed for the engines (model load) and frontends to start",
    )
    p.add_argument(
        "--session-idle-timeout",
        type=float,
        default=DEFAULT_SESSION_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="S15: a streaming-input session (/v1/sessions, gRPC GenerateSession) waiting longer than "
        "this for its next chunk is aborted, freeing its runner slot and KV; 0: no limit "
        f"(default: {DEFAULT_SESSION_IDLE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--session-open-timeout",
        type=float,
        default=SESSION_OPEN_TIMEOUT_S,
        metavar="SECONDS",
        help="S15: seconds a new session (a /v1/sessions WebSocket, a gRPC GenerateSession call) has to "
        f"send its open message before it is closed (default: {SESSION_OPEN_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        metavar="N",
        help="S15: streaming-input sessions open at once over the server (each frontend takes its "
        "1/--api-server-count share); one more is refused with 503 and Retry-After, as at "
        "admission. Sessions hold their runner slot while they wait for input, so the cap keeps "
        "them from taking every slot. 0: no sessions (default: a quarter of --max-num-seqs times "
        "--data-parallel-size)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, seconds the gateway lets requests in flight finish before the processes "
        "are stopped (a second signal skips the wait)",
    )
    m = parser.add_argument_group("admin API (off unless enabled; fastsched.admin)")
    m.add_argument(
        "--enable-admin-api",
        action="store_true",
        help="serve the admin routes POST /pause, /resume, /reload_weights, /reset_prefix_cache (every "
        "engine forgets its cached prefixes, e.g. between benchmark runs), GET /is_paused and "
        "/debug/requests/{id}, and their gRPC methods, behind --admin-api-key; without it they do "
        "not exist (404, gRPC UNIMPLEMENTED)",
    )
    m.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and their gRPC methods), as "
        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; adapters given by --lora-modules are served either way",
    )
    m.add_argument(
        "--admin-api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (gRPC metadata `authorization`) on the admin routes; "
        "--api-key never grants them, so with --api-key an enabled admin API needs this key. "
        "Visible in the process list: prefer --admin-api-key-file",
    )
    m.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="PATH",
        help="read the admin API key from the first line of PATH (instead of --admin-api-key)",
    )
    m.add_argument(
        "--allowed-local-paths",
        nargs="+",
        default=[],
        metavar="DIR",
        help="directories under which /reload_weights and /v1/load_lora_adapter may name a checkpoint "
        "or adapter (symlinks resolved first); any other path is refused with 403, whether or not "
        "it exists (default: none, so runtime loads are refused)",
    )
    a = parser.add_argument_group("admission control (docs/design.md §6)")
    add_admission_limit_args(a)
    a.add_argument(
        "--enable-fault-tolerance",
        action="store_true",
        help="A1: when an engine dies or hangs, kill and restart it, answering 503 engine_faulted and "
        "/health 503 until it is ready again (default: the whole server exits non-zero, for a "
        "supervisor to restart it)",
    )
    a.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        metavar="N",
        help="with --enable-fault-tolerance: restarts allowed per engine (back-off 1, 2, 4... s) before "
        "the server exits non-zero",
    )
    add_request_limit_args(parser)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from fastsched.tools.bench_serve import run_from_args

    return run_from_args(args)


class _HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to a flag's help unless the help already speaks of its default
    or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return text
        return text + " (default: %(default)s)"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser``, at any depth."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_subparsers(child)]
    return found


def _add_model_positional(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (a positional MODEL as in `vllm serve MODEL`)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastsched",
        formatter_class=_HelpFormatter,
        description="fastsched: an admission-controlled LLM inference server with a Rust scheduler.",
    )
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="logging verbosity")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's HTTP API (gateway, gRPC frontends, engines)",
        description="Start D engine processes, K gRPC frontends and the HTTP gateway; Ctrl-C or SIGTERM "
        "stops them all (gateway, then frontends, then engines).",
    )
    _add_model_positional(srv)
    add_serve_args(srv)
    add_engine_args(srv)
    add_vllm_engine_compat_args(srv)
    add_vllm_serve_compat_args(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser(
        "generate",
        help="generate completions offline for a few prompts",
        description="Load a model in this process and answer prompts (as chat messages unless --raw).",
    )
    _add_model_positional(gen)
    gen.add_argument(
        "--prompt",
        "-p",
        action="append",
        default=[],
        help=f"a prompt (repeatable; default: {DEFAULT_QUESTION!r})",
    )
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text, not chat messages")
    gen.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING", help=CHAT_TEMPLATE_HELP)
    gen.add_argument("--max-tokens", type=parse_count, default=64, help="tokens to generate per completion")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    gen.add_argument("-n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--request-seed", type=int, default=None, help="seed for every request's sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(gen)
    add_vllm_engine_compat_args(gen)
    gen.set_defaults(func=cmd_generate)

    export = sub.add_parser(
        "export-hf",
        help="write a model as a Hugging Face directory (config, tokenizer, optionally weights)",
        description="Write MODEL (a .gguf file, an HF directory or the embedded SmolLM2 when omitted) to DIR as a "
        "Hugging Face directory: config.json, generation_config.json, tokenizer.json, "
        "tokenizer_config.json, and with --weights model.safetensors (float32). HF tools such as "
        "transformers or `vllm bench serve --tokenizer DIR` can then read it.",
    )
    export.add_argument("dir", help="directory to write")
    export.add_argument(
        "--model", default=None, help="the model (default: the embedded SmolLM2-135M-Instruct)"
    )
    export.add_argument(
        "--weights", action="store_true", help="also write the weights (dequantized to float32)"
    )
    export.set_defaults(func=cmd_export_hf)

    tiny = sub.add_parser(
        "make-tiny-model",
        help="write a small random-weight Llama checkpoint for tests",
        description="Write a seeded random-weight Llama checkpoint (HF format, ~1 MB).",
    )
    tiny.add_argument("dir", help="directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed")
    tiny.set_defaults(func=cmd_make_tiny_model)

    tiny_lora = sub.add_parser(
        "make-tiny-lora",
        help="write a random LoRA adapter (PEFT format) for a checkpoint",
        description="Write a seeded random LoRA adapter in PEFT's format "
        "(adapter_config.json + adapter_model.safetensors) for the HF "
        "checkpoint in BASE_DIR; both halves are random, so it changes outputs.",
    )
    tiny_lora.add_argument("base_dir", help="the base model's HF directory")
    tiny_lora.add_argument("out_dir", help="directory to write")
    tiny_lora.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    tiny_lora.add_argument("--seed", type=int, default=0, help="weights seed")
    tiny_lora.add_argument(
        "--target-modules",
        nargs="+",
        default=list(TARGET_MODULES),
        choices=TARGET_MODULES,
        help="projections to adapt",
    )
    tiny_lora.set_defaults(func=cmd_make_tiny_lora)

    version = sub.add_parser("version", help="print the version", description="Print the version.")
    version.set_defaults(func=cmd_version)

    bench = sub.add_parser(
        "bench",
        help="benchmarks against a running server; step-cost fits for simulate",
        description="Benchmarks against a running server (serve); the step-cost model of "
        "`fastsched simulate` (fit-step-cost, steps).",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from fastsched.tools.bench_serve import add_bench_serve_args

    bench_serve = bench_sub.add_parser(
        "serve",
        help="open-loop Poisson load at one or more request rates against a gateway",
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
    from fastsched.tools.perplexity import add_perplexity_parser

    add_perplexity_parser(sub)
    from fastsched.tools.top import add_top_parser

    add_top_parser(sub)
    for child in _subparsers(parser):
        child.formatter_class = _HelpFormatter
        # Accepted after the subcommand too; SUPPRESS keeps a value given before it.
        child.add_argument(
            "--log-level",
            default=argparse.SUPPRESS,
            choices=LOG_LEVELS,
            help="logging verbosity (as before the subcommand)",
        )
    return parser


def _resolve_model(args: argparse.Namespace) -> None:
    """A positional MODEL and --model name the same thing: one of them, or the same twice."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"MODEL {tag!r} and --model {args.model!r} disagree: give one of them")
    args.model = tag


def with_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` led by the flag of the first setting it names (``max_num_seqs (0) must be
    at least 1`` -> ``--max-num-seqs: ...``), so an error says which flag to change."""
    flags = {
        a.dest: a.option_strings[0]
        for p in (parser, *_subparsers(parser))
        for a in p._actions
        if a.option_strings and a.dest != "help"
    }
    name = next((w for w in re.findall(r"[a-z_]+", message) if w in flags), None)
    return message if name is None else f"{flags[name]}: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage and the closest flag, not the top-level usage
        command_parser(parser, args).error(closest_flag(command_parser(parser, args), unknown))
    if not sys.stderr.isatty():
        # A progress bar in a log file is a heap of \r fragments: log lines per phase instead.
        os.environ.setdefault("TQDM_DISABLE", "1")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _resolve_model(args)
        check_vllm_compat_args(args)
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"fastsched: error: {with_flag(str(e), parser)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
