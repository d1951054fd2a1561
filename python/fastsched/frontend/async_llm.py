"""AsyncLLM: a frontend's client of D engine processes (docs/design.md §1, §6), as a thin
facade over three parts, split along vLLM's seams:

- :class:`~fastsched.frontend.engine_client.EngineClient`: the ZMQ sockets, the health
  monitor and the reviver, the command RPCs; it knows request ids, never their state;
- :class:`~fastsched.frontend.request_table.RequestTable`: every request in flight and the
  per-engine in-flight counts, publishing ``first_token`` / ``finished`` events to which
  admission, request metrics, the history, the request log, the LoRA registry and the
  session timer subscribe;
- this class: tokenize, validate, admit (A1–A5, A6 via the shared counters), route, fan
  out ``n``; pause/reload, status queries and stats.

Streaming contract: ``generate()`` admits the request *when called* (so an
:class:`AdmissionError` or ``ValueError`` surfaces before a response is started) and
returns a :class:`RequestStream` (``frontend.request_stream``). ``session()`` opens a
streaming-input session (S15, ``frontend.session``). ``request_status()`` says where a
request is: it asks the engine (a QUERY) or remembers (``frontend.request_status``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from fastsched.engine import protocol
from fastsched.engine.protocol import EngineRequestStatus, EngineStats, ModelInfo
from fastsched.engine.step_time_meter import StepTimeFit
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
from fastsched.frontend.engine_client import EngineClient, EngineConnection, EngineDeadError, ProcessHandle
from fastsched.frontend.lora_registry import LoRARegistry
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.frontend.request_log import RequestLogger
from fastsched.frontend.request_status import RequestHistory, ended_status, in_flight_status, rejected_status
from fastsched.frontend.request_stream import CompletionDelta, RequestStream, StreamOutput
from fastsched.frontend.request_table import RequestState, RequestTable
from fastsched.frontend.routing import Router, router_for
from fastsched.frontend.session import Session, SessionLimitError, SessionState, SessionTimer, session_cap
from fastsched.frontend.settings import FrontendSettings
from fastsched.inputs import PromptType, child_params, child_request_ids, engine_requests
from fastsched.lora.request import LoRARequest
from fastsched.model_loader import Tokenizer, load_model_config, load_tokenizer
from fastsched.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fastsched.request_gate import RequestGate, ValidRequest
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


class AsyncLLM:
    """A frontend's requests to its engines, over an :class:`EngineClient` and a :class:`RequestTable`
    (see the module docstring). Create with ``await AsyncLLM.start(...)``; one per frontend
    process, used from one event loop."""

    def __init__(
        self,
        engine_input_addrs: Sequence[str],
        output_addr: str,
        *,
        frontend_index: int,
        settings: FrontendSettings,
        admission: AdmissionController,
        engine_procs: Sequence[ProcessHandle | None] | None,
    ) -> None:
        self.settings = settings
        self._timer = SessionTimer(settings.session_idle_timeout, self._expire_session)
        self.max_sessions = 0  # this frontend's share, once the engines have said their max_num_seqs
        self.num_sessions = 0  # sessions open now
        self.session_open_timeout = settings.session_open_timeout  # gRPC GenerateSession's wait for `open`
        self.session_idle_timeout = settings.session_idle_timeout
        self.frontend_index = frontend_index
        self.admission = admission
        self.engine_timeout = settings.engine_timeout
        self.request_logger = RequestLogger(settings.max_log_len) if settings.enable_log_requests else None
        self.limits = settings.limits
        self.tokenizer: Tokenizer | None = None
        self.gate: RequestGate | None = None  # every request's checks, once the engines have said which model
        self._client = EngineClient(
            engine_input_addrs,
            output_addr,
            frontend_index=frontend_index,
            engine_procs=engine_procs,
            engine_timeout=settings.engine_timeout,
        )
        self.output_addr = output_addr
        self._engines = self._client.engines
        self._table = RequestTable(len(self._engines), self._client.abort)
        self._client.on_outputs = self._table.apply_outputs
        self._client.on_engine_dead = self._fail_engine_requests
        self._client.on_stats = self._on_engine_stats
        self._client.on_kv_events = self._on_kv_events
        self.router: Router | None = None  # once the engines have said their block size (frontend.routing)
        # Engine request ids must be unique in the engine across frontends and restarts.
        self._id_prefix = f"{frontend_index}.{secrets.token_hex(3)}."
        self._ids = itertools.count()
        self._history = RequestHistory()  # rejected and ended requests, for request_status()
        self._started = False
        self._closed = False
        self.loras: LoRARegistry | None = None  # adapters by name, when the engines serve LoRA
        self._subscribe()

    def _subscribe(self) -> None:
        """Who hears of a request's first token and of its end (``frontend.request_table``)."""
        table = self._table
        table.on_first_token.append(lambda state: self.admission.mark_first_token(state.request_id))
        table.on_added.append(lambda state: self._count_session(state, 1))
        table.on_finished.append(lambda state, error, counted: self._count_session(state, -1))
        table.on_segment_ended.append(self._timer.segment_ended)
        table.on_child_finished.append(self._record_finished)
        table.on_finished.extend(
            [self._timer.finished, self._record_request, self._remember, self._log_finished, self._release]
        )

    @classmethod
    async def start(
        cls,
        engine_input_addrs: Sequence[str],
        output_addr: str,
        *,
        frontend_index: int = 0,
        settings: FrontendSettings | None = None,
        shared_stats: SharedInFlightCounter | None = None,
        engine_procs: Sequence[ProcessHandle | None] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> AsyncLLM:
        """Bind ``output_addr`` (this frontend's PULL), connect to every engine's input,
        and wait until each has answered READY (``TimeoutError`` after
        ``settings.ready_timeout`` seconds; ``RuntimeError`` at once if an engine reports
        failure or its process, when given, exits). The tokenizer comes from the model the
        engines report unless given. ``settings``: admission, request limits, timeouts and
        request logging (``frontend.settings``, validated there; default: all off).
        ``shared_stats``: this frontend's opened ``SharedAdmissionStats`` slot (A6)."""
        settings = settings or FrontendSettings()
        llm = cls(
            engine_input_addrs,
            output_addr,
            frontend_index=frontend_index,
            settings=settings,
            admission=AdmissionController(settings, shared_stats),
            engine_procs=engine_procs,
        )
        try:
            await llm._start(settings.ready_timeout, tokenizer)
        except BaseException:
            await llm.shutdown()
            raise
        return llm

    async def _start(self, ready_timeout: float, tokenizer: Tokenizer | None) -> None:
        first = await self._client.connect(ready_timeout)
        self.tokenizer = tokenizer or await asyncio.to_thread(load_tokenizer, first.tokenizer or first.model)
        self.gate = RequestGate(self.tokenizer, first.max_model_len, first.vocab_size, self.limits)
        self.router = router_for(self.settings, first, len(self._engines))
        max_num_seqs = sum(e.info.max_num_seqs for e in self._engines if e.info is not None)
        self.max_sessions = session_cap(self.settings.max_sessions, max_num_seqs, self.settings.num_frontends)
        if first.lora_modules is not None:
            model_config = await asyncio.to_thread(load_model_config, first.model)
            self.loras = LoRARegistry.from_modules(first.lora_modules, first.max_lora_rank, model_config)
            self._table.on_added.append(self.loras.request_started)
            self._table.on_finished.append(self.loras.request_finished)
        self._started = True
        logger.info(
            "frontend %d connected to %d engine(s): model=%s max_model_len=%d",
            self.frontend_index,
            len(self._engines),
            first.model_name,
            first.max_model_len,
        )

    # ------------------------------------------------------------ requests

    async def prepare_prompt(self, prompt: PromptType) -> PromptType:
        """``prompt``, with a long text tokenized in a worker thread (``TokenizedText``):
        pass the result to :meth:`generate`. A text too long to ever fit raises
        ``LimitError`` at once, without tokenizing (``fastsched.request_gate``)."""
        return await self._gate().prepare(prompt)

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
        does not support. ``lora_request``: the adapter the session runs with, as for :meth:`generate`.
        :class:`SessionLimitError` (an :class:`AdmissionError`) when this frontend's share of
        ``max_sessions`` is open already."""
        return self.open_session(
            self._gate().request(
                request_id,
                prompt,
                params or SamplingParams(),
                priority,
                lora_request,
                streaming=True,
                cache_salt=cache_salt,
            )
        )

    def open_session(self, valid: ValidRequest) -> Session:
        """:meth:`session` for a request the gate has let through (``valid.streaming``)."""
        if self.num_sessions >= self.max_sessions:
            error = SessionLimitError(
                f"{self.num_sessions} sessions are open on this frontend, its share of --max-sessions "
                f"({self.max_sessions}); retry later",
                limit=self.max_sessions,
                current=self.num_sessions,
            )
            self._history.add(rejected_status(valid.request_id, self.frontend_index, error, time.time(), 0))
            self.admission.count_rejection(error)
            raise error
        return Session(self, self._admit(valid))

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
        return self.submit(
            self._gate().request(
                request_id, prompt, params or SamplingParams(), priority, lora_request, cache_salt=cache_salt
            )
        )

    def submit(self, valid: ValidRequest) -> RequestStream:
        """:meth:`generate` for a request the gate (:attr:`gate`) has let through: nothing in
        it is checked again, but that its id is not in use and admission (A1–A5)."""
        return RequestStream(self._table, self._admit(valid))

    def _gate(self) -> RequestGate:
        self._check_started()
        assert self.gate is not None
        return self.gate

    def _admit(self, valid: ValidRequest) -> RequestState:
        self._check_started()
        request_id, text, token_ids, params = (
            valid.request_id,
            valid.prompt,
            valid.prompt_token_ids,
            valid.params,
        )
        if request_id in self._table:
            raise ValueError(f"request id {request_id!r} is already in use")
        healthy = self._client.healthy()
        if not healthy and not self.admission.fault_tolerance:
            raise EngineDeadError(f"no engine is alive ({self._client.dead_reasons()})")
        # Check and charge, then register and send: no await anywhere in between.
        try:
            self.admission.check_and_charge(
                request_id,
                params.n,
                len(token_ids),
                engine_healthy=self.is_healthy(),
                max_tokens=params.max_tokens,
            )
        except AdmissionError as e:
            self._history.add(
                rejected_status(request_id, self.frontend_index, e, time.time(), len(token_ids))
            )
            raise
        assert self.router is not None
        lora_id = None if valid.lora_request is None else valid.lora_request.id
        decision = self.router.choose(
            token_ids,
            [e.index for e in healthy],
            self._table.in_flight,
            lora_id=lora_id,
            cache_salt=valid.cache_salt,
        )
        engine = self._engines[decision.engine]
        state = self._new_state(request_id, text, token_ids, params, engine)
        state.routing = decision
        state.lora_name = None if valid.lora_request is None else valid.lora_request.name
        if self.request_logger is not None:
            self.request_logger.received(request_id, text, token_ids, params, valid.priority)
        requests = engine_requests(
            state.child_ids, token_ids, params, state.metrics.arrival_time, valid.priority
        )
        requests[0].pooling = valid.pooling
        if valid.streaming:
            requests[0].streaming = True
            state.session = SessionState(len(token_ids) + params.max_tokens, len(token_ids))
        self._table.add(state)
        try:
            for request in requests:
                request.lora_request = valid.lora_request
                request.cache_salt = valid.cache_salt
                self._client.send(engine.index, protocol.AddRequest(request, self.frontend_index))
        except BaseException:
            self._table.drop(state)
            raise
        return state

    def _new_state(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        engine: EngineConnection,
    ) -> RequestState:
        assert self.tokenizer is not None
        base = f"{self._id_prefix}{next(self._ids)}:{request_id}"
        child_ids = child_request_ids(base, params.n)
        parent = RequestOutput(
            request_id, text, token_ids, [CompletionOutput(index=i) for i in range(params.n)]
        )
        processor = OutputProcessor(self.tokenizer)
        state = RequestState(
            request_id,
            engine.index,
            params.n,
            parent,
            processor,
            child_ids,
            RequestMetrics(time.time(), num_prompt_tokens=len(token_ids)),
            prefilling=set(child_ids),
            max_tokens=params.max_tokens,
        )
        for i, child_id in enumerate(child_ids):
            processor.add_request(child_id, parent, i, child_params(params, i))
        return state

    async def abort(self, request_id: str) -> bool:
        """Abort a request: the engine frees its KV blocks; its stream ends with a final
        snapshot whose unfinished completions have finish_reason "abort". Returns whether
        the request was in flight."""
        state = self._table.get(request_id)
        if state is None:
            return False
        self._table.abort(state)
        return True

    def drop(self, state: RequestState) -> None:
        """End a request early, its consumer gone (``RequestHandle``): abort it in the engine."""
        self._table.drop(state)

    # ------------------------------------------------------------ sessions (S15)

    async def prepare_chunk(self, state: RequestState, prompt: PromptType) -> PromptType:
        """A session's chunk ready for :meth:`send_stream_input` (a long text bounded, then
        tokenized off the event loop: ``RequestGate.prepare``)."""
        assert state.session is not None
        return await self._gate().prepare(prompt, held=state.session.max_tokens_reached)

    def send_stream_input(self, state: RequestState, prompt: PromptType, max_tokens: int, last: bool) -> None:
        """A session's next chunk (``Session.send``), checked by the gate so that the engine never refuses it."""
        session = state.session
        assert session is not None
        if state.done or session.closing:
            raise ValueError(f"session {state.request_id!r} has ended or is closing: it takes no more input")
        chunk = self._gate().chunk(
            state.request_id,
            prompt,
            max_tokens,
            last,
            held=session.max_tokens_reached,
            num_chunks=session.num_chunks,
        )
        session.count(len(chunk.token_ids), chunk.max_tokens)
        session.closing = last
        session.stop_idle_timer()
        self._client.send(
            state.engine_index,
            protocol.StreamInput(state.child_ids[0], chunk.token_ids, chunk.max_tokens, last),
        )

    def close_session(self, state: RequestState) -> None:
        """``Session.close``: the engine ends the session once its input is served."""
        session = state.session
        assert session is not None
        if state.done or session.closing:
            return
        session.closing = True
        session.stop_idle_timer()
        self._client.send(state.engine_index, protocol.CloseStream(state.child_ids[0]))

    def _count_session(self, state: RequestState, delta: int) -> None:
        if state.session is not None:
            self.num_sessions += delta

    def _expire_session(self, state: Any) -> None:
        logger.info(
            "frontend %d: session %s waited %g s for input; aborted (--session-idle-timeout)",
            self.frontend_index,
            state.request_id,
            self.session_idle_timeout,
        )
        self._table.abort(state)

    # ------------------------------------------------------------ table subscribers

    def _record_finished(self, state: RequestState, index: int, child_id: str, reason: str | None) -> None:
        """request_success_total and the per-request histograms of one ended completion."""
        requests = self._engines[state.engine_index].requests
        queue_time, ttft, e2e = state.timings.pop(child_id, (None, None, None))
        if requests is None:
            return
        if e2e is None:  # ended here (aborted, a stop string) or its last timing is on its way
            e2e = time.time() - state.metrics.arrival_time
        requests.observe_finished(
            reason,
            len(state.parent.prompt_token_ids),
            len(state.parent.outputs[index].token_ids),
            queue_time,
            ttft,
            e2e,
        )

    def _record_request(self, state: RequestState, error: str | None, counted: bool) -> None:
        requests = self._engines[state.engine_index].requests
        if counted and requests is not None:
            requests.observe_request(state.n, state.max_tokens)

    def _remember(self, state: RequestState, error: str | None, counted: bool) -> None:
        self._history.add(
            _with_routing(
                ended_status(
                    state.request_id,
                    self.frontend_index,
                    state.engine_index,
                    state.parent.outputs,
                    state.metrics,
                    error,
                ),
                state,
            )
        )

    def _log_finished(self, state: RequestState, error: str | None, counted: bool) -> None:
        if self.request_logger is not None:
            self.request_logger.finished(state.request_id, state.parent.outputs, state.metrics, error)

    def _release(self, state: RequestState, error: str | None, counted: bool) -> None:
        self.admission.release(state.request_id, len(state.parent.outputs[0].token_ids) if counted else 0)

    def _on_kv_events(self, msg: protocol.KvEvents) -> None:
        if self.router is not None:
            stored, removed = msg.hashes()
            self.router.on_kv_events(msg.engine_index, stored.tolist(), removed.tolist())

    def _fail_engine_requests(self, engine_index: int, reason: str) -> None:
        if self.router is not None:
            self.router.forget_engine(engine_index)
        for state in self._table.on_engine(engine_index):
            self._table.fail(state, EngineDeadError(f"engine {engine_index} died: {reason}"))

    def _on_engine_stats(self) -> None:
        self._update_ttft_slo_limit()
        self._update_step_time()

    def _update_step_time(self) -> None:
        """Feed the goodput valve (A7) the live engines' mean step-time fit, None until every
        one of them has fitted, and one engine's token budget."""
        if self.admission.tpot_slo is None:
            return
        engines = [e for e in self._engines if e.healthy and e.info is not None]
        fits = [(e.stats.step_time_base_s, e.stats.step_time_per_token_s) for e in engines]
        fit = None
        if fits and all(b is not None and t is not None for b, t in fits):
            fit = StepTimeFit(
                sum(b for b, _ in fits if b is not None) / len(fits),
                sum(t for _, t in fits if t is not None) / len(fits),
            )
        budget = min((e.info.max_num_batched_tokens for e in engines if e.info is not None), default=0)
        self.admission.update_step_time(fit, budget, len(engines))

    def _update_ttft_slo_limit(self) -> None:
        """Feed the valve the live engines' total prefill throughput, unmeasured until
        every one of them has measured, and its floor: a few steps of prompt per engine."""
        if self.admission.ttft_slo is None:
            return
        engines = [e for e in self._engines if e.healthy and e.info is not None]
        rates = [e.stats.prefill_tokens_per_s for e in engines]
        total = None if not rates or None in rates else sum(r for r in rates if r is not None)
        floor = TTFT_SLO_FLOOR_STEPS * sum(
            e.info.max_num_batched_tokens for e in engines if e.info is not None
        )
        self.admission.update_prefill_throughput(total, max(1, floor))

    def is_healthy(self) -> bool:
        """True while started and every engine is alive (A1 uses this)."""
        return self._started and not self._closed and self._client.all_healthy()

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
        answers = await self._command_all(
            lambda q: protocol.ReloadWeights(model, q, self.frontend_index), timeout
        )
        errors = {
            index: a.error for index, a in answers.items() if isinstance(a, protocol.Reloaded) and a.error
        }
        if errors:
            kinds = {kind for kind, _ in errors.values()}
            detail = "; ".join(f"engine {index}: {message}" for index, (_, message) in sorted(errors.items()))
            raise (RuntimeError if protocol.RELOAD_CONFLICT in kinds else ValueError)(detail)

    async def reset_prefix_cache(self, timeout: float | None = None) -> None:
        """Every live engine forgets its cached prefixes (vLLM's ``POST /reset_prefix_cache``);
        returns once each has. ``TimeoutError`` after ``timeout`` s (default: engine_timeout)."""
        await self._command_all(
            lambda q: protocol.ResetPrefixCache(q, self.frontend_index),
            timeout if timeout is not None else self.engine_timeout,
        )

    async def _set_pause_state(self, state: protocol.PauseState) -> None:
        await self._command_all(lambda q: protocol.Pause(state, q, self.frontend_index), self.engine_timeout)

    async def _command_all(self, make: Any, timeout: float) -> dict[int, protocol.Message]:
        self._check_started()
        return await self._client.command_all(make, timeout)

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
        state = self._table.get(request_id)
        if state is None:
            return self._history.get(request_id)
        live = self._table.live_children(state)
        replies: list[EngineRequestStatus] = []
        if live:
            try:
                replies = await self._client.query(state.engine_index, live)
            except TimeoutError:
                if not state.done:
                    raise TimeoutError(
                        f"engine {state.engine_index} did not answer within {self.engine_timeout:g} s"
                    ) from None
        if state.done:  # it ended (or failed) while the engine answered
            return self._history.get(request_id)
        status = _with_routing(
            in_flight_status(
                request_id,
                self.frontend_index,
                state.engine_index,
                state.parent.outputs,
                state.child_ids,
                {r.request_id: r for r in replies},
                state.metrics,
            ),
            state,
        )
        prediction = self.admission.prediction(request_id)  # the goodput valve's (A7)
        if prediction is not None:
            status["slo_prediction"] = prediction.as_dict()
        return status

    def stats(self) -> dict[str, Any]:
        """Engine stats summed over engines (``kv_cache_usage``: the mean), as last reported,
        plus this frontend's admission counters. Names as in docs/design.md §7 without prefix."""
        engines = [e for e in self._engines if e.healthy]  # a dead engine's last report is stale
        total = {
            name: sum(getattr(e.stats, name) for e in engines)
            for name in (
                "num_running",
                "num_waiting",
                "num_preemptions_total",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "prompt_tokens_total",
                "generation_tokens_total",
            )
        }
        total["kv_cache_usage"] = (
            sum(e.stats.kv_cache_usage for e in engines) / len(engines) if engines else 0.0
        )
        total["engines"] = [
            {
                "index": e.index,
                "healthy": e.healthy,
                "dead_reason": e.dead_reason,
                "num_in_flight": self._table.in_flight[e.index],
                **msgspec.structs.asdict(e.stats if e.healthy else EngineStats()),
                "process": e.process_stats,
                "cache_config": dict(e.info.cache_config) if e.info is not None else {},
            }
            for e in self._engines  # dead ones too: they are reported dead, their gauges zero
        ]
        total["requests_by_engine"] = {e.index: e.requests for e in engines if e.requests is not None}
        total["frontend_index"] = self.frontend_index
        total["admission_rejections_total"] = self.admission.rejections
        total["routing_decisions_total"] = (
            dict(self.router.decisions_total) if self.router is not None else {}
        )
        total["num_requests_in_flight"] = self.admission.num_requests
        total["num_sequences_in_flight"] = self.admission.num_in_flight
        total["num_sequences_in_flight_total"] = self.admission.num_in_flight_total
        total["num_queued_tokens"] = self.admission.num_queued_tokens
        total["admission_queued_tokens_limit"] = self.admission.queued_tokens_limit
        if self.admission.tpot_slo is not None:
            total["slo_prediction_error_seconds"] = self.admission.prediction_errors
        total["healthy"] = self.is_healthy()
        return total

    # ------------------------------------------------------------ lifecycle

    async def shutdown(self) -> None:
        """Abort every request in flight (their streams raise EngineDeadError), stop the
        tasks and close the sockets. The engine processes belong to whoever started them."""
        if self._closed:
            return
        for state in self._table.states():
            self._table.drop(state)
            state.queue.put_nowait(EngineDeadError("the frontend is shutting down"))
        self._closed = True
        await self._client.close()  # the aborts above still reach live engines
        if self.gate is not None:
            self.gate.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _check_started(self) -> None:
        if self._closed:
            raise EngineDeadError("this AsyncLLM is shut down")
        if not self._started:
            raise RuntimeError("AsyncLLM is not started; create it with `await AsyncLLM.start(...)`")


def _with_routing(status: dict[str, Any], state: RequestState) -> dict[str, Any]:
    """A request's status with why its engine was chosen (``/debug/requests/{id}``)."""
    if state.routing is not None:
        status["routing"] = state.routing.describe()
    return status
