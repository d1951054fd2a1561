"""The request gate (issue 21): every request, whichever way it enters, passes here once.

HTTP (through a frontend's gRPC ``Generate``), gRPC ``Generate``, a ``GenerateSession``'s
opening and each of its chunks, and the offline ``fastsched.LLM`` all turn what a client
sent into a :class:`ValidRequest` (or a :class:`ValidChunk`) here: the request id, the
sampling parameters' sizes, the prompt's characters (before tokenizing), its token ids
(each in the vocabulary) and its length against ``max_model_len`` are each checked once,
each limit of ``fastsched.limits`` applied once, the prompt tokenized once. What comes out
is trusted by everything after it: the frontend's request table, admission and the
engine do not judge it again (the engine's own asserts are invariants, not checks).

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

from fastsched.inputs import PromptType, TokenizedText
from fastsched.limits import INLINE_TOKENIZE_CHARS, LimitError, RequestLimits, check_prompt_chars
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

    def __init__(self, tokenizer: Encoder, max_model_len: int, vocab_size: int,
                 limits: RequestLimits | None = None) -> None:
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
            check_prompt_chars(len(text), self.max_model_len if room is None else room, self.max_token_chars, where)

    def check_token_ids(self, token_ids: Sequence[int], where: str = "prompt") -> None:
        """Non-empty, and every id in the vocabulary."""
        if not token_ids:
            raise ValueError(f"the {where} must contain at least one token")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where} token id {bad} is out of range for a vocabulary of {self.vocab_size}")

    def check_length(self, num_tokens: int, max_tokens: int) -> None:
        if num_tokens + max_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({num_tokens} tokens) plus max_tokens ({max_tokens}) is longer than "
                             f"max_model_len ({self.max_model_len})")

    # ------------------------------------------------------------ whole requests

    def request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                lora_request: LoRARequest | None = None, streaming: bool = False) -> ValidRequest:
        """The request, checked, a text prompt tokenized here (see :meth:`prepare` for an
        event loop's way); ``ValueError`` naming the field if it can never run."""
        self.limits.check_request_id(request_id)
        self.check_params(params)
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
        return ValidRequest(request_id, text, token_ids, params, priority, lora_request, streaming)

    def chunk(self, prompt: PromptType, max_tokens: int, last: bool, *, room: int, num_chunks: int) -> ValidChunk:
        """A session's next chunk; ``room``: the tokens the session may still grow by
        (``max_model_len`` less what it may already hold), ``num_chunks``: the chunks it
        has had, its opening included. A text continues the session: no BOS is added."""
        self.limits.check_session_chunks(num_chunks + 1)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if isinstance(prompt, TokenizedText):
            token_ids = prompt.token_ids
        elif isinstance(prompt, str):
            self.check_text(prompt, max(room, 0), "chunk")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = [int(t) for t in prompt[: max(room, 0) + 1]]  # one more than fits is enough to refuse
        self.check_token_ids(token_ids, "chunk")
        if len(token_ids) + max_tokens >= room:
            raise ValueError(f"this chunk ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) would reach "
                             f"max_model_len ({self.max_model_len}): the session has room for {max(room - 1, 0)} "
                             "more tokens")
        return ValidChunk(token_ids, max_tokens, last)

    # ------------------------------------------------------------ off the event loop

    async def prepare(self, prompt: PromptType, *, room: int | None = None,
                      add_special_tokens: bool = True) -> PromptType:
        """``prompt`` ready for :meth:`request` or :meth:`chunk` without work on the event
        loop: a long text is bounded (O(1)), then tokenized in the gate's worker thread
        under ``--prepare-timeout``; anything else is returned as it is."""
        if not isinstance(prompt, str) or len(prompt) <= INLINE_TOKENIZE_CHARS:
            return prompt
        self.check_text(prompt, room, "prompt" if add_special_tokens else "chunk")
        token_ids = await self.off_loop("tokenizing the prompt", self.tokenizer.encode, prompt,
                                        add_special_tokens=add_special_tokens)
        return TokenizedText(prompt, token_ids)

    async def off_loop(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the gate's worker threads, given ``--prepare-timeout``
        seconds: past that the request is refused (``LimitError``) and the thread's result,
        when it comes, dropped. Used for whatever grows with what a client sent (tokenizing,
        compiling a grammar)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fastsched-gate")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        try:
            return await asyncio.wait_for(future, self.limits.prepare_timeout)
        except TimeoutError:
            raise LimitError(f"{what} took longer than this server's limit of {self.limits.prepare_timeout:g} s "
                             "(--prepare-timeout)", None) from None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
