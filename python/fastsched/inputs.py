"""Prompts and the engine requests they fan out into (one per completion).

The prompt checks here (:func:`check_token_ids`, :func:`check_length`) have one
implementation, used by the request gate (``fastsched.request_gate``), through which
every request passes once, whichever way it enters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fastsched.engine.protocol import EngineCoreRequest
from fastsched.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenizedText:
    """A text prompt tokenized ahead of time (``AsyncLLM.prepare_prompt``, in a worker
    thread), so that admitting it does not tokenize on the event loop."""

    text: str
    token_ids: list[int]


PromptType = str | Sequence[int] | TokenizedText


class ContextLengthError(ValueError):
    """The prompt (or a session's input) plus ``max_tokens`` cannot fit in ``max_model_len``."""

    code = "context_length_exceeded"  # OpenAI's error code, sent to the gateway as structured metadata


def check_token_ids(token_ids: Sequence[int], vocab_size: int, where: str = "prompt") -> None:
    """Raise ``ValueError`` naming the problem unless ``token_ids`` is non-empty and in the vocabulary."""
    if not token_ids:
        raise ValueError(f"the {where} must contain at least one token")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where} token id {bad} is out of range for a vocabulary of {vocab_size}")


def check_length(num_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if max_tokens == 0 and num_tokens >= max_model_len:
        # A prefill-only request (S20) computes its last prompt token too, which needs room.
        raise ContextLengthError(
            f"the prompt ({num_tokens} tokens) of a request with max_tokens 0 must be shorter than "
            f"max_model_len ({max_model_len})"
        )
    if num_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"the prompt ({num_tokens} tokens) plus max_tokens ({max_tokens}) is longer than max_model_len "
            f"({max_model_len})"
        )


def check_prompt(token_ids: Sequence[int], max_tokens: int, max_model_len: int, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the problem if a prompt can never be served."""
    check_token_ids(token_ids, vocab_size)
    check_length(len(token_ids), max_tokens, max_model_len)


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
