"""``fastsched plan``: the capacity planner's command line (the arithmetic is fastsched.tools.planner).

The model's KV shape (layers, KV heads, head dim) is read from its config, no weights
loaded. ``--dtype`` is the KV cache element type and defaults to bfloat16, what
``fastsched serve --dtype auto`` uses on CUDA: planning is for GPU deployments, where
float32 KV would be unusual. The KV memory is per replica and is what is left for
the pool after weights and activations (the engine logs its pool size at start-up).

Wiring (entrypoints/cli.py)::

    from fastsched.tools.plan import add_plan_parser
    add_plan_parser(sub)          # sets func=run_plan on the subcommand

``run_plan`` returns 0 when the load is servable, 1 when it is not; bad values raise
ValueError (or FileNotFoundError for a missing model) naming the flag, which
``fastsched``'s main prints as an error.
"""

from __future__ import annotations

import argparse
import json

from fastsched.tools.planner import (
    DEFAULT_HEADROOM,
    KV_DTYPE_BYTES,
    STATUS_NOT_SERVABLE,
    Plan,
    PlanInputs,
    format_bytes,
    plan,
)
from fastsched.units import parse_bytes


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``plan`` subcommand to ``subparsers`` (with ``func=run_plan``) and return it."""
    p = subparsers.add_parser(
        "plan",
        help="size max_num_seqs and the admission limits for a load (no server needed)",
        description="From an arrival rate, mean prompt/output lengths, measured step time and prefill "
        "throughput, a TTFT target and the KV memory, compute the concurrency a replica needs "
        "(Little's law) and the concurrency its KV pool allows, and recommend --max-num-seqs, "
        "--max-num-active-seqs, --max-num-queued-tokens and --max-num-queued-reqs. Exits 1 when "
        "no setting can serve the load.",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--arrival-rate",
        type=float,
        required=True,
        help="requests per second arriving at the whole server (λ)",
    )
    load.add_argument("--prompt-len", type=float, required=True, help="mean prompt length in tokens")
    load.add_argument("--output-len", type=float, required=True, help="mean output length in tokens")
    load.add_argument(
        "--ttft-slo",
        type=float,
        required=True,
        help="time-to-first-token target in seconds; sizes the two admission limits",
    )
    meas = p.add_argument_group("measured on one replica")
    meas.add_argument(
        "--decode-step-time",
        type=float,
        required=True,
        help="seconds per decode step at the expected batch size (t_d; e.g. the mean "
        "inter-token latency from `fastsched bench serve`)",
    )
    meas.add_argument(
        "--prefill-throughput",
        type=float,
        required=True,
        help="prompt tokens per second one replica prefills under mixed load (T_p; the "
        "engine's logged prompt throughput, not an isolated-prefill figure)",
    )
    model = p.add_argument_group("model and KV cache")
    model.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory or .gguf file whose config gives layers, KV heads and "
        "head dim (default: the embedded SmolLM2-135M-Instruct)",
    )
    model.add_argument(
        "--dtype",
        default="bfloat16",
        choices=list(KV_DTYPE_BYTES),
        help="KV cache element type (default: bfloat16, what serve uses on CUDA)",
    )
    model.add_argument(
        "--kv-memory",
        type=parse_bytes,
        required=True,
        help="bytes for the KV pool of one replica, after weights and activations; "
        "units allowed: 40GiB, 512MiB, 80GB (binary: KiB..TiB, K..T; decimal: KB..TB)",
    )
    model.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (as serve's --block-size)"
    )
    dep = p.add_argument_group("deployment")
    dep.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas (D); each gets λ/D of the load and its own KV pool",
    )
    dep.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="gRPC frontends (K); max_num_queued_tokens is counted per frontend, so it is split over K",
    )
    dep.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        help=f"max_num_seqs target as a multiple of the concurrency lower bound "
        f"(default: {DEFAULT_HEADROOM})",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON only (no table)")
    p.set_defaults(func=run_plan)
    return p


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """The planner's inputs: the flags plus the KV shape from ``--model``'s config."""
    from fastsched.model_loader import load_model_config  # imports torch: only when planning

    config = load_model_config(args.model)
    return PlanInputs(
        arrival_rate=args.arrival_rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        decode_step_time=args.decode_step_time,
        prefill_throughput=args.prefill_throughput,
        ttft_slo=args.ttft_slo,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        kv_memory=args.kv_memory,
        dtype=args.dtype,
        data_parallel_size=args.data_parallel_size,
        block_size=args.block_size,
        api_server_count=args.api_server_count,
        headroom=args.headroom,
        max_model_len=config.max_position_embeddings,
    )


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table and verdict, or JSON with ``--json``); 0 if servable, 1 if not."""
    result = plan(inputs_from_args(args))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0 if result.servable else 1


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def format_plan(p: Plan) -> str:
    """The plan as an aligned three-column table (quantity, value, how it was computed),
    the verdict, any notes, and a ``fastsched serve`` line with the recommendations."""
    i = p.inputs
    d = i.data_parallel_size
    sections: list[tuple[str, list[tuple[str, str, str]]]] = [
        (
            f"load (per replica, D = {d})",
            [
                (
                    "arrival rate",
                    f"{p.arrival_rate_per_replica:.4g} req/s",
                    f"λ / D = {i.arrival_rate:g} / {d}",
                ),
                (
                    "prefill time",
                    f"{p.prefill_time:.4g} s",
                    f"L_prompt / T_p = {i.prompt_len:g} / {i.prefill_throughput:g}",
                ),
                (
                    "decode time",
                    f"{p.decode_time:.4g} s",
                    f"L_out · t_d = {i.output_len:g} × {i.decode_step_time:g}",
                ),
                ("service time", f"{p.service_time:.4g} s", "S = prefill + decode"),
            ],
        ),
        (
            "concurrency per replica (Little's law)",
            [
                ("decode", f"{p.decode_concurrency:.2f}", "λ/D · L_out · t_d"),
                ("prefill", f"{p.prefill_concurrency:.2f}", "λ/D · L_prompt / T_p"),
                (
                    "lower bound",
                    f"{p.concurrency_lower_bound:.2f} → {p.required_seqs}",
                    "decode + prefill, rounded up",
                ),
            ],
        ),
        (
            f"KV cache per replica ({i.dtype}, block size {i.block_size})",
            [
                (
                    "per token",
                    format_bytes(p.kv_bytes_per_token),
                    f"2 × {i.num_layers} layers × {i.num_kv_heads} KV heads × {i.head_dim} head dim × {i.dtype_bytes} B",
                ),
                (
                    "per request",
                    format_bytes(p.kv_bytes_per_request),
                    f"{p.blocks_per_request} blocks for {p.tokens_per_request} tokens (prompt + output)",
                ),
                (
                    "pool",
                    f"{p.num_kv_blocks} blocks",
                    f"{format_bytes(i.kv_memory)} / {format_bytes(p.kv_bytes_per_block)}",
                ),
                ("upper bound", f"{p.kv_upper_bound} requests", "pool blocks / blocks per request"),
            ],
        ),
        (
            "recommended settings",
            [
                (
                    "--max-num-seqs",
                    _opt(p.max_num_seqs),
                    f"{i.headroom:g} × lower bound, multiple of 8, at most the KV bound",
                ),
                ("--max-num-active-seqs", _opt(p.max_num_active_seqs), "max_num_seqs, at most the KV bound"),
                (
                    "--max-num-queued-tokens",
                    str(p.max_num_queued_tokens),
                    f"TTFT × D × T_p / K = {i.ttft_slo:g} × {d} × {i.prefill_throughput:g} / {i.api_server_count}",
                ),
                (
                    "--max-num-queued-reqs",
                    _opt(p.max_num_queued_reqs),
                    f"D × max_num_active_seqs + λ · TTFT = {d} × {_opt(p.max_num_active_seqs)} + {p.queue_headroom}",
                ),
            ],
        ),
    ]
    label_w = max(len(r[0]) for _, rows in sections for r in rows) + 4
    value_w = max(len(r[1]) for _, rows in sections for r in rows) + 2
    lines = [
        f"fastsched plan: λ = {i.arrival_rate:g} req/s over {d} replica(s), TTFT target {i.ttft_slo:g} s"
    ]
    for title, rows in sections:
        lines.append("")
        lines.append(title)
        lines.extend(f"  {label:<{label_w}}{value:>{value_w}}   {how}" for label, value, how in rows)
    lines.append("")
    lines.append(f"verdict: {p.verdict}")
    lines.extend(f"note: {note}" for note in p.notes)
    if p.max_num_seqs is not None and p.status != STATUS_NOT_SERVABLE:
        lines.append("")
        lines.append(
            f"fastsched serve --data-parallel-size {d} --api-server-count {i.api_server_count} "
            f"--dtype {i.dtype} --block-size {i.block_size} "
            f"--max-num-seqs {p.max_num_seqs} --max-num-active-seqs {p.max_num_active_seqs} "
            f"--max-num-queued-tokens {p.max_num_queued_tokens} --max-num-queued-reqs {p.max_num_queued_reqs}"
        )
    return "\n".join(lines)
