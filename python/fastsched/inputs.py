"""From a user's prompt to engine requests, the same way everywhere: tokenized, checked
against the model's limits, and fanned out into one engine request per completion.

``fastsched.LLM`` (offline) and ``AsyncLLM`` (a server's frontend) both use
:class:`InputProcessor`; the engine calls :func:`check_prompt` again on what reaches it,
so a request is refused with the same message wherever it enters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from fastsched.engine.protocol import EngineCoreRequest
from fastsched.limits import check_prompt_chars
from fastsched.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenizedText:
    """A text prompt tokenized ahead of time (``AsyncLLM.prepare_prompt``, in a worker
    thread), so that admitting it does not tokenize on the event loop."""

    text: str
    token_ids: list[int]


PromptType = str | Sequence[int] | TokenizedText


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ContextLengthError(ValueError):
    """The prompt (or a session's input) plus ``max_tokens`` cannot fit in ``max_model_len``."""

    code = "context_length_exceeded"  # OpenAI's error code, sent to the gateway as structured metadata


def check_prompt(token_ids: Sequence[int], max_tokens: int, max_model_len: int, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the problem if a prompt can never be served."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("the prompt must contain at least one token")
    if n + max_tokens > max_model_len:
        raise ContextLengthError(
            f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is longer than max_model_len ({max_model_len})"
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}")


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's ``n`` completions (the id itself when n is 1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of completion ``index``: each completion is its own engine
    request, and seeded ones get distinct seeds (``seed + index``) so they do not all draw
    the same tokens."""
    if params.n == 1:
        return params
    return replace(params, n=1, seed=None if params.seed is None else params.seed + index)


class InputProcessor:
    """Tokenizes and checks prompts for one model; builds the engine requests of one."""

    def __init__(self, tokenizer: _Encoder, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The most characters a token stands for (fastsched.limits); None: unknown, no bound.
        self.max_token_chars: int | None = getattr(tokenizer, "max_token_chars", None)

    def check_text_length(self, text: str) -> None:
        """``LimitError`` when ``text`` has too many characters to fit in max_model_len
        tokens: refused in O(1), before a tokenizer spends seconds and gigabytes on it."""
        if self.max_token_chars is not None:
            check_prompt_chars(len(text), self.max_model_len, self.max_token_chars)

    def tokenize(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids), checked: ``ValueError`` if it can never run."""
        if isinstance(prompt, TokenizedText):
            text, token_ids = prompt.text, prompt.token_ids
        elif isinstance(prompt, str):
            self.check_text_length(prompt)
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            check_prompt(prompt, params.max_tokens, self.max_model_len, self.vocab_size)  # before copying it
            text, token_ids = None, [int(t) for t in prompt]
        check_prompt(token_ids, params.max_tokens, self.max_model_len, self.vocab_size)
        return text, token_ids

    @staticmethod
    def engine_requests(
        child_ids: Sequence[str],
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """One engine request per completion, under ``child_ids`` (see child_request_ids)."""
        arrival = time.time() if arrival_time is None else arrival_time
        return [
            EngineCoreRequest(child_id, token_ids, child_params(params, i), arrival, priority)
            for i, child_id in enumerate(child_ids)
        ]
