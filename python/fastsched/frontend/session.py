"""Streaming-input sessions (docs/design.md S15) as a frontend sees them.

A session is one engine request opened with ``streaming=True``: its prompt is the first
chunk of input, and each later chunk (``Session.send``) adds a *segment*, the chunk and
up to ``max_tokens`` generated tokens. Between segments the engine keeps the session's
KV blocks and runner slot (it counts toward ``max_num_seqs``, and toward the active-seqs
gate of S6 while it waits, docs/scheduler.md Difference 8), so the next chunk is
prefilled on top of everything before it instead of from scratch: a realtime client
(speech, a game, an agent's tool results) sends input as it comes and pays only for
the new tokens.

``Session`` is what ``AsyncLLM.session()`` returns: ``send`` / ``close`` on one side,
``async for out in session`` on the other, yielding :class:`SessionOutput` deltas
that never straddle a segment boundary. A session left waiting for input longer than
the frontend's ``session_idle_timeout`` is aborted (its slot and KV freed); so is one
whose consumer goes away (``aclose``, leaving ``async with``, dropping it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastsched.frontend.admission import MAX_SESSIONS, AdmissionError
from fastsched.frontend.request_handle import RequestHandle
from fastsched.inputs import PromptType
from fastsched.outputs import RequestOutput

__all__ = [
    "Session",
    "SessionHost",
    "SessionLimitError",
    "SessionOutput",
    "SessionState",
    "SessionTimer",
    "session_cap",
]


# The default cap: this share of the engines' max_num_seqs, so that sessions, which hold their
# runner slot while they wait for input, never take every slot from ordinary requests.
DEFAULT_SESSION_SHARE = 4


class SessionLimitError(AdmissionError):
    """``--max-sessions`` sessions are open already: retry later (503 with Retry-After)."""

    reason = MAX_SESSIONS


def session_cap(max_sessions: int | None, max_num_seqs: int, num_frontends: int) -> int:
    """This frontend's share of ``max_sessions`` (default: ``max_num_seqs`` over all engines
    divided by ``DEFAULT_SESSION_SHARE``); at least 1 unless ``max_sessions`` is 0 (no sessions)."""
    total = max_num_seqs // DEFAULT_SESSION_SHARE if max_sessions is None else max_sessions
    if total < 0:
        raise ValueError(f"max_sessions must be at least 0, got {max_sessions}")
    return 0 if total == 0 else max(1, total // num_frontends)


@dataclass
class SessionState:
    """What a frontend keeps of a session beside its request's state."""

    # Tokens the session may hold once every chunk sent is served: prompt, chunks, and each
    # segment's max_tokens (an upper bound of what it generates).
    max_tokens_reached: int
    num_input_tokens: int  # the prompt and every chunk sent
    num_chunks: int = 1  # the opening prompt included
    closing: bool = False  # close() or a last chunk was sent: no more input
    # (output tokens, text length) at each segment end, in order.
    segment_ends: list[tuple[int, int]] = field(default_factory=list)
    idle_timer: asyncio.TimerHandle | None = None  # --session-idle-timeout, while it waits for input

    def count(self, num_tokens: int, max_tokens: int) -> None:
        """Counts in a chunk the request gate let through (``RequestGate.chunk``)."""
        self.max_tokens_reached += num_tokens + max_tokens
        self.num_input_tokens += num_tokens
        self.num_chunks += 1

    def waits_for_input(self) -> bool:
        """Whether every chunk sent has been served and no close is on its way."""
        return not self.closing and len(self.segment_ends) >= self.num_chunks

    def stop_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None


class SessionRequest(Protocol):
    """The part of a request's state (``frontend.request_table``) a session reads."""

    request_id: str
    engine_index: int
    parent: RequestOutput
    queue: asyncio.Queue[BaseException | None]
    done: bool
    session: SessionState | None


R_contra = TypeVar("R_contra", bound=SessionRequest, contravariant=True)


class SessionHost(Protocol[R_contra]):
    """What a session asks of its frontend (``AsyncLLM``), about the session's own request."""

    async def prepare_chunk(self, state: R_contra, prompt: PromptType) -> PromptType: ...
    def send_stream_input(self, state: R_contra, prompt: PromptType, max_tokens: int, last: bool) -> None: ...
    def close_session(self, state: R_contra) -> None: ...
    def drop(self, state: R_contra) -> None: ...


