"""AsyncLLM: a frontend's client of D engine processes (docs/design.md §1, §6).

It does the frontend's share of a request — tokenize, validate, admit (A1–A5, A6 via
the shared counters), route, fan out ``n``, detokenize and cut at stop strings — and
talks to the engines over ZMQ with msgpack (``protocol``). One output-reader task
receives every engine's messages and dispatches them to per-request streams; a
monitor task marks an engine dead when it goes silent or its process exits, so no
request ever waits on a dead engine. A dead engine stays dead until a new process at its
address says READY (the launcher restarts engines under ``--enable-fault-tolerance``). ``request_status()`` says where a request is: it asks
the engine (a QUERY whose STATUS the reader hands back) or remembers (``frontend.request_status``).

Streaming contract: ``generate()`` admits the request *when called* (so an
:class:`AdmissionError` or ``ValueError`` surfaces before a response is started) and
returns a :class:`RequestStream`. Iterating it yields :class:`StreamOutput` — a
cumulative ``RequestOutput`` snapshot (never mutated afterwards) plus ``deltas``: per
completion, what is new since the previous snapshot. A slow consumer gets fewer,
larger deltas (steps are coalesced), never a backlog. The last snapshot has
``finished`` set and carries ``metrics``. Stopping early (``break``, ``aclose()``,
cancelling the task, dropping the stream) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import zmq
import zmq.asyncio

from fastsched.engine import protocol
from fastsched.engine.protocol import EngineCoreOutput, EngineRequestStatus, EngineStats, ModelInfo
from fastsched.frontend.admission import (
    TTFT_SLO_FLOOR_STEPS,
    AdmissionController,
    AdmissionError,
    EngineFaultedError,
    MaxQueuedTokensError,
    QueueOverflowError,
    SharedInFlightCounter,
    TtftSloError,
)
from fastsched.frontend.lora_registry import LoRARegistry
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.frontend.request_handle import RequestHandle
from fastsched.frontend.request_log import RequestLogger
from fastsched.frontend.request_metrics import EngineRequestMetrics
from fastsched.frontend.request_status import RequestHistory, ended_status, in_flight_status, rejected_status
from fastsched.frontend.session import Session, SessionState, chunk_token_ids
from fastsched.inputs import InputProcessor, PromptType, TokenizedText, child_params, child_request_ids
from fastsched.limits import INLINE_TOKENIZE_CHARS, RequestLimits, check_cache_salt
from fastsched.lora.request import LoRARequest
from fastsched.model_loader import Tokenizer, load_tokenizer
from fastsched.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from fastsched.sampling_params import SamplingParams

__all__ = [
    "AdmissionError",
    "AsyncLLM",
    "CompletionDelta",
    "EngineDeadError",
    "EngineFaultedError",
    "MaxQueuedTokensError",
    "QueueOverflowError",
    "RequestMetrics",
    "RequestStream",
    "StreamOutput",
    "TtftSloError",
]

logger = logging.getLogger("fastsched.frontend")

HELLO_INTERVAL = 1.0  # seconds between HELLOs to an engine that has not answered READY


class EngineDeadError(RuntimeError):
    """The engine serving a request died (or this AsyncLLM shut down): the request
    cannot finish. Without fault tolerance also what new requests get (fail fast)."""


class _ProcessHandle(Protocol):
    def is_alive(self) -> bool: ...


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


# ------------------------------------------------------------------ per-request state


@dataclass
class _RequestState:
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
    # What the previous snapshot contained, per completion: text, tokens, logprobs, finished.
    sent: list[tuple[int, int, int, bool]] = field(default_factory=list)
    lora_name: str | None = None  # its adapter, counted against an unload (LoRARegistry)
    session: SessionState | None = None  # a streaming-input session's own state (S15)

    def snapshot(self) -> StreamOutput:
        parent, deltas, outputs = self.parent, [], []
        for i, o in enumerate(parent.outputs):
            text0, tokens0, logprobs0, finished0 = self.sent[i]
            logprobs = o.logprobs
            if len(o.text) != text0 or len(o.token_ids) != tokens0 or o.finished != finished0:
                deltas.append(CompletionDelta(
                    o.index, o.text[text0:], o.token_ids[tokens0:],
                    None if logprobs is None else logprobs[logprobs0:], o.finish_reason, o.stop_reason,
                ))
            self.sent[i] = (len(o.text), len(o.token_ids), len(logprobs or ()), o.finished)
            outputs.append(CompletionOutput(
                o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
                None if logprobs is None else list(logprobs),
            ))
        metrics = None
        if parent.finished:
            self.metrics.num_generation_tokens = sum(len(o.token_ids) for o in parent.outputs)
            metrics = replace(self.metrics)
        return StreamOutput(
            parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, parent.num_cached_tokens,
            deltas=deltas, metrics=metrics,
        )


class RequestStream(RequestHandle[_RequestState]):
    """An admitted request's outputs: ``async for out in stream`` (see the module docstring).

    Usable as ``async with stream:`` too; leaving the block early aborts the request.
    """

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
        out = state.snapshot()
        if out.finished:
            self._closed = True
        return out


# ------------------------------------------------------------------ AsyncLLM


@dataclass
class _Engine:
    index: int
    push: zmq.Socket
    process: _ProcessHandle | None
    info: ModelInfo | None = None
    stats: EngineStats = field(default_factory=EngineStats)
    healthy: bool = True
    dead_reason: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    num_in_flight: int = 0  # sequences this frontend has on it (routing)
    process_stats: dict[str, float] | None = None  # its process's resource use, from the latest heartbeat
    requests: EngineRequestMetrics | None = None  # this frontend's requests to it, once it is ready


class AsyncLLM:
    """The frontend's engine client. Create with ``await AsyncLLM.start(...)``; one per
    frontend process, used from one event loop."""

    def __init__(
        self,
        engine_input_addrs: Sequence[str],
        output_addr: str,
        *,
        frontend_index: int,
        admission: AdmissionController,
        engine_procs: Sequence[_ProcessHandle | None] | None,
        engine_timeout: float,
        limits: RequestLimits | None = None,
        session_idle_timeout: float | None = None,
    ) -> None:
        if not engine_input_addrs:
            raise ValueError("at least one engine input address is needed")
        if engine_procs is not None and len(engine_procs) != len(engine_input_addrs):
            raise ValueError(
                f"got {len(engine_procs)} engine process handles for {len(engine_input_addrs)} engines"
            )
        if engine_timeout <= 0:
            raise ValueError(f"engine_timeout must be positive, got {engine_timeout}")
        if session_idle_timeout is not None and not session_idle_timeout > 0:
            raise ValueError(f"session_idle_timeout must be a positive number of seconds, got {session_idle_timeout}")
        self.session_idle_timeout = session_idle_timeout
        self.frontend_index = frontend_index
        self.output_addr = output_addr
        self.admission = admission
        self.engine_timeout = engine_timeout
        self.request_logger: RequestLogger | None = None  # --enable-log-requests
        self.limits = limits or RequestLimits()
        self.tokenizer: Tokenizer | None = None
        # Long prompts are tokenized here, one at a time, never on the event loop (prepare_prompt).
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastsched-tokenize")
        self._inputs: InputProcessor | None = None  # once the engines have said which model
        self._ctx = zmq.asyncio.Context()
        self._send_ctx = zmq.Context()  # plain sockets: a send never awaits (abort from __del__ / finally)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        try:
            self._pull.bind(output_addr)
        except zmq.ZMQError as e:
            self._pull.close()
            self._ctx.term()
            self._send_ctx.term()
            raise OSError(f"frontend {frontend_index} cannot bind its output address {output_addr}: {e}") from e
        self._engines: list[_Engine] = []
        for i, addr in enumerate(engine_input_addrs):
            push = self._send_ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(addr)
            self._engines.append(_Engine(i, push, None if engine_procs is None else engine_procs[i]))
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, _RequestState] = {}  # engine request id -> its request
        # Engine request ids must be unique in the engine across frontends and restarts.
        self._id_prefix = f"{frontend_index}.{secrets.token_hex(3)}."
        self._ids = itertools.count()
        self._history = RequestHistory()  # rejected and ended requests, for request_status()
        self._queries: dict[int, asyncio.Future[list[EngineRequestStatus]]] = {}  # query id -> the engine's answer
        # A random start: an answer queued for a predecessor on this address must not answer ours.
        self._query_ids = itertools.count(secrets.randbelow(2**62))
        # PAUSE / RELOAD_WEIGHTS query id -> the engine's answer (PAUSED / RELOADED).
        self._commands: dict[int, asyncio.Future[protocol.Message]] = {}
        self._ready = asyncio.Event()
        self._started = False
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self.loras: LoRARegistry | None = None  # adapters by name, when the engines serve LoRA

    @classmethod
    async def start(
        cls,
        engine_input_addrs: Sequence[str],
        output_addr: str,
        *,
        frontend_index: int = 0,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        fault_tolerance: bool = False,
        shared_stats: SharedInFlightCounter | None = None,
        ttft_slo: float | None = None,
        num_frontends: int = 1,
        engine_procs: Sequence[_ProcessHandle | None] | None = None,
        engine_timeout: float = 5.0,
        ready_timeout: float = 300.0,
        tokenizer: Tokenizer | None = None,
        limits: RequestLimits | None = None,
        request_logger: RequestLogger | None = None,
        session_idle_timeout: float | None = None,
    ) -> AsyncLLM:
        """Bind ``output_addr`` (this frontend's PULL), connect to every engine's input,
        and wait until each has answered READY (``TimeoutError`` after ``ready_timeout``
        seconds; ``RuntimeError`` at once if an engine reports failure or its process,
        when given, exits). The tokenizer comes from the model the engines report unless
        given. ``shared_stats``: this frontend's opened ``SharedAdmissionStats`` slot (A6).
        ``ttft_slo``: seconds; turns on the TTFT-SLO valve (see ``frontend.admission``), whose
        limit this frontend takes a ``1 / num_frontends`` share of. ``limits``: the bounds on
        what a request controls (``fastsched.limits``; default: ``RequestLimits()``).
        ``session_idle_timeout``: seconds a streaming session may wait for input before it is
        aborted (``session()``; default: no limit)."""
        admission = AdmissionController(max_num_queued_reqs, max_num_queued_tokens, fault_tolerance, shared_stats,
                                        ttft_slo=ttft_slo, num_frontends=num_frontends)
        llm = cls(
            engine_input_addrs, output_addr, frontend_index=frontend_index, admission=admission,
            engine_procs=engine_procs, engine_timeout=engine_timeout, limits=limits,
            session_idle_timeout=session_idle_timeout,
        )
        llm.request_logger = request_logger
        try:
            await llm._start(ready_timeout, tokenizer)
        except BaseException:
            await llm.shutdown()
            raise
        return llm

    async def _start(self, ready_timeout: float, tokenizer: Tokenizer | None) -> None:
        self._tasks.append(asyncio.create_task(self._read_outputs(), name="fastsched-output-reader"))
        deadline = time.monotonic() + ready_timeout
        hello = protocol.encode(protocol.Hello(self.frontend_index))
        while not all(e.info is not None for e in self._engines):
            for e in self._engines:
                if not e.healthy:
                    raise RuntimeError(f"engine {e.index} failed before it was ready: {e.dead_reason}")
                if e.process is not None and not e.process.is_alive():
                    code = getattr(e.process, "exitcode", None)
                    raise RuntimeError(f"engine {e.index} exited (exit code {code}) before it was ready; see its log")
                if e.info is None:
                    self._send(e, hello)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [e.index for e in self._engines if e.info is None]
                raise TimeoutError(f"engine(s) {missing} did not report ready within {ready_timeout:g} s")
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), min(HELLO_INTERVAL, remaining))
            except TimeoutError:
                pass
        first = self._engines[0].info
        assert first is not None
        for e in self._engines[1:]:
            assert e.info is not None
            if (e.info.model, e.info.max_model_len, e.info.vocab_size) != (
                first.model, first.max_model_len, first.vocab_size
            ):
                raise RuntimeError(f"engine {e.index} serves {e.info} but engine 0 serves {first}")
        self.tokenizer = tokenizer or await asyncio.to_thread(load_tokenizer, first.tokenizer or first.model)
        self._inputs = InputProcessor(self.tokenizer, first.max_model_len, first.vocab_size)
        if first.lora_modules is not None:
            self.loras = LoRARegistry.from_modules(first.lora_modules, first.max_lora_rank, self._num_requests_using)
        now = time.monotonic()
        for e in self._engines:
            e.last_seen = now
        self._tasks.append(asyncio.create_task(self._monitor(), name="fastsched-engine-monitor"))
        self._started = True
        logger.info(
            "frontend %d connected to %d engine(s): model=%s max_model_len=%d",
            self.frontend_index, len(self._engines), first.model_name, first.max_model_len,
        )

    # ------------------------------------------------------------ requests

    async def prepare_prompt(self, prompt: PromptType) -> PromptType:
        """``prompt``, with a long text tokenized in a worker thread (``TokenizedText``):
        pass the result to :meth:`generate`. A text too long to ever fit raises
        ``LimitError`` at once, without tokenizing (``fastsched.limits``)."""
        self._check_started()
        if not isinstance(prompt, str) or len(prompt) <= INLINE_TOKENIZE_CHARS:
            return prompt
        assert self._inputs is not None and self.tokenizer is not None
        self._inputs.check_text_length(prompt)
        loop = asyncio.get_running_loop()
        return TokenizedText(prompt, await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, prompt))

    def session(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> Session:
        """Opens a streaming-input session (S15; ``fastsched.frontend.session``): ``prompt`` is its
        first chunk and ``params.max_tokens`` that chunk's generation. Admitted like a request
        (it counts as one request in flight until it ends), with the same errors as
        :meth:`generate`; ``ValueError`` also for ``n > 1`` or stop strings, which a session
        does not support. ``lora_request``: the adapter the session runs with, as for :meth:`generate`."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"a session generates one completion: n must be 1, got {params.n}")
        if params.stop:
            raise ValueError("stop strings are not supported in a session: stop must be empty")
        return Session(self, self._admit(request_id, prompt, params, priority, streaming=True,
                                         lora_request=lora_request, cache_salt=cache_salt))

    def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit and send one request; returns its stream (see the module docstring).

        Raises at once, with nothing sent and nothing charged: ``ValueError`` (empty
        prompt, token id out of range, prompt + max_tokens > max_model_len, request id
        in use; ``LimitError`` for a request over ``limits`` or one admission can never
        take, A4), :class:`AdmissionError` (A1–A3), :class:`EngineDeadError` (no engine
        alive, fault tolerance off). Iterating raises :class:`EngineDeadError` if its
        engine dies and ``ValueError`` if the engine refuses the prompt (docs/design.md §4:
        ignored, e.g. longer than the whole KV pool). ``lora_request``: the adapter every
        child runs with (see :attr:`loras`), None for the base model. ``cache_salt``
        (vLLM's): requests with different salts never share prefix-cache blocks.
        """
        return RequestStream(self, self._admit(request_id, prompt, params or SamplingParams(), priority,
                                               lora_request=lora_request, cache_salt=cache_salt))

    def _admit(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
               streaming: bool = False, lora_request: LoRARequest | None = None,
               cache_salt: str | None = None) -> _RequestState:
        self._check_started()
        self.limits.check_request_id(request_id)
        check_cache_salt(cache_salt)
        self.limits.check_n(params.n)
        self.limits.check_stop(params.stop or ())
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert self._inputs is not None
        text, token_ids = self._inputs.tokenize(prompt, params)
        healthy = [e for e in self._engines if e.healthy]
        if not healthy and not self.admission.fault_tolerance:
            reasons = "; ".join(f"engine {e.index}: {e.dead_reason}" for e in self._engines)
            raise EngineDeadError(f"no engine is alive ({reasons})")
        # Check and charge, then register and send: no await anywhere in between.
        try:
            self.admission.check_and_charge(request_id, params.n, len(token_ids), engine_healthy=self.is_healthy())
        except AdmissionError as e:
            self._history.add(rejected_status(request_id, self.frontend_index, e, time.time(), len(token_ids)))
            raise
        engine = min(healthy, key=lambda e: (e.num_in_flight, e.index))  # least loaded; ties: lowest index
        state = self._register(request_id, text, token_ids, params, engine)
        state.lora_name = None if lora_request is None else lora_request.name
        if self.request_logger is not None:
            self.request_logger.received(request_id, text, token_ids, params, priority)
        requests = InputProcessor.engine_requests(
            state.child_ids, token_ids, params, state.metrics.arrival_time, priority)
        if streaming:
            requests[0].streaming = True
            state.session = SessionState(len(token_ids) + params.max_tokens, len(token_ids))
        try:
            for request in requests:
                request.lora_request = lora_request
                request.cache_salt = cache_salt
                self._send(engine, protocol.encode(protocol.AddRequest(request, self.frontend_index)))
        except BaseException:
            self._drop(state)
            raise
        return state

    def _register(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams, engine: _Engine
    ) -> _RequestState:
        assert self.tokenizer is not None
        base = f"{self._id_prefix}{next(self._ids)}:{request_id}"
        child_ids = child_request_ids(base, params.n)
        parent = RequestOutput(request_id, text, token_ids, [CompletionOutput(index=i) for i in range(params.n)])
        processor = OutputProcessor(self.tokenizer)
        state = _RequestState(
            request_id, engine.index, params.n, parent, processor, child_ids,
            RequestMetrics(time.time(), num_prompt_tokens=len(token_ids)),
            prefilling=set(child_ids), sent=[(0, 0, 0, False)] * params.n, max_tokens=params.max_tokens,
        )
        for i, child_id in enumerate(child_ids):
            processor.add_request(child_id, parent, i, child_params(params, i))
            self._children[child_id] = state
        self._requests[request_id] = state
        engine.num_in_flight += params.n
        return state

    def _num_requests_using(self, lora_name: str) -> int:
        return sum(1 for state in self._requests.values() if state.lora_name == lora_name)

    async def abort(self, request_id: str) -> bool:
        """Abort a request: the engine frees its KV blocks; its stream ends with a final
        snapshot whose unfinished completions have finish_reason "abort". Returns whether
        the request was in flight."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        for o in state.parent.outputs:
            if o.finish_reason is None:
                o.finish_reason = "abort"
        self._drop(state)
        state.queue.put_nowait(None)
        return True

    def _send_stream_input(self, state: _RequestState, prompt: PromptType, max_tokens: int, last: bool) -> None:
        """A session's next chunk (``Session.send``), checked here so that the engine never refuses it."""
        session = state.session
        assert session is not None and self.tokenizer is not None and self._inputs is not None
        if state.done or session.closing:
            raise ValueError(f"session {state.request_id!r} has ended or is closing: it takes no more input")
        token_ids = chunk_token_ids(prompt, self.tokenizer, self._inputs.vocab_size)
        session.charge(state.request_id, len(token_ids), max_tokens, self._inputs.max_model_len)
        session.closing = last
        session.stop_idle_timer()
        child_id = state.child_ids[0]
        self._send(self._engines[state.engine_index],
                   protocol.encode(protocol.StreamInput(child_id, token_ids, max_tokens, last)))

    def _close_session(self, state: _RequestState) -> None:
        """``Session.close``: the engine ends the session once its input is served."""
        session = state.session
        assert session is not None
        if state.done or session.closing:
            return
        session.closing = True
        session.stop_idle_timer()
        self._send(self._engines[state.engine_index], protocol.encode(protocol.CloseStream(state.child_ids[0])))

    def _on_segment_end(self, state: _RequestState) -> None:
        """S15: a session's segment ended; it may now wait for input, for at most
        ``session_idle_timeout`` seconds."""
        session = state.session
        assert session is not None
        completion = state.parent.outputs[0]
        session.segment_ends.append((len(completion.token_ids), len(completion.text)))
        if self.session_idle_timeout is not None and session.waits_for_input():
            session.idle_timer = asyncio.get_running_loop().call_later(
                self.session_idle_timeout, self._expire_session, state)

    def _expire_session(self, state: _RequestState) -> None:
        if state.done:
            return
        logger.info("frontend %d: session %s waited %g s for input; aborted (--session-idle-timeout)",
                    self.frontend_index, state.request_id, self.session_idle_timeout)
        state.parent.outputs[0].finish_reason = "abort"
        self._drop(state)
        state.queue.put_nowait(None)

    def _drop(self, state: _RequestState) -> None:
        """End a request early (consumer gone, abort): abort what still runs in the engine
        and give everything back."""
        if state.done:
            return
        engine = self._engines[state.engine_index]
        live = [c for c in state.child_ids if c in self._children]
        if live and engine.healthy and not self._closed:
            self._send(engine, protocol.encode(protocol.Abort(live)))
        self._finish(state)

    def _finish(self, state: _RequestState, error: str | None = None) -> None:
        if state.done:
            return
        state.done = True
        if state.session is not None:
            state.session.stop_idle_timer()
        if state.metrics.e2e is None:
            state.metrics.e2e = time.time() - state.metrics.arrival_time
        counted = error is None and not any(o.finish_reason == "ignored" for o in state.parent.outputs)
        for i, child_id in enumerate(state.child_ids):
            # Still live: it ended early (aborted, its consumer gone, a stop string).
            if self._children.get(child_id) is state and counted:
                self._record_finished(state, i, child_id, "abort")
        requests = self._engines[state.engine_index].requests
        if counted and requests is not None:
            requests.observe_request(state.n, state.max_tokens)
        self._history.add(ended_status(state.request_id, self.frontend_index, state.engine_index,
                                       state.parent.outputs, state.metrics, error))
        if self.request_logger is not None:
            self.request_logger.finished(state.request_id, state.parent.outputs, state.metrics, error)
        self.admission.release(state.request_id)
        self._requests.pop(state.request_id, None)
        for child_id in state.child_ids:
            self._children.pop(child_id, None)
        self._engines[state.engine_index].num_in_flight -= state.n

    def _fail(self, state: _RequestState, error: BaseException) -> None:
        self._finish(state, str(error))
        state.queue.put_nowait(error)

    # ------------------------------------------------------------ engine messages

    async def _read_outputs(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = protocol.decode(data)
            except protocol.ProtocolError as e:
                logger.warning("frontend %d: dropped a malformed engine message: %s", self.frontend_index, e)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop every stream
                logger.exception("frontend %d: failed to handle %s", self.frontend_index, type(msg).__name__)

    def _dispatch(self, msg: protocol.Message) -> None:
        index = getattr(msg, "engine_index", None)
        if index is None or index >= len(self._engines):
            logger.warning("frontend %d: unexpected %s message", self.frontend_index, type(msg).__name__)
            return
        engine = self._engines[index]
        if not engine.healthy:
            if isinstance(msg, protocol.Ready):  # a new process at its address (the launcher restarted it)
                self._revive(engine, msg.model_info)
            return  # a dead engine's own messages are ignored: its requests have already failed
        engine.last_seen = time.monotonic()
        if isinstance(msg, protocol.Outputs):
            engine.stats = msg.stats
            self._update_ttft_slo_limit()
            self._process_outputs(msg)
        elif isinstance(msg, protocol.Heartbeat):
            engine.stats = msg.stats
            if msg.stats.process is not None:
                engine.process_stats = msg.stats.process
            self._update_ttft_slo_limit()
        elif isinstance(msg, protocol.Ready):
            if engine.info is None:
                logger.debug("frontend %d: engine %d ready (model=%s KV blocks=%d)", self.frontend_index, index,
                             msg.model_info.model_name, msg.model_info.num_gpu_blocks)
            engine.info = msg.model_info
            if engine.requests is None:
                engine.requests = EngineRequestMetrics(msg.model_info.max_model_len)
            self._update_ttft_slo_limit()
            self._ready.set()
        elif isinstance(msg, protocol.Failed):
            self._mark_dead(engine, msg.message)
            self._ready.set()
        elif isinstance(msg, protocol.Status):
            answer = self._queries.get(msg.query_id)
            if answer is not None and not answer.done():
                answer.set_result(msg.statuses)
        elif isinstance(msg, (protocol.Paused, protocol.Reloaded, protocol.PrefixCacheReset)):
            if isinstance(msg, protocol.Paused):
                engine.stats.pause_state = msg.state
            answer = self._commands.get(msg.query_id)
            if answer is not None and not answer.done():
                answer.set_result(msg)

    def _process_outputs(self, msg: protocol.Outputs) -> None:
        for timing in msg.timings:
            state = self._children.get(timing.request_id)
            if state is None:
                continue
            if timing.queue_time is not None:
                q = state.metrics.queue_time
                state.metrics.queue_time = timing.queue_time if q is None else min(q, timing.queue_time)
            state.timings[timing.request_id] = (timing.queue_time, timing.ttft, timing.e2e)
        by_request: dict[str, tuple[_RequestState, list[EngineCoreOutput]]] = {}
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
                self.admission.mark_first_token(state.request_id)
                if state.metrics.ttft is None:
                    state.metrics.ttft = time.time() - state.metrics.arrival_time
        if orphans:
            self._send(self._engines[msg.engine_index], protocol.encode(protocol.Abort(orphans)))
        for state, outs in by_request.values():
            self._apply(state, outs)

    def _apply(self, state: _RequestState, outs: list[EngineCoreOutput]) -> None:
        changed, to_abort = state.processor.process(outs)
        engine = self._engines[state.engine_index]
        if to_abort:  # ended by a stop string: the engine would go on generating
            self._send(engine, protocol.encode(protocol.Abort(to_abort)))
        if state.session is not None and any(o.segment_ended for o in outs):
            self._on_segment_end(state)
        for i, child_id in enumerate(state.child_ids):
            if state.parent.outputs[i].finished and self._children.pop(child_id, None) is not None:
                self._record_finished(state, i, child_id, state.parent.outputs[i].finish_reason)
        ignored = next((o for o in state.parent.outputs if o.finish_reason == "ignored"), None)
        if ignored is not None:
            self._drop(state)  # aborts the other children, if any
            state.queue.put_nowait(ValueError(str(ignored.stop_reason or "the engine refused the request")))
            return
        if state.parent.finished:
            self._finish(state)
        if changed:
            state.queue.put_nowait(None)

    def _record_finished(self, state: _RequestState, index: int, child_id: str, reason: str | None) -> None:
        """request_success_total and the per-request histograms of one ended completion."""
        requests = self._engines[state.engine_index].requests
        queue_time, ttft, e2e = state.timings.pop(child_id, (None, None, None))
        if requests is None:
            return
        if e2e is None:  # ended here (aborted, a stop string) or its last timing is on its way
            e2e = time.time() - state.metrics.arrival_time
        requests.observe_finished(reason, len(state.parent.prompt_token_ids),
                                  len(state.parent.outputs[index].token_ids), queue_time, ttft, e2e)

    def _update_ttft_slo_limit(self) -> None:
        """Feed the valve the live engines' total prefill throughput, unmeasured until
        every one of them has measured, and its floor: a few steps of prompt per engine."""
        if self.admission.ttft_slo is None:
            return
        engines = [e for e in self._engines if e.healthy and e.info is not None]
        rates = [e.stats.prefill_tokens_per_s for e in engines]
        total = None if not rates or None in rates else sum(r for r in rates if r is not None)
        floor = TTFT_SLO_FLOOR_STEPS * sum(e.info.max_num_batched_tokens for e in engines if e.info is not None)
        self.admission.update_prefill_throughput(total, max(1, floor))

    # ------------------------------------------------------------ health

    async def _monitor(self) -> None:
        interval = min(0.25, self.engine_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for e in self._engines:
                if not e.healthy:
                    continue
                if e.process is not None and not e.process.is_alive():
                    code = getattr(e.process, "exitcode", None)
                    self._mark_dead(e, f"its process exited (exit code {code})")
                elif now - e.last_seen > self.engine_timeout:
                    silence = now - e.last_seen
                    self._mark_dead(e, f"no message for {silence:.1f} s (engine_timeout {self.engine_timeout:g} s)")

    def _mark_dead(self, engine: _Engine, reason: str) -> None:
        if not engine.healthy:
            return
        engine.healthy = False
        engine.dead_reason = reason
        logger.error("frontend %d: engine %d is dead: %s", self.frontend_index, engine.index, reason)
        self._update_ttft_slo_limit()
        for state in [s for s in self._requests.values() if s.engine_index == engine.index]:
            self._fail(state, EngineDeadError(f"engine {engine.index} died: {reason}"))

    def _revive(self, engine: _Engine, info: ModelInfo) -> None:
        """A restarted engine said READY: serve with it again, from fresh stats. Its
        process handle named the old process, so from now on only silence
        (``engine_timeout``) marks it dead here; the launcher watches the process."""
        first = next((e.info for e in self._engines if e is not engine and e.info is not None), engine.info)
        if first is not None and (info.model, info.max_model_len, info.vocab_size) != (
                first.model, first.max_model_len, first.vocab_size):
            logger.error("frontend %d: restarted engine %d serves %s, not %s; left dead",
                         self.frontend_index, engine.index, info, first)
            return
        engine.healthy, engine.dead_reason, engine.info = True, None, info
        engine.stats, engine.last_seen, engine.process = EngineStats(), time.monotonic(), None
        logger.info("frontend %d: engine %d is back (restarted)", self.frontend_index, engine.index)
        self._update_ttft_slo_limit()

    def is_healthy(self) -> bool:
        """True while started and every engine is alive (A1 uses this)."""
        return self._started and not self._closed and all(e.healthy for e in self._engines)

    # ------------------------------------------------------------ pause (S13)

    async def pause(self, mode: str = "all") -> None:
        """Pauses every live engine (S13) and returns once each has said the pause is in force:
        ``"new"`` lets running requests finish while waiting ones stay queued, ``"all"`` schedules
        nothing (running requests keep their KV). Requests are still admitted meanwhile, and
        count toward ``max_num_queued_reqs``. ``ValueError`` for another mode; ``TimeoutError``
        when an engine does not answer within ``engine_timeout``."""
        await self._set_pause_state(protocol.pause_state(mode))

    async def resume(self) -> None:
        """Every live engine schedules again from where its pause stopped it."""
        await self._set_pause_state("unpaused")

    def is_paused(self) -> bool:
        """Whether a live engine is paused, as it last said."""
        return any(e.stats.pause_state != "unpaused" for e in self._engines if e.healthy)

    def pause_states(self) -> dict[int, str]:
        """Each live engine's pause state (``unpaused``, ``paused_new``, ``paused_all``)."""
        return {e.index: e.stats.pause_state for e in self._engines if e.healthy}

    async def reload_weights(self, model: str, timeout: float = 600.0) -> None:
        """Loads the weights of ``model`` (a checkpoint of the served architecture, as the
        engines see the filesystem) into every live engine and drops their prefix caches; the
        RL use of S13, between :meth:`pause` with mode ``all`` and :meth:`resume`. Returns once
        every engine has loaded them. ``RuntimeError`` when an engine is not paused with mode
        ``all``, ``ValueError`` when the weights do not fit, ``TimeoutError`` after ``timeout`` s."""
        answers = await self._command_all(lambda q: protocol.ReloadWeights(model, q, self.frontend_index), timeout)
        errors = {index: a.error for index, a in answers.items() if isinstance(a, protocol.Reloaded) and a.error}
        if errors:
            kinds = {kind for kind, _ in errors.values()}
            detail = "; ".join(f"engine {index}: {message}" for index, (_, message) in sorted(errors.items()))
            raise (RuntimeError if protocol.RELOAD_CONFLICT in kinds else ValueError)(detail)

    async def reset_prefix_cache(self, timeout: float | None = None) -> None:
        """Every live engine forgets its cached prefixes (vLLM's ``POST /reset_prefix_cache``);
        returns once each has. ``TimeoutError`` after ``timeout`` s (default: engine_timeout)."""
        await self._command_all(lambda q: protocol.ResetPrefixCache(q, self.frontend_index),
                                timeout if timeout is not None else self.engine_timeout)

    async def _set_pause_state(self, state: str) -> None:
        await self._command_all(lambda q: protocol.Pause(state, q, self.frontend_index), self.engine_timeout)

    async def _command_all(self, make: Any, timeout: float) -> dict[int, protocol.Message]:
        """Sends ``make(query_id)`` to every live engine; their answers, by engine index.
        ``TimeoutError`` naming an engine that does not answer within ``timeout`` seconds."""
        self._check_started()
        loop = asyncio.get_running_loop()
        waits = []
        for e in [e for e in self._engines if e.healthy]:
            query_id = next(self._query_ids)
            self._commands[query_id] = answer = loop.create_future()
            waits.append((query_id, e, answer))
            self._send(e, protocol.encode(make(query_id)))
        answers = {}
        try:
            for query_id, e, answer in waits:
                try:
                    answers[e.index] = await asyncio.wait_for(answer, timeout)
                except TimeoutError:
                    raise TimeoutError(f"engine {e.index} did not answer within {timeout:g} s") from None
        finally:
            for query_id, _, _ in waits:
                self._commands.pop(query_id, None)
        return answers

    # ------------------------------------------------------------ introspection

    def model_info(self) -> ModelInfo:
        self._check_started()
        info = self._engines[0].info
        assert info is not None
        return info

    async def request_status(self, request_id: str) -> dict[str, Any] | None:
        """Where a request is (``frontend.request_status``): rejected or ended (the last
        ``HISTORY_SIZE`` such requests are remembered), or in flight, as its engine reports it
        now. None when this frontend does not know the id. ``TimeoutError`` when the engine
        does not answer within ``engine_timeout`` (busy with a step longer than that)."""
        state = self._requests.get(request_id)
        if state is None:
            return self._history.get(request_id)
        live = [c for c in state.child_ids if c in self._children]
        replies: list[EngineRequestStatus] = []
        if live:
            query_id = next(self._query_ids)
            self._queries[query_id] = answer = asyncio.get_running_loop().create_future()
            try:
                query = protocol.Query(query_id, live, self.frontend_index)
                self._send(self._engines[state.engine_index], protocol.encode(query))
                replies = await asyncio.wait_for(answer, self.engine_timeout)
            except TimeoutError:
                if not state.done:
                    raise TimeoutError(
                        f"engine {state.engine_index} did not answer within {self.engine_timeout:g} s"
                    ) from None
            finally:
                self._queries.pop(query_id, None)
        if state.done:  # it ended (or failed) while the engine answered
            return self._history.get(request_id)
        return in_flight_status(request_id, self.frontend_index, state.engine_index, state.parent.outputs,
                                state.child_ids, {r.request_id: r for r in replies}, state.metrics)

    def stats(self) -> dict[str, Any]:
        """Engine stats summed over engines (``kv_cache_usage``: the mean), as last reported,
        plus this frontend's admission counters. Names as in docs/design.md §7 without prefix."""
        engines = [e for e in self._engines if e.healthy]  # a dead engine's last report is stale
        total = {
            name: sum(getattr(e.stats, name) for e in engines)
            for name in ("num_running", "num_waiting", "num_preemptions_total", "prefix_cache_queries",
                         "prefix_cache_hits", "prompt_tokens_total", "generation_tokens_total")
        }
        total["kv_cache_usage"] = sum(e.stats.kv_cache_usage for e in engines) / len(engines) if engines else 0.0
        total["engines"] = [
            {"index": e.index, "healthy": e.healthy, "dead_reason": e.dead_reason,
             "num_in_flight": e.num_in_flight, **vars(e.stats if e.healthy else EngineStats()),
             "process": e.process_stats, "cache_config": dict(e.info.cache_config) if e.info is not None else {}}
            for e in self._engines  # dead ones too: they are reported dead, their gauges zero
        ]
        total["requests_by_engine"] = {e.index: e.requests for e in engines if e.requests is not None}
        total["frontend_index"] = self.frontend_index
        total["admission_rejections_total"] = self.admission.rejections
        total["num_requests_in_flight"] = self.admission.num_requests
        total["num_sequences_in_flight"] = self.admission.num_in_flight
        total["num_sequences_in_flight_total"] = self.admission.num_in_flight_total
        total["num_queued_tokens"] = self.admission.num_queued_tokens
        total["admission_queued_tokens_limit"] = self.admission.queued_tokens_limit
        total["healthy"] = self.is_healthy()
        return total

    # ------------------------------------------------------------ lifecycle

    async def shutdown(self) -> None:
        """Abort every request in flight (their streams raise EngineDeadError), stop the
        tasks and close the sockets. The engine processes belong to whoever started them."""
        if self._closed:
            return
        for state in list(self._requests.values()):
            self._drop(state)
            state.queue.put_nowait(EngineDeadError("the frontend is shutting down"))
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pull.close(linger=0)
        for e in self._engines:
            e.push.close(linger=500 if e.healthy else 0)  # let the aborts above reach live engines
        self._ctx.term()
        self._send_ctx.term()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _check_started(self) -> None:
        if self._closed:
            raise EngineDeadError("this AsyncLLM is shut down")
        if not self._started:
            raise RuntimeError("AsyncLLM is not started; create it with `await AsyncLLM.start(...)`")

    def _send(self, engine: _Engine, data: bytes) -> None:
        try:
            engine.push.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot send to engine {engine.index}: {e}") from e

