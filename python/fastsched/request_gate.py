"""The request gate (issue 21): every request, whichever way it enters, passes here once.

HTTP (through a frontend's gRPC ``Generate``), gRPC ``Generate``, a ``GenerateSession``'s
opening and each of its chunks, and the offline ``fastsched.LLM`` all turn what a client
sent into a :class:`ValidRequest` (or a :class:`ValidChunk`) here: the request id, the
sampling parameters' sizes, the prompt's characters (before tokenizing), its token ids
(each in the vocabulary) and its length against ``max_model_len`` are each checked once,
each limit of ``fastsched.limits`` applied once, the prompt tokenized once. What comes out
is trusted by everything after it: the frontend's request table checks only that its id is
not in use, and admission only whether there is room. (``EngineCore.add_request`` still runs
``inputs.check_prompt`` on what reaches it, the same implementation; the scheduler's own
checks are invariants.)

Nothing a client controls runs unbounded on an event loop. Sizes are bounded before any
work proportional to them; tokenizing a long text and compiling an output constraint run
in a worker thread (:meth:`RequestGate.prepare`), under ``--prepare-timeout``, so one
large request never stalls the loop that serves every other request and answers the
launcher's liveness checks.

Errors are ``ValueError`` naming the field (``LimitError`` for a request over a limit):
a client error that can never succeed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastsched.inputs import ContextLengthError, PromptType, TokenizedText, check_length, check_token_ids
from fastsched.limits import (
    INLINE_TOKENIZE_CHARS,
    LimitError,
    RequestLimits,
    check_cache_salt,
    check_prompt_chars,
)
from fastsched.lora.request import LoRARequest
from fastsched.sampling_params import SamplingParams

T = TypeVar("T")


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ValidRequest:
    """A request the gate let through: every field checked, the prompt tokenized."""

    request_id: str
    prompt: str | None  # the text, when it was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None
    streaming: bool = False  # the opening of a streaming-input session (S15)
    cache_salt: str | None = None  # vLLM's: requests with different salts never share prefix-cache blocks
    pooling: bool = False  # answers its prompt's embedding (gateway /v1/embeddings): prefill-only (S20)


@dataclass(frozen=True)
class ValidChunk:
    """A session's next chunk, checked: its token ids and the generation it asks for."""

    token_ids: list[int]
    max_tokens: int
    last: bool


