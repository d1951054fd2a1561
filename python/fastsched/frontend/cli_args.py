"""The frontend's admission flags (docs/design.md §6), shared by ``fastsched serve`` and
``fastsched simulate`` (which applies them as one frontend)."""

from __future__ import annotations

import argparse

from fastsched.units import parse_count

# Streaming-input sessions (S15): fastsched serve's defaults, here so that the CLI and the launcher
# read them without importing the frontend (a spawned child re-imports the CLI before it blocks SIGINT).
DEFAULT_SESSION_IDLE_TIMEOUT_S = 60.0  # --session-idle-timeout
SESSION_OPEN_TIMEOUT_S = 10.0  # --session-open-timeout


def add_admission_limit_args(group: argparse._ArgumentGroup) -> None:
    """Add ``--max-num-queued-reqs``, ``--max-num-queued-tokens`` and ``--ttft-slo`` to ``group``."""
    group.add_argument("--max-num-queued-reqs", type=parse_count, default=None,
                       help="A2: reject (503) a request when the requests in flight over all frontends would "
                            "exceed this (default: no limit)")
    group.add_argument("--max-num-queued-tokens", type=parse_count, default=None,
                       help="A3: reject (503) a request when the prompt tokens still in prefill reach this "
                            "(default: no limit)")
    group.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                       help="TTFT target: reject (503, reason ttft_slo) a request when the prompt tokens in "
                            "prefill, its own included, exceed SECONDS x the prefill throughput the engines measure "
                            "while requests wait (until measured: two scheduler steps' worth per engine). "
                            "The limit is the metric fastsched:admission_queued_tokens_limit (default: off)")
