"""Where is my request? (``GET /debug/requests/{id}``, gRPC ``GetRequestStatus``).

A request is in one of three places, each answered by the part that knows it:

- rejected at the door, or ended: only the frontend remembers it, so it keeps a
  :class:`RequestHistory` of the most recent ones (a request that left no trace in any
  counter (A5) still leaves one here, for the person asking why);
- in flight: its engine answers from the scheduler (``fastsched.engine.status.engine_statuses``, run in the
  engine process between two steps) and the frontend adds what it holds itself (the
  sequences a stop string already ended, the latencies).

The answers are plain dicts of JSON values, the same shape at every hop: the frontend
builds them, gRPC carries them as ``RequestStatusResponse`` field for field, and the
gateway prints them. A field that does not apply is absent, never null.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from fastsched.engine.protocol import UNKNOWN, EngineRequestStatus

if TYPE_CHECKING:
    from fastsched.frontend.admission import AdmissionError
    from fastsched.outputs import CompletionOutput, RequestMetrics

HISTORY_SIZE = 10_000  # rejected or ended requests a frontend remembers (about 1 KB each)
FINISHED = "finished"
REJECTED = "rejected"
MIXED = "mixed"  # a request's sequences (or a response's prompts) are in different states


class RequestHistory:
    """The last ``capacity`` requests this frontend rejected or ended, by request id; a
    newer record of an id replaces the older one, the oldest record goes first."""

    def __init__(self, capacity: int = HISTORY_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, record: dict[str, Any]) -> None:
        request_id = record["request_id"]
        self._records.pop(request_id, None)
        self._records[request_id] = record
        if len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> dict[str, Any] | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)


def combined_state(states: Iterable[str]) -> str:
    """One state for several: theirs when they agree, ``mixed`` when they do not."""
    distinct = set(states)
    return distinct.pop() if len(distinct) == 1 else MIXED


def rejected_status(
    request_id: str, frontend: int, error: AdmissionError, arrival_time: float, num_prompt_tokens: int
) -> dict[str, Any]:
    status = {
        "request_id": request_id,
        "state": REJECTED,
        "frontend": frontend,
        "reason": error.reason,
        "message": str(error),
        "metrics": {"arrival_time": arrival_time, "num_prompt_tokens": num_prompt_tokens},
    }
    prediction = getattr(error, "prediction", None)  # the goodput valve's (A7)
    if prediction is not None:
        status["slo_prediction"] = prediction.as_dict()
    return status


def in_flight_status(
    request_id: str,
    frontend: int,
    engine: int,
    outputs: Sequence[CompletionOutput],
    child_ids: Sequence[str],
    replies: dict[str, EngineRequestStatus],
    metrics: RequestMetrics,
) -> dict[str, Any]:
    """``replies``: the engine's answer for the children still live there; the others
    have ended in this frontend (a stop string) and are reported from ``outputs``."""
    sequences = []
    for o, child_id in zip(outputs, child_ids):
        reply = replies.get(child_id)
        sequences.append(_finished_sequence(o) if reply is None else _engine_sequence(o.index, reply))
    return _with_metrics(
        {
            "request_id": request_id,
            "state": combined_state(s["state"] for s in sequences),
            "frontend": frontend,
            "engine": engine,
            "sequences": sequences,
        },
        metrics,
        outputs,
    )


def ended_status(
    request_id: str,
    frontend: int,
    engine: int,
    outputs: Sequence[CompletionOutput],
    metrics: RequestMetrics,
    error: str | None,
) -> dict[str, Any]:
    """A request that ended: finished, aborted (a sequence without a finish reason and no
    ``error`` was aborted), ignored by its engine, or failed with ``error`` (its engine died)."""
    sequences = []
    for o in outputs:
        sequence = _finished_sequence(o)
        if o.finish_reason is None and error is None:
            sequence["finish_reason"] = "abort"
        sequences.append(sequence)
    status: dict[str, Any] = {
        "request_id": request_id,
        "state": FINISHED,
        "frontend": frontend,
        "engine": engine,
        "sequences": sequences,
    }
    ignored = next((o for o in outputs if o.finish_reason == "ignored"), None)
    message = error or (
        None if ignored is None else str(ignored.stop_reason or "the engine refused the request")
    )
    if message is not None:
        status["message"] = message
    return _with_metrics(status, metrics, outputs)


def _finished_sequence(o: CompletionOutput) -> dict[str, Any]:
    sequence: dict[str, Any] = {"index": o.index, "state": FINISHED, "num_output_tokens": len(o.token_ids)}
    if o.finish_reason is not None:
        sequence["finish_reason"] = o.finish_reason
    return sequence


def _engine_sequence(index: int, reply: EngineRequestStatus) -> dict[str, Any]:
    if reply.status == UNKNOWN:
        return {"index": index, "state": UNKNOWN}
    fields = msgspec.structs.asdict(reply)
    del fields["request_id"], fields["status"]
    return {"index": index, "state": reply.status, **{k: v for k, v in fields.items() if v is not None}}


def _with_metrics(
    status: dict[str, Any], metrics: RequestMetrics, outputs: Sequence[CompletionOutput]
) -> dict[str, Any]:
    """The tokens generated so far are counted now: ``metrics`` has them only at the end."""
    values = {**vars(metrics), "num_generation_tokens": sum(len(o.token_ids) for o in outputs)}
    status["metrics"] = {k: v for k, v in values.items() if v is not None}
    return status