class RequestGate:
    """The checks of one model's requests (see the module docstring). ``max_token_chars``:
    the most characters one token stands for (the tokenizer's, when it knows), which
    bounds a text before it is tokenized (``fastsched.limits``)."""

    def __init__(
        self, tokenizer: Encoder, max_model_len: int, vocab_size: int, limits: RequestLimits | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = limits or RequestLimits()
        self.max_token_chars: int | None = getattr(tokenizer, "max_token_chars", None)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ one check per field

    def check_params(self, params: SamplingParams) -> None:
        """The sizes a request's parameters carry (``n``, stop strings, stop token ids)."""
        self.limits.check_n(params.n)
        self.limits.check_stop(params.stop or ())
        self.limits.check_stop_token_ids(len(params.stop_token_ids or ()))

    def check_text(self, text: str, room: int | None = None, where: str = "prompt") -> None:
        """``LimitError`` when ``text`` has too many characters to fit in ``room`` tokens
        (default ``max_model_len``): refused in O(1), before a tokenizer spends seconds on it."""
        if self.max_token_chars is not None:
            check_prompt_chars(
                len(text), self.max_model_len if room is None else room, self.max_token_chars, where
            )

    def check_token_ids(self, token_ids: Sequence[int], where: str = "prompt") -> None:
        check_token_ids(token_ids, self.vocab_size, where)

    def check_length(self, num_tokens: int, max_tokens: int) -> None:
        check_length(num_tokens, max_tokens, self.max_model_len)

    # ------------------------------------------------------------ whole requests

    def request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        streaming: bool = False,
        cache_salt: str | None = None,
    ) -> ValidRequest:
        """The request, checked, a text prompt tokenized here (:meth:`request_async` is an
        event loop's way); ``ValueError`` naming the field if it can never run."""
        self.limits.check_request_id(request_id)
        return self._request(request_id, prompt, params, priority, lora_request, streaming, cache_salt)

    async def request_async(
        self,
        request_id: str,
        prompt: PromptType,
        params: Callable[[], SamplingParams],
        constraint: tuple[str, str | Sequence[str]] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        streaming: bool = False,
        cache_salt: str | None = None,
        pooling: bool = False,
    ) -> ValidRequest:
        """:meth:`request` for an event loop: ``params`` builds the sampling parameters (which
        compiles an output constraint, ``constraint``: its kind and text or choice list, bounded
        first) and a long prompt is tokenized, both in the worker threads (:meth:`off_loop`)."""
        self.limits.check_request_id(request_id)
        if constraint is not None:
            self.limits.check_structured_outputs(*constraint)
            built = await self.off_loop("compiling structured_outputs", params)
        else:
            built = params()
        prompt = await self.prepare(prompt)
        return self._request(
            request_id, prompt, built, priority, lora_request, streaming, cache_salt, pooling
        )

    def _request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None,
        streaming: bool,
        cache_salt: str | None,
        pooling: bool = False,
    ) -> ValidRequest:
        check_cache_salt(cache_salt)
        self.check_params(params)
        if pooling:
            check_pooling(params, streaming)
        if streaming:
            if params.n != 1:
                raise ValueError(f"a session generates one completion: n must be 1, got {params.n}")
            if params.stop:
                raise ValueError("stop strings are not supported in a session: stop must be empty")
        if isinstance(prompt, TokenizedText):
            text, token_ids = prompt.text, prompt.token_ids
        elif isinstance(prompt, str):
            self.check_text(prompt)
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            self.check_length(len(prompt), params.max_tokens)  # before scanning or copying it
            text, token_ids = None, [int(t) for t in prompt]
        self.check_token_ids(token_ids)
        self.check_length(len(token_ids), params.max_tokens)
        return ValidRequest(
            request_id, text, token_ids, params, priority, lora_request, streaming, cache_salt, pooling
        )

    def chunk(
        self, request_id: str, prompt: PromptType, max_tokens: int, last: bool, *, held: int, num_chunks: int
    ) -> ValidChunk:
        """Session ``request_id``'s next chunk. ``held``: the tokens the session may hold once
        what it was sent is served (its input and each segment's max_tokens); ``num_chunks``:
        the chunks it has had, its opening included. A text continues the session: no BOS."""
        self.limits.check_session_chunks(num_chunks + 1)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        room = self.max_model_len - held
        if isinstance(prompt, TokenizedText):
            token_ids = prompt.token_ids
        elif isinstance(prompt, str):
            self.check_text(prompt, max(room, 1), "chunk")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = [int(t) for t in prompt[: max(room, 0) + 1]]  # one more than fits is enough to refuse
        self.check_token_ids(token_ids, "chunk")
        total = held + len(token_ids) + max_tokens
        if total >= self.max_model_len:
            raise ContextLengthError(
                f"session {request_id!r}: this chunk ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) could "
                f"grow the session to {total} tokens, which reaches max_model_len ({self.max_model_len})"
            )
        return ValidChunk(token_ids, max_tokens, last)

    # ------------------------------------------------------------ off the event loop

    async def prepare(self, prompt: PromptType, *, held: int | None = None) -> PromptType:
        """``prompt`` ready for :meth:`request` (or, given the session's ``held`` tokens, for
        :meth:`chunk`) without work on the event loop: a long text is bounded (O(1)), then
        tokenized in the gate's worker threads under ``--prepare-timeout``; anything else is
        returned as it is."""
        if not isinstance(prompt, str) or len(prompt) <= INLINE_TOKENIZE_CHARS:
            return prompt
        if held is None:
            self.check_text(prompt)
            token_ids = await self.off_loop("tokenizing the prompt", self.tokenizer.encode, prompt)
        else:
            self.check_text(prompt, max(self.max_model_len - held, 1), "chunk")
            token_ids = await self.off_loop(
                "tokenizing the chunk", self.tokenizer.encode, prompt, add_special_tokens=False
            )
        return TokenizedText(prompt, token_ids)

    async def off_loop(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the gate's worker threads, given ``--prepare-timeout``
        seconds: past that the request is refused (``LimitError``) and the thread's result,
        when it comes, dropped. Used for whatever grows with what a client sent (tokenizing,
        compiling a grammar)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fastsched-gate")
        return await run_bounded(self._pool, self.limits.prepare_timeout, what, lambda: fn(*args, **kwargs))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def check_pooling(params: SamplingParams, streaming: bool) -> None:
    """A pooling request (an embedding) is prefill-only (S20): it computes its prompt and ends,
    one completion of no token; nothing that shapes or reports generated or prompt tokens."""
    if params.max_tokens != 0 or params.n != 1:
        raise ValueError(
            f"an embedding request asks for one completion of max_tokens 0, got n={params.n}, "
            f"max_tokens={params.max_tokens}"
        )
    if streaming or params.structured_outputs is not None or params.logprobs is not None:
        raise ValueError("an embedding request cannot be a session nor have structured_outputs or logprobs")
    if params.prompt_logprobs is not None:
        raise ValueError(f"an embedding request cannot have prompt_logprobs, got {params.prompt_logprobs}")


async def run_bounded(
    pool: concurrent.futures.Executor, timeout: float, what: str, fn: Callable[..., T], *args: Any
) -> T:
    """``fn(*args)`` in ``pool``, awaited for at most ``timeout`` seconds (``--prepare-timeout``):
    past that a ``LimitError`` naming ``what``, and the thread's result, when it comes, dropped.
    The gate's and the gateway's way to do work that grows with what a client sent."""
    future = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.wait_for(future, timeout)
    except TimeoutError:
        raise LimitError(
            f"{what} took longer than this server's limit of {timeout:g} s (--prepare-timeout)", None
        ) from None
