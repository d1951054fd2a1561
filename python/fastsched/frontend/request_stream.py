"""What ``AsyncLLM.generate`` returns: a :class:`RequestStream` of :class:`StreamOutput`.

Iterating yields a cumulative ``RequestOutput`` snapshot (never mutated afterwards) plus
``deltas``: per completion, what is new since the previous snapshot. A slow consumer gets
fewer, larger deltas (steps are coalesced), never a backlog. The last snapshot has
``finished`` set and carries ``metrics``. Stopping early (``break``, ``aclose()``,
cancelling the task, dropping the stream) aborts the request in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fastsched.frontend.request_handle import RequestHandle, RequestOwner
from fastsched.frontend.request_table import RequestState
from fastsched.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

__all__ = ["CompletionDelta", "RequestStream", "StreamOutput"]


@dataclass
class CompletionDelta:
    """What one completion gained since the previous snapshot of its stream."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class StreamOutput(RequestOutput):
    """A cumulative snapshot of a request plus the per-completion ``deltas`` since the
    previous one (only completions that changed); ``metrics`` on the final one."""

    deltas: list[CompletionDelta] = field(default_factory=list)
    metrics: RequestMetrics | None = None


class RequestStream(RequestHandle[RequestState]):
    """An admitted request's outputs: ``async for out in stream`` (see the module docstring).

    Usable as ``async with stream:`` too; leaving the block early aborts the request.
    """

    def __init__(self, owner: RequestOwner[Any], state: RequestState) -> None:
        super().__init__(owner, state)
        # What the previous snapshot contained, per completion: text, tokens, logprobs, finished.
        self._sent: list[tuple[int, int, int, bool]] = [(0, 0, 0, False)] * state.n

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        if self._closed:
            raise StopAsyncIteration
        state = self._state
        try:
            items = [await state.queue.get()]
        except BaseException:  # cancelled: the consumer is gone, so is the request
            self._close()
            raise
        while not state.queue.empty():
            items.append(state.queue.get_nowait())
        for item in items:
            if item is not None:
                self._closed = True
                raise item
        out = self._snapshot()
        if out.finished:
            self._closed = True
        return out

    def _snapshot(self) -> StreamOutput:
        state = self._state
        parent, deltas, outputs = state.parent, [], []
        for i, o in enumerate(parent.outputs):
            text0, tokens0, logprobs0, finished0 = self._sent[i]
            logprobs = o.logprobs
            if len(o.text) != text0 or len(o.token_ids) != tokens0 or o.finished != finished0:
                deltas.append(
                    CompletionDelta(
                        o.index,
                        o.text[text0:],
                        o.token_ids[tokens0:],
                        None if logprobs is None else logprobs[logprobs0:],
                        o.finish_reason,
                        o.stop_reason,
                    )
                )
            self._sent[i] = (len(o.text), len(o.token_ids), len(logprobs or ()), o.finished)
            outputs.append(
                CompletionOutput(
                    o.index,
                    o.text,
                    list(o.token_ids),
                    o.finish_reason,
                    o.stop_reason,
                    None if logprobs is None else list(logprobs),
                )
            )
        metrics = None
        if parent.finished:
            state.metrics.num_generation_tokens = sum(len(o.token_ids) for o in parent.outputs)
            metrics = replace(state.metrics)
        return StreamOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            parent.num_cached_tokens,
            parent.embedding,
            parent.prompt_logprobs,
            deltas=deltas,
            metrics=metrics,
        )
