"""What ``fastsched.LLM`` returns, shaped like vLLM's outputs so user code carries over."""

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

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
