"""``fastsched top``: a live terminal view of a running server, from its ``/metrics``.

Polls the gateway every ``--interval`` seconds and redraws one frame (top_screen.py).
``--once``, and any stdout that is not a terminal, prints one frame from two scrapes
``--interval`` apart and exits, 1 if the server cannot be read. The screen's libraries
(httpx, rich: the ``serve`` extra) are imported when the command runs, so that building
``fastsched``'s parser never needs them.

Wiring (entrypoints/cli.py)::

    from fastsched.tools.top import add_top_parser
    add_top_parser(sub)          # sets func=run_top on the subcommand
"""

from __future__ import annotations

import argparse

from fastsched.tools.bench_serve import DEFAULT_URL


def run_top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise ValueError(f"--interval must be positive, got {args.interval}")
    if args.iterations is not None and args.iterations < 1:
        raise ValueError(f"--iterations must be at least 1, got {args.iterations}")
    from fastsched.tools.top_screen import show

    return show(args.url.rstrip("/"), args.interval, once=args.once, iterations=args.iterations)


def add_top_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``top`` subcommand to ``subparsers`` (with ``func=run_top``) and return it."""
    p = subparsers.add_parser(
        "top",
        help="live view of a running server's load, latency and scheduler gates (from /metrics)",
        description="Poll a running gateway's /metrics and redraw: requests running and waiting, KV cache "
        "usage, preemptions, prompt and generation tokens/s, TTFT / queue time / end-to-end "
        "p50 and p99 over the last interval, admission rejections/s by reason, and per engine "
        "the scheduler gate that stopped its last scan (red when it held requests back). "
        "Metrics the server does not export show as '–'. Ctrl-C exits.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"the gateway's base URL (default: {DEFAULT_URL})")
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between scrapes; rates and quantiles cover this window (default: 1.0)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="print one frame (two scrapes --interval apart) and exit; exit 1 if the server "
        "cannot be read. Also what happens when stdout is not a terminal",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=None,
        metavar="N",
        help="on a terminal, stop after N scrapes (default: run until Ctrl-C)",
    )
    p.set_defaults(func=run_top)
    return p
