"""The engine's half of ``GET /debug/requests/{id}``: what the scheduler knows about
in-flight requests, read between two steps when a frontend sends a QUERY."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastsched.engine.protocol import UNKNOWN, EngineRequestStatus

if TYPE_CHECKING:
    from fastsched import _core

# The scan stop that names no gate: the scan ran out of waiting requests, so one still
# waiting came after that step or was skipped for a reason of its own (S7).
_NO_GATE = "no_waiting"


def engine_statuses(scheduler: _core.Scheduler, request_ids: Sequence[str]) -> list[EngineRequestStatus]:
    """What the scheduler knows about each id. The waiting queue is listed (O(waiting))
    only when one of them waits."""
    waiting: dict[int, int] | None = None
    blocked_by: str | None = None
    statuses = []
    for request_id in request_ids:
        handle = scheduler.handle_of(request_id)
        if handle is None:
            statuses.append(EngineRequestStatus(request_id, UNKNOWN))
            continue
        info = scheduler.request_info(handle)
        status = EngineRequestStatus(
            request_id,
            info["status"],
            info["num_tokens"],
            info["num_prompt_tokens"],
            info["num_output_tokens"],
            info["num_computed_tokens"],
            info["num_cached_tokens"],
            info["num_preemptions"],
            info["priority"],
            len(info["blocks"]),
        )
        if info["status"] != "running":
            if waiting is None:
                waiting = {h: i for i, h in enumerate(scheduler.waiting_handles())}
                stop = scheduler.stats()["last_scan_stop"]
                blocked_by = None if stop == _NO_GATE else stop
            if handle in waiting:
                status.queue_position, status.num_waiting, status.blocked_by = (
                    waiting[handle],
                    len(waiting),
                    blocked_by,
                )
        statuses.append(status)
    return statuses
