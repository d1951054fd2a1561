"""What ``fastsched.LLM`` and ``AsyncLLM`` return, shaped like vLLM's outputs so user code
carries over. Plain dataclasses: importing them loads no torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int | None = None
    embedding: list[float] | None = None  # a pooling request's (embeddings): its prompt's last hidden state
    # prompt_logprobs (vLLM's): per prompt token, None for the first; set with the first output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class RequestMetrics:
    """Latencies of one request, in seconds since ``arrival_time`` (``time.time()``).

    ``queue_time`` is measured by the engine (first scheduled − arrival; the smallest over
    the ``n`` sequences), None if no sequence was reported scheduled. ``ttft`` and ``e2e``
    are measured here, when the first token and the end reached this frontend.
    """

    arrival_time: float
    queue_time: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