class SessionTimer:
    """``--session-idle-timeout``: a session that has served every chunk sent and waits for
    more input is aborted after ``idle_timeout`` seconds (``expire(state)``), which frees its
    slot and KV. Subscribed to the request table's ``segment_ended`` and ``finished`` events."""

    def __init__(self, idle_timeout: float | None, expire: Callable[[SessionRequest], None]) -> None:
        self.idle_timeout = idle_timeout
        self._expire = expire

    def segment_ended(self, state: SessionRequest) -> None:
        session = state.session
        assert session is not None
        if self.idle_timeout is not None and session.waits_for_input():
            session.idle_timer = asyncio.get_running_loop().call_later(self.idle_timeout, self._fire, state)

    def finished(self, state: SessionRequest, error: str | None, counted: bool) -> None:
        if state.session is not None:
            state.session.stop_idle_timer()

    def _fire(self, state: SessionRequest) -> None:
        if not state.done:
            self._expire(state)


@dataclass(frozen=True)
class SessionOutput:
    """What a session produced since the previous output, within one segment."""

    request_id: str
    segment: int  # the chunk this generation answers: 0 = the opening prompt
    token_ids: list[int]
    text: str
    segment_ended: bool  # the segment's generation is complete; the session waits for input
    finish_reason: str | None  # the session ended: stop, length or abort

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Session(RequestHandle[SessionRequest]):
    """An open streaming-input session (see the module docstring)."""

    _owner: SessionHost[Any]

    def __init__(self, host: SessionHost[Any], state: SessionRequest) -> None:
        super().__init__(host, state)
        self._segment = 0
        self._sent_tokens = 0  # output tokens already yielded
        self._sent_text = 0

    async def send(self, prompt: PromptType, max_tokens: int, *, last: bool = False) -> None:
        """The next chunk: text or token ids, then up to ``max_tokens`` generated tokens. Queued
        by the engine if the previous segment is still generating. ``last`` ends the session
        after this segment. ``ValueError`` (naming the value) for an empty chunk, ``max_tokens < 1``,
        input that would reach ``max_model_len``, or a session that has ended or was closed."""
        prompt = await self._owner.prepare_chunk(self._state, prompt)
        self._owner.send_stream_input(self._state, prompt, max_tokens, last)

    @property
    def num_input_tokens(self) -> int:
        """The prompt and every chunk sent, in tokens."""
        assert self._state.session is not None
        return self._state.session.num_input_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self._state.parent.outputs[0].token_ids)

    def fail(self, error: BaseException) -> None:
        """Aborts the session in the engine; iterating raises ``error``."""
        if not self._state.done:
            self._owner.drop(self._state)
            self._state.queue.put_nowait(error)

    async def close(self) -> None:
        """Ends the session once the chunks already sent are served; iteration then ends
        with ``finish_reason`` set."""
        self._owner.close_session(self._state)

    def __aiter__(self) -> Session:
        return self

    async def __anext__(self) -> SessionOutput:
        state = self._state
        while True:
            if self._closed:
                raise StopAsyncIteration
            out = self._next_output()
            if out is not None:
                if out.finished:
                    self._closed = True
                return out
            try:
                item = await state.queue.get()
            except BaseException:  # cancelled: the consumer is gone, so is the session
                self._close()
                raise
            if item is not None:
                self._closed = True
                raise item

    def _next_output(self) -> SessionOutput | None:
        """The delta up to the next unseen segment end, else up to now; None when nothing is new."""
        state = self._state
        completion = state.parent.outputs[0]
        assert state.session is not None
        segment_ends = state.session.segment_ends
        ended = self._segment < len(segment_ends)
        tokens, text = (
            segment_ends[self._segment] if ended else (len(completion.token_ids), len(completion.text))
        )
        finish = None if ended else completion.finish_reason
        if not ended and finish is None and tokens == self._sent_tokens:
            return None
        out = SessionOutput(
            state.request_id,
            self._segment,
            completion.token_ids[self._sent_tokens : tokens],
            completion.text[self._sent_text : text],
            ended,
            finish,
        )
        self._sent_tokens, self._sent_text = tokens, text
        if ended:
            self._segment += 1
        return out
