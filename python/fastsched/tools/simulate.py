"""``fastsched simulate``: what ``bench serve`` would measure, from the scheduler alone.

Wiring (``fastsched.entrypoints.cli``)::

    from fastsched.tools.simulate import add_simulate_parser
    add_simulate_parser(sub)          # sets func=run_simulate on the subcommand

The engine flags are ``fastsched serve``'s (``fastsched.config.add_engine_args``), so a config is written
once and simulated or served alike; the admission flags are serve's too. The report is
``bench serve``'s table and JSON (its ``summarize``: same percentiles, same throughput
definitions) plus the engine's side: steps, preemptions, and the wall time simulating took.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastsched.tools.bench_report import format_table, summarize
from fastsched.tools.workload import add_workload_args, check_range_ratio, parse_token_id_range

# Engine flags simulate does not take: --seed seeds the workload (as bench serve's) and
# --step-trace records the simulated steps, not an engine's.
SIMULATE_OWN_FLAGS = ("seed", "step_trace")

if TYPE_CHECKING:
    from fastsched.tools.simulator import StepCost, TraceRequest
    from fastsched.tools.simulator.sizing import SimulatedEngine


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``simulate`` subcommand to ``subparsers`` (with ``func=run_simulate``) and return it."""
    from fastsched.config import add_engine_args
    from fastsched.frontend.cli_args import add_admission_limit_args

    p = subparsers.add_parser(
        "simulate",
        help="replay a request trace through the real scheduler with a step-cost model (no model run)",
        description="Replay a request trace (a JSONL file, or the Poisson trace `fastsched bench serve` sends) "
        "through the real Rust scheduler and the frontend's admission control, on a virtual clock "
        "advanced by a step-cost model t_step = a + b*batched_tokens + c*running_reqs (fitted by "
        "`fastsched bench fit-step-cost` or `fastsched bench steps`). Reports what bench serve would: "
        "TTFT/ITL/TPOT/E2E percentiles, throughput and 503s by reason, plus steps and preemptions. "
        "Simulates one engine and one frontend. Engine flags are serve's; those that change only how "
        "the model runs (--attention-backend, --gpu-memory-utilization) do not change the result.",
    )
    # The groups are made first so that --help lists them before the engine's.
    trace = p.add_argument_group("requests (a --trace file, or bench serve's generator)")
    cost = p.add_argument_group("step cost (one of)")
    adm = p.add_argument_group(
        "admission control, as `fastsched serve` (one frontend; --ttft-slo measures the modelled steps, "
        "and the limit at each run's end is in the engine table)"
    )
    out = p.add_argument_group("output")
    add_engine_args(p, exclude=SIMULATE_OWN_FLAGS)
    trace.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help='JSONL, one request a line: {"arrival_time": seconds, "prompt_len": tokens, '
        '"output_len": tokens, "priority": int (optional)}; excludes --qps, and --seed then '
        "seeds the prompt token ids",
    )
    add_workload_args(trace)
    p.set_defaults(qps=None)  # None: no rate given, so a --trace may be used (1 req/s otherwise)
    cost.add_argument(
        "--cost-model",
        default=None,
        metavar="FILE",
        help="JSON with a, b, c in seconds, as `fastsched bench fit-step-cost --out` writes",
    )
    cost.add_argument(
        "--step-cost",
        type=float,
        nargs=3,
        default=None,
        metavar=("A", "B", "C"),
        help="the coefficients given directly: seconds per step, per batched token, per running request",
    )
    add_admission_limit_args(adm)
    adm.add_argument(
        "--frontend-latency",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="constant added to every answer's TTFT and E2E: the HTTP/gRPC/ZMQ path that engine steps "
        "do not include; measure it as bench serve's p50 TTFT at a load where requests do not "
        "queue, minus one prefill step (default: 0)",
    )
    out.add_argument("--out", default=None, metavar="FILE", help="write the report as JSON to FILE")
    out.add_argument(
        "--step-trace",
        default=None,
        metavar="FILE",
        help="append one JSON line per simulated step (shape and modelled duration, times on the "
        "virtual clock) to FILE, in the engine's --step-trace format",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> int:
    from fastsched.config import EngineConfig, engine_kwargs
    from fastsched.engine.step_trace import StepTracer
    from fastsched.tools.simulator import Simulator
    from fastsched.tools.simulator.sizing import simulated_engine

    cost = _cost_from_args(args)
    traces = _traces_from_args(args)
    config = EngineConfig.from_kwargs(**engine_kwargs(args, exclude=SIMULATE_OWN_FLAGS))
    engine = simulated_engine(config)
    tracer = StepTracer(args.step_trace) if args.step_trace else None
    sim = Simulator(
        engine.scheduler_config,
        cost,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo,
        frontend_latency=args.frontend_latency,
        step_tracer=tracer,
    )
    summaries = []
    for label, qps, trace in traces:
        run = sim.run(trace, label, progress=not args.no_progress)
        summary = summarize(qps, run.results, run.duration_s)
        if args.trace is not None:
            summary["qps"] = label  # a trace file has no rate of its own
        summary.update(
            num_steps=run.num_steps,
            num_preemptions=run.num_preemptions,
            num_preempted_requests=run.num_preempted_requests,
            wall_time_s=run.wall_time_s,
            prefill_tokens_per_s=run.prefill_tokens_per_s,
            queued_tokens_limit=run.queued_tokens_limit,
        )
        summaries.append(summary)
    if tracer is not None:
        tracer.close()
    sc = engine.scheduler_config
    print(
        f"\nfastsched simulate: model={config.model or 'SmolLM2-135M-Instruct (embedded)'} "
        f"num_gpu_blocks={engine.num_gpu_blocks} max_model_len={engine.max_model_len} "
        f"max_num_seqs={sc.max_num_seqs} max_num_batched_tokens={sc.max_num_batched_tokens}; "
        f"step cost a={cost.a * 1e3:.4g} ms b={cost.b * 1e6:.4g} us/token c={cost.c * 1e6:.4g} us/request; "
        f"frontend latency {args.frontend_latency * 1e3:.4g} ms"
        + (f"; ttft_slo {args.ttft_slo:g} s" if args.ttft_slo is not None else "")
        + (f"; tpot_slo {args.tpot_slo:g} s" if args.tpot_slo is not None else "")
    )
    print(format_table(summaries))
    print(format_engine_table(summaries))
    if args.out:
        report = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "simulated": True,
            "model": config.model,
            "config": _config_report(args, engine, cost),
            "results": summaries,
        }
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def _config_report(args: argparse.Namespace, engine: SimulatedEngine, cost: StepCost) -> dict[str, Any]:
    """Everything that decided the result, so a report can be reproduced."""
    from fastsched.config import engine_kwargs

    generated = args.trace is None
    return {
        "engine": engine_kwargs(args, exclude=SIMULATE_OWN_FLAGS),
        "num_gpu_blocks": engine.num_gpu_blocks,
        "max_model_len": engine.max_model_len,
        "step_cost": {"a": cost.a, "b": cost.b, "c": cost.c},
        "max_num_queued_reqs": args.max_num_queued_reqs,
        "max_num_queued_tokens": args.max_num_queued_tokens,
        "ttft_slo": args.ttft_slo,
        "tpot_slo": args.tpot_slo,
        "frontend_latency": args.frontend_latency,
        "trace": args.trace,
        "qps": [str(q) for q in args.qps or [1.0]] if generated else None,
        "num_requests": args.num_requests if generated else None,
        "prompt_len": args.prompt_len if generated else None,
        "output_len": args.output_len if generated else None,
        "random_range_ratio": args.range_ratio if generated else None,
        "seed": args.seed,
        "token_id_range": args.token_id_range,
    }


