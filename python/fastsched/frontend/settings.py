"""A frontend's settings, written out and validated once (issue 21 item 4).

``fastsched serve`` builds one :class:`FrontendSettings` from its flags
(``frontend.cli_args.frontend_settings``) before it spawns anything; the same value goes into
``ServeConfig``, then to each frontend process (``FrontendSpec``), ``AsyncLLM.start`` and
the ``AdmissionController``, none of which checks it again. ``fastsched simulate`` builds
one from the same flags for its replayed frontend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastsched.limits import RequestLimits

# Streaming-input sessions (S15): fastsched serve's defaults. This module imports nothing heavy
# (the CLI and the launcher read it; a spawned child re-imports the CLI before it blocks SIGINT).
DEFAULT_SESSION_IDLE_TIMEOUT_S = 60.0  # --session-idle-timeout
SESSION_OPEN_TIMEOUT_S = 10.0  # --session-open-timeout


def _positive_int_or_none(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def _seconds(name: str, value: object, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(
            f"{name} must be a positive number of seconds{' or None' if optional else ''}, got {value!r}"
        )


@dataclass(frozen=True)
class FrontendSettings:
    """Admission (docs/design.md §6), the limits on what a request controls, timeouts and
    request logging of every frontend of one server."""

    max_num_queued_reqs: int | None = None  # A2 over all frontends; None: off
    max_num_queued_tokens: int | None = None  # A3, per frontend; None: off
    ttft_slo: float | None = None  # seconds; the TTFT-SLO valve (frontend.admission); None: off
    tpot_slo: float | None = None  # seconds; with ttft_slo, the goodput valve's targets (A7); None: off
    fault_tolerance: bool = False  # A1
    num_frontends: int = 1  # the TTFT-SLO limit is shared among them
    # Seconds a streaming session may wait for input (S15); None: no limit.
    session_idle_timeout: float | None = DEFAULT_SESSION_IDLE_TIMEOUT_S
    max_sessions: int | None = None  # sessions open at once over the server; None: a quarter of max_num_seqs
    session_open_timeout: float = (
        SESSION_OPEN_TIMEOUT_S  # seconds a gRPC GenerateSession has to send its `open`
    )
    engine_timeout: float = (
        5.0  # seconds of silence before an engine (or, for the launcher, a frontend) is hung
    )
    ready_timeout: float = 300.0  # seconds for the engines to report READY
    limits: RequestLimits = field(default_factory=RequestLimits)
    enable_log_requests: bool = False
    max_log_len: int | None = None  # characters (or token ids) logged of each thing a request sent
    # Data parallelism (frontend.routing): which engine a request goes to.
    routing: str = "prefix"  # "prefix" (longest cached prefix, within routing_load_bound) or "load"
    routing_summary_blocks: int = 1 << 20  # block hashes the prefix summary keeps (LRU)
    routing_load_bound: int = 8  # sequences in flight above the least-loaded engine before prefix yields

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens", "num_frontends"):
            _positive_int_or_none(name, getattr(self, name))
        _seconds("ttft_slo", self.ttft_slo, optional=True)
        _seconds("tpot_slo", self.tpot_slo, optional=True)
        _seconds("session_idle_timeout", self.session_idle_timeout, optional=True)
        _seconds("session_open_timeout", self.session_open_timeout)
        if self.max_sessions is not None and (isinstance(self.max_sessions, bool) or self.max_sessions < 0):
            raise ValueError(f"max_sessions must be at least 0, got {self.max_sessions}")
        _seconds("engine_timeout", self.engine_timeout)
        _seconds("ready_timeout", self.ready_timeout)
        if self.max_log_len is not None and (isinstance(self.max_log_len, bool) or self.max_log_len < 0):
            raise ValueError(f"max_log_len must be at least 0, got {self.max_log_len}")
        if self.routing not in ("prefix", "load"):
            raise ValueError(f"routing must be 'prefix' or 'load', got {self.routing!r}")
        if (
            isinstance(self.routing_summary_blocks, bool)
            or not isinstance(self.routing_summary_blocks, int)
            or self.routing_summary_blocks < 1
        ):
            raise ValueError(
                f"routing_summary_blocks must be a positive integer, got {self.routing_summary_blocks!r}"
            )
        if (
            isinstance(self.routing_load_bound, bool)
            or not isinstance(self.routing_load_bound, int)
            or self.routing_load_bound < 0
        ):
            raise ValueError(
                f"routing_load_bound must be an integer at least 0, got {self.routing_load_bound!r}"
            )
