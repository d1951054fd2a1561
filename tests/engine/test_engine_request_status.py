"""Where is my request, the parts without processes (``frontend.request_status``): what a
real scheduler says about a request id between two steps, the QUERY / STATUS messages
that carry it, and the frontend's bounded memory of rejected and ended requests."""

from __future__ import annotations

import numpy as np
import pytest

msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from fastsched import _core  # noqa: E402
from fastsched.engine import protocol  # noqa: E402
from fastsched.engine.status import engine_statuses  # noqa: E402
from fastsched.frontend.admission import QueueOverflowError  # noqa: E402
from fastsched.frontend.request_status import (  # noqa: E402
    RequestHistory,
    combined_state,
    ended_status,
    in_flight_status,
    rejected_status,
)
from fastsched.outputs import CompletionOutput, RequestMetrics  # noqa: E402


def make_scheduler(**overrides: int) -> _core.Scheduler:
    config = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_gpu_blocks=65
    )
    return _core.Scheduler(_core.SchedulerConfig(**{**config, **overrides}))


def prompt(i: int, length: int = 10) -> list[int]:
    """Distinct per ``i``, so that no two requests share prefix-cache blocks."""
    return [100 * (i + 1) + t for t in range(length)]


def status_of(sched: _core.Scheduler, *request_ids: str) -> dict[str, protocol.EngineRequestStatus]:
    return {s.request_id: s for s in engine_statuses(sched, list(request_ids))}


# ------------------------------------------------------------------ engine side


def test_running_request_reports_its_computed_tokens_and_blocks() -> None:
    sched = make_scheduler()
    sched.add_request("a", prompt(0), 8, priority=2)
    sched.schedule()
    a = status_of(sched, "a")["a"]
    assert (a.status, a.num_prompt_tokens, a.num_computed_tokens, a.num_blocks) == ("running", 10, 10, 3)
    assert (a.num_preemptions, a.priority, a.num_cached_tokens) == (0, 2, 0)
    assert (a.queue_position, a.num_waiting, a.blocked_by) == (None, None, None)


def test_waiting_requests_report_their_queue_position_and_the_gate_that_held_them() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for i, request_id in enumerate("abc"):
        sched.add_request(request_id, prompt(i), 8)
    sched.schedule()
    s = status_of(sched, "a", "b", "c")
    assert s["a"].status == "running"
    assert [(s[r].status, s[r].queue_position, s[r].num_waiting, s[r].blocked_by) for r in "bc"] == [
        ("waiting", 0, 2, "active_seqs"),
        ("waiting", 1, 2, "active_seqs"),
    ]
    assert (s["b"].num_computed_tokens, s["b"].num_blocks, s["b"].num_cached_tokens) == (0, 0, None)


def test_waiting_request_held_by_a_full_kv_pool_names_kv_blocks() -> None:
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=16)  # 4 usable blocks: one 10-token prompt fits
    sched.add_request("a", prompt(0), 4)
    sched.add_request("b", prompt(1), 4)
    sched.schedule()
    b = status_of(sched, "b")["b"]
    assert (b.status, b.queue_position, b.blocked_by) == ("waiting", 0, "kv_blocks")


def test_waiting_request_that_no_step_has_seen_names_no_gate() -> None:
    sched = make_scheduler()
    sched.add_request("a", prompt(0), 8)
    assert status_of(sched, "a")["a"].blocked_by is None  # before the first step
    sched.schedule()  # admits a; its scan ran out of waiting requests (no_waiting)
    sched.add_request("b", prompt(1), 8)
    b = status_of(sched, "b")["b"]
    assert (b.status, b.queue_position, b.blocked_by) == ("waiting", 0, None)


def test_finished_or_never_seen_request_is_unknown_to_the_engine() -> None:
    sched = make_scheduler()
    sched.add_request("a", prompt(0), 1)
    sched.schedule()
    sched.update_from_tokens(np.array([7]))  # its one token: finished
    s = status_of(sched, "a", "never")
    assert [s[r].status for r in ("a", "never")] == ["unknown", "unknown"]
    assert s["a"] == protocol.EngineRequestStatus("a", "unknown")


# ------------------------------------------------------------------ protocol


def test_protocol_round_trips_query_and_status() -> None:
    waiting = protocol.EngineRequestStatus("r#1", "waiting", 12, 12, 0, 0, None, 1, -3, 0, 4, 9, "kv_blocks")
    messages = [
        protocol.Query(7, ["r#0", "r#1"], 1),
        protocol.Status(
            0,
            7,
            [
                protocol.EngineRequestStatus("r#0", "running", 20, 12, 8, 20, 4, 0, 0, 2),
                waiting,
                protocol.EngineRequestStatus("r#2", "unknown"),
            ],
        ),
        protocol.Status(1, 8, []),
    ]
    for msg in messages:
        assert protocol.decode(protocol.encode(msg)) == msg