def format_engine_table(summaries: list[dict[str, Any]]) -> str:
    """The engine's side of each run, which a client cannot see; the prefill throughput
    its meter held at the end, and the TTFT-SLO limit then when --ttft-slo is on."""
    slo = any(s.get("queued_tokens_limit") is not None for s in summaries)
    header = [
        "QPS",
        "steps",
        "preemptions",
        "preempted reqs",
        "prefill tok/s",
        *(["ttft_slo limit"] * slo),
        "simulated s",
        "wall s",
    ]
    rows = [
        [
            str(s["qps"]),
            str(s["num_steps"]),
            str(s["num_preemptions"]),
            str(s["num_preempted_requests"]),
            "-" if s.get("prefill_tokens_per_s") is None else f"{s['prefill_tokens_per_s']:.0f}",
            *([str(s.get("queued_tokens_limit"))] * slo),
            f"{s['duration']:.2f}",
            f"{s['wall_time_s']:.2f}",
        ]
        for s in summaries
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def _cost_from_args(args: argparse.Namespace) -> StepCost:
    from fastsched.tools.simulator import StepCost

    if (args.cost_model is None) == (args.step_cost is None):
        raise ValueError("give the step cost model: --cost-model FILE or --step-cost A B C (one of them)")
    if args.cost_model is not None:
        return StepCost.load(args.cost_model)
    return StepCost(*args.step_cost)


def _traces_from_args(args: argparse.Namespace) -> list[tuple[str, float, list[TraceRequest]]]:
    """(label, qps for summarize, requests) per run: the trace file, or one per --qps."""
    from fastsched.tools.simulator import bench_trace, load_trace

    token_id_range = parse_token_id_range(args.token_id_range)
    if args.trace is not None:
        if args.qps is not None:
            raise ValueError("--trace and --qps exclude each other: the trace file has its own arrival times")
        return [(Path(args.trace).name, 0.0, load_trace(args.trace, args.seed, token_id_range))]
    if args.num_requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --prompt-len and --output-len must be at least 1")
    rates = args.qps or [1.0]
    if any(not q > 0 for q in rates):
        raise ValueError(f"--qps values must be positive, got {rates}")
    ratio = check_range_ratio(args.range_ratio)
    return [
        (
            f"qps {q:g}",
            q,
            bench_trace(
                args.num_requests, q, args.prompt_len, args.output_len, args.seed, i, token_id_range, ratio
            ),
        )
        for i, q in enumerate(rates)
    ]
