"""The frontend's one table of requests in flight: each request's state (its ``n``
children and which of them still prefill, its outputs, its engine) and the sequences
each engine has from this frontend, in one place.

Engine outputs come in by child id; the table applies them (detokenizing through the
request's :class:`OutputProcessor`) and publishes what happened as events, to which
the rest of the frontend subscribes instead of being called from one ``_finish``:

- ``added(state)``: a request was registered (the LoRA registry counts its adapter);
- ``first_token(state)``: its first child produced a token (admission's A3 counter);
- ``segment_ended(state)``: a streaming session finished a segment (its idle timer);
- ``child_finished(state, index, child_id, reason)``: one completion ended (request metrics);
- ``finished(state, error, counted)``: the request left the table; ``counted`` is False
  when it failed or the engine ignored it (history, the request log, request metrics,
  admission, the LoRA registry, the session timer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastsched.engine import protocol
from fastsched.engine.protocol import EngineCoreOutput
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.frontend.routing import RoutingDecision
from fastsched.frontend.session import SessionState
from fastsched.outputs import RequestMetrics, RequestOutput

__all__ = ["RequestState", "RequestTable"]


@dataclass
class RequestState:
    request_id: str
    engine_index: int
    n: int
    parent: RequestOutput
    processor: OutputProcessor  # one per request: it is dropped whole when the request ends
    child_ids: list[str]
    metrics: RequestMetrics
    queue: asyncio.Queue[BaseException | None] = field(default_factory=asyncio.Queue)
    prefilling: set[str] = field(default_factory=set)  # children without a first token (A3)
    done: bool = False
    max_tokens: int = 0
    # Child id -> the engine's (queue_time, ttft, e2e) so far, for request_metrics.
    timings: dict[str, tuple[float | None, float | None, float | None]] = field(default_factory=dict)
    lora_name: str | None = None  # its adapter, counted against an unload (LoRARegistry)
    session: SessionState | None = None  # a streaming-input session's own state (S15)
    routing: RoutingDecision | None = None  # why its engine (frontend.routing)


Listener = Callable[..., Any]


class RequestTable:
    """Requests in flight by request id and by child (engine request) id. ``abort(engine_index,
    child_ids)`` stops children in their engine (the engine client's job)."""

    def __init__(self, num_engines: int, abort: Callable[[int, list[str]], None]) -> None:
        self._abort = abort
        self._requests: dict[str, RequestState] = {}
        self._children: dict[str, RequestState] = {}  # engine request id -> its request
        self.in_flight: list[int] = [0] * num_engines  # sequences this frontend has on each engine
        self.on_added: list[Listener] = []
        self.on_first_token: list[Listener] = []
        self.on_segment_ended: list[Listener] = []
        self.on_child_finished: list[Listener] = []
        self.on_finished: list[Listener] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def states(self) -> list[RequestState]:
        return list(self._requests.values())

    def on_engine(self, engine_index: int) -> list[RequestState]:
        return [s for s in self._requests.values() if s.engine_index == engine_index]

    def live_children(self, state: RequestState) -> list[str]:
        """Its children the engine still runs (not ended by the engine or a stop string)."""
        return [c for c in state.child_ids if self._children.get(c) is state]

    def add(self, state: RequestState) -> None:
        for child_id in state.child_ids:
            self._children[child_id] = state
        self._requests[state.request_id] = state
        self.in_flight[state.engine_index] += state.n
        for listener in self.on_added:
            listener(state)

    # ------------------------------------------------------------ endings

    def drop(self, state: RequestState) -> None:
        """End a request early (consumer gone, abort): abort what still runs in the engine
        and give everything back."""
        if state.done:
            return
        self._abort(state.engine_index, self.live_children(state))
        self.finish(state)

    def abort(self, state: RequestState) -> None:
        """Its unfinished completions end with ``abort`` and its stream gets a final snapshot."""
        for o in state.parent.outputs:
            if o.finish_reason is None:
                o.finish_reason = "abort"
        self.drop(state)
        state.queue.put_nowait(None)

    def fail(self, state: RequestState, error: BaseException) -> None:
        self.finish(state, str(error))
        state.queue.put_nowait(error)

    def finish(self, state: RequestState, error: str | None = None) -> None:
        if state.done:
            return
        state.done = True
        if state.metrics.e2e is None:
            state.metrics.e2e = time.time() - state.metrics.arrival_time
        counted = error is None and not any(o.finish_reason == "ignored" for o in state.parent.outputs)
        for i, child_id in enumerate(state.child_ids):
            # Still live: it ended early (aborted, its consumer gone, a stop string).
            if self._children.get(child_id) is state and counted:
                for listener in self.on_child_finished:
                    listener(state, i, child_id, "abort")
        for listener in self.on_finished:
            listener(state, error, counted)
        self._requests.pop(state.request_id, None)
        for child_id in state.child_ids:
            self._children.pop(child_id, None)
        self.in_flight[state.engine_index] -= state.n

    # ------------------------------------------------------------ engine outputs

    def apply_outputs(self, engine_index: int, msg: protocol.Outputs) -> None:
        for timing in msg.timings:
            state = self._children.get(timing.request_id)
            if state is None:
                continue
            if timing.queue_time is not None:
                q = state.metrics.queue_time
                state.metrics.queue_time = timing.queue_time if q is None else min(q, timing.queue_time)
            state.timings[timing.request_id] = (timing.queue_time, timing.ttft, timing.e2e)
        by_request: dict[str, tuple[RequestState, list[EngineCoreOutput]]] = {}
        orphans = []
        for out in msg.outputs:
            state = self._children.get(out.request_id)
            if state is None:
                # Aborted or ended by a stop string: its last words are dropped. Still
                # running (e.g. sent by a crashed predecessor on this address): stop it.
                if out.finish_reason is None:
                    orphans.append(out.request_id)
                continue
            by_request.setdefault(state.request_id, (state, []))[1].append(out)
            if out.new_token_ids and out.request_id in state.prefilling:
                state.prefilling.discard(out.request_id)
                for listener in self.on_first_token:
                    listener(state)
                if state.metrics.ttft is None:
                    state.metrics.ttft = time.time() - state.metrics.arrival_time
        if orphans:
            self._abort(engine_index, orphans)
        for state, outs in by_request.values():
            self._apply(state, outs)

    def _apply(self, state: RequestState, outs: list[EngineCoreOutput]) -> None:
        changed, to_abort = state.processor.process(outs)
        if to_abort:  # ended by a stop string: the engine would go on generating
            self._abort(state.engine_index, to_abort)
        if state.session is not None and any(o.segment_ended for o in outs):
            completion = state.parent.outputs[0]
            state.session.segment_ends.append((len(completion.token_ids), len(completion.text)))
            for listener in self.on_segment_ended:
                listener(state)
        for i, child_id in enumerate(state.child_ids):
            if state.parent.outputs[i].finished and self._children.pop(child_id, None) is not None:
                for listener in self.on_child_finished:
                    listener(state, i, child_id, state.parent.outputs[i].finish_reason)
        ignored = next((o for o in state.parent.outputs if o.finish_reason == "ignored"), None)
        if ignored is not None:
            self.drop(state)  # aborts the other children, if any
            state.queue.put_nowait(ValueError(str(ignored.stop_reason or "the engine refused the request")))
            return
        if state.parent.finished:
            self.finish(state)
        if changed:
            state.queue.put_nowait(None)