@pytest.mark.parametrize(
    "wire",
    [
        msgpack.packb(["query", 1, "r", 0]),  # ids must be an array
        msgpack.packb(["query", -1, ["r"], 0]),
        msgpack.packb(["query", 1, [3], 0]),
        msgpack.packb(["query", 1, ["r"]]),  # a field short
        msgpack.packb(
            ["status", 0, 1, {"request_id": "r", "status": "waiting"}]
        ),  # statuses must be an array
        msgpack.packb(["status", 0, 1, [{"request_id": "r"}]]),  # no status
        msgpack.packb(["status", 0, 1, [{"request_id": "r", "status": "waiting", "evil": 1}]]),
        msgpack.packb(["status", 0, 1, [{"request_id": "r", "status": "waiting", "queue_position": -1}]]),
        msgpack.packb(["status", 0, 1, [{"request_id": "r", "status": "waiting", "num_blocks": "3"}]]),
        msgpack.packb(["status", 0, 1, [{"request_id": "r", "status": "waiting", "blocked_by": 3}]]),
        msgpack.packb(["status", 0, 1, [{"request_id": "r", "status": 2}]]),
    ],
)
def test_protocol_rejects_malformed_query_and_status(wire: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(wire)


# ------------------------------------------------------------------ frontend records


def test_history_keeps_only_the_most_recent_records() -> None:
    history = RequestHistory(capacity=3)
    for i in range(5):
        history.add({"request_id": f"r{i}", "state": "finished"})
    assert len(history) == 3
    assert [history.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]


def test_history_newer_record_of_an_id_replaces_the_older_and_is_kept_longest() -> None:
    history = RequestHistory(capacity=2)
    history.add({"request_id": "a", "state": "rejected"})
    history.add({"request_id": "b", "state": "finished"})
    history.add({"request_id": "a", "state": "finished"})  # retried after its rejection
    history.add({"request_id": "c", "state": "finished"})
    assert history.get("a") == {"request_id": "a", "state": "finished"} and history.get("b") is None


def test_rejected_status_names_the_reason_and_the_message() -> None:
    error = QueueOverflowError("3 requests in flight would exceed max_num_queued_reqs (2)")
    assert rejected_status("r", 1, error, 100.5, 12) == {
        "request_id": "r",
        "state": "rejected",
        "frontend": 1,
        "reason": "max_num_queued_reqs",
        "message": "3 requests in flight would exceed max_num_queued_reqs (2)",
        "metrics": {"arrival_time": 100.5, "num_prompt_tokens": 12},
    }


def test_ended_sequence_without_finish_reason_was_aborted_unless_the_request_failed() -> None:
    outputs = [CompletionOutput(0, "ab", [1, 2], "length"), CompletionOutput(1, "a", [1])]
    metrics = RequestMetrics(100.0, queue_time=0.5, ttft=1.0, e2e=2.0, num_prompt_tokens=5)
    aborted = ended_status("r", 0, 1, outputs, metrics, None)
    assert aborted["state"] == "finished" and "message" not in aborted
    assert aborted["sequences"] == [
        {"index": 0, "state": "finished", "num_output_tokens": 2, "finish_reason": "length"},
        {"index": 1, "state": "finished", "num_output_tokens": 1, "finish_reason": "abort"},
    ]
    assert aborted["metrics"] == {
        "arrival_time": 100.0,
        "queue_time": 0.5,
        "ttft": 1.0,
        "e2e": 2.0,
        "num_prompt_tokens": 5,
        "num_generation_tokens": 3,
    }
    failed = ended_status("r", 0, 1, outputs, metrics, "engine 1 died: its process exited")
    assert failed["message"] == "engine 1 died: its process exited"
    assert "finish_reason" not in failed["sequences"][1]


def test_ignored_request_says_why_in_its_message() -> None:
    outputs = [CompletionOutput(0, "", [], "ignored", "the prompt (900 tokens) is longer than the KV pool")]
    status = ended_status("r", 0, 0, outputs, RequestMetrics(1.0), None)
    assert status["message"] == "the prompt (900 tokens) is longer than the KV pool"
    assert status["sequences"][0]["finish_reason"] == "ignored"


def test_in_flight_status_reports_engine_sequences_and_those_a_stop_string_ended() -> None:
    outputs = [CompletionOutput(0, "x", [5], "stop", "x"), CompletionOutput(1)]
    reply = protocol.EngineRequestStatus("r#1", "waiting", 6, 6, 0, 0, None, 0, 0, 0, 2, 3, "token_budget")
    status = in_flight_status("r", 0, 1, outputs, ["r#0", "r#1"], {"r#1": reply}, RequestMetrics(1.0))
    assert status["state"] == "mixed" and (status["frontend"], status["engine"]) == (0, 1)
    assert status["sequences"] == [
        {"index": 0, "state": "finished", "num_output_tokens": 1, "finish_reason": "stop"},
        {
            "index": 1,
            "state": "waiting",
            "num_tokens": 6,
            "num_prompt_tokens": 6,
            "num_output_tokens": 0,
            "num_computed_tokens": 0,
            "num_preemptions": 0,
            "priority": 0,
            "num_blocks": 0,
            "queue_position": 2,
            "num_waiting": 3,
            "blocked_by": "token_budget",
        },
    ]
    assert status["metrics"] == {"arrival_time": 1.0, "num_prompt_tokens": 0, "num_generation_tokens": 1}


def test_combined_state_is_the_common_one_or_mixed() -> None:
    assert combined_state(["running", "running"]) == "running"
    assert combined_state(["running", "waiting"]) == "mixed"
