"""The frontend's admission flags (docs/design.md §6), shared by ``fastsched serve`` and
``fastsched simulate`` (which applies them as one frontend), and the one place that turns
``fastsched serve``'s flags into :class:`FrontendSettings`."""

from __future__ import annotations

import argparse

from fastsched.frontend.settings import FrontendSettings
from fastsched.limits import request_limits
from fastsched.units import parse_count


def add_admission_limit_args(group: argparse._ArgumentGroup) -> None:
    """Add ``--max-num-queued-reqs``, ``--max-num-queued-tokens``, ``--ttft-slo`` and ``--tpot-slo`` to ``group``."""
    group.add_argument(
        "--max-num-queued-reqs",
        type=parse_count,
        default=None,
        help="A2: reject (503) a request when the requests in flight over all frontends would "
        "exceed this (default: no limit)",
    )
    group.add_argument(
        "--max-num-queued-tokens",
        type=parse_count,
        default=None,
        help="A3: reject (503) a request when the prompt tokens still in prefill reach this "
        "(default: no limit)",
    )
    group.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="TTFT target: reject (503, reason ttft_slo) a request when the prompt tokens in "
        "prefill, its own included, exceed SECONDS x the prefill throughput the engines measure "
        "while requests wait (until measured: two scheduler steps' worth per engine). "
        "The limit is the metric fastsched:admission_queued_tokens_limit (default: off)",
    )
    group.add_argument(
        "--tpot-slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="TPOT target, the goodput valve (A7): reject (503, reason slo) a request when, from "
        "the engines' measured step time and the requests decoding and queued, its predicted "
        "TTFT would exceed --ttft-slo (if set) or the predicted time per output token of the "
        "running requests would exceed SECONDS (default: off)",
    )


def add_routing_args(group: argparse._ArgumentGroup) -> None:
    """Add ``--routing``, ``--routing-summary-blocks`` and ``--routing-load-bound`` (``frontend.routing``)."""
    group.add_argument(
        "--routing",
        choices=("prefix", "load"),
        default="prefix",
        help="with --data-parallel-size > 1, the engine a request goes to: 'prefix', the one holding "
        "the longest prefix of its prompt in its prefix cache (unless it has more than "
        "--routing-load-bound sequences in flight above the least-loaded one); 'load', the "
        "least-loaded one (default: prefix)",
    )
    group.add_argument(
        "--routing-summary-blocks",
        type=parse_count,
        default=1 << 20,
        metavar="N",
        help="--routing prefix: block hashes each frontend remembers of what the engines cache, the "
        "least recently used forgotten first (default: 1Mi, on the order of 100 MB)",
    )
    group.add_argument(
        "--routing-load-bound",
        type=int,
        default=8,
        metavar="N",
        help="--routing prefix: sequences in flight beyond the least-loaded engine's at which the "
        "engine with the longest cached prefix gives way to the least-loaded one (default: 8)",
    )


def frontend_settings(args: argparse.Namespace) -> FrontendSettings:
    """The frontends' settings from ``fastsched serve``'s flags, validated (``ValueError``
    naming the setting) before anything is spawned."""
    return FrontendSettings(
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo,
        fault_tolerance=args.enable_fault_tolerance,
        num_frontends=args.api_server_count,
        session_idle_timeout=args.session_idle_timeout or None,
        max_sessions=args.max_sessions,
        session_open_timeout=args.session_open_timeout,
        engine_timeout=args.engine_timeout,
        ready_timeout=args.ready_timeout,
        limits=request_limits(args),
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        routing=args.routing,
        routing_summary_blocks=args.routing_summary_blocks,
        routing_load_bound=args.routing_load_bound,
    )
