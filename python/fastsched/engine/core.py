"""EngineCore: the busy loop schedule -> execute -> update_from_output -> outputs.

It owns the model runner and the Rust scheduler and speaks in token ids only;
text (detokenization, stop strings, ``n`` fan-out) is the output processor's
job, in the frontend or in ``fastsched.LLM``.

The host work of a step is array work over the scheduler's arrays: per-request
values the step reads that the scheduler does not hold (ids, output kinds, times) are
numpy columns indexed by scheduler handle, written when a request is added; what the
scheduler holds (prompt lengths, limits, arrival, progress) the engine asks it for, in
arrays. A step's outputs leave as one :class:`OutputBatch` (``engine.step_outputs``).
Python runs per request only when a request starts (it takes a runner row), finishes,
or needs something of its own (logprobs, a stop token id, an error). With a few dozen
numpy calls per step their fixed cost is what counts: the hot path tests arrays with
``np.count_nonzero``, a fraction of the cost of ``any()``/``all()`` (a ufunc reduction)
on arrays of a few hundred rows.

With async scheduling (``EngineConfig.async_scheduling``) the forward pass runs on a
worker thread: while step N's forward pass runs, ``step()`` schedules and prepares
step N+1 (its decodes' input tokens are placeholders for N's samples, filled in by
the runner just before N+1's forward pass), then collects N. docs/scheduler.md,
"Async scheduling in the engine", says what that changes and why it is still exact.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from fastsched import _core
from fastsched.attention import select_backend
from fastsched.config import EngineConfig
from fastsched.cpu_env import configure_threads
from fastsched.engine.kv_connector.identity import store_identity
from fastsched.engine.kv_connector.transfer import KVTransfer, Saves, make_connector
from fastsched.engine.prefill_meter import PrefillThroughputMeter, prefill_tokens
from fastsched.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    OutputBatch,
    PauseState,
    pause_state,
)
from fastsched.engine.start_up_heap import freeze_start_up_heap
from fastsched.engine.stats import StatsLogger
from fastsched.engine.step_outputs import StepOutputs
from fastsched.engine.step_time_meter import StepTimeMeter
from fastsched.engine.step_trace import StepShape, StepTracer
from fastsched.engine.structured_outputs import StructuredOutputs
from fastsched.inputs import check_prompt
from fastsched.lora.slots import LoRAManager
from fastsched.model_loader import load_model_config, load_tokenizer
from fastsched.model_loader.generation_defaults import load_generation_defaults
from fastsched.model_loader.weights import load_model
from fastsched.models.config import ModelConfig
from fastsched.models.tp_shard import describe_head_split
from fastsched.sample import make_generator
from fastsched.spec_decode import SpecDecodingCounters, build_proposer, draft_rows
from fastsched.worker.input_batch import RowState
from fastsched.worker.kv_sizing import fit_max_model_len, kv_pool_blocks
from fastsched.worker.model_runner import ExecutedStep, ModelRunner, PreparedStep, StepResult
from fastsched.worker.tp_group import start_tensor_parallel
from fastsched.worker.weight_reload import load_checked, swap_in

logger = logging.getLogger(__name__)

KIND_NEW = 1  # SchedulerOutput.kinds: scheduled for the first time
_NO_ROWS = np.zeros(0, dtype=np.int64)


class NotPausedError(RuntimeError):
    """What needs the engine paused with mode ``all`` (a weight reload) was asked of it otherwise."""


@dataclass
class _Step:
    """A step scheduled and launched but not yet collected."""

    so: _core.SchedulerOutput
    prepared: PreparedStep | None  # None: preparing it failed
    future: Future[ExecutedStep] | None  # None: executed when collected (sync, or nothing to run)
    launched: float  # perf_counter() when it was scheduled
    launched_wall: float  # time.time() then
    backlogged: bool  # requests were still waiting after its schedule()
    prompt_lens: np.ndarray  # the prompt length of each scheduled request
    saves: Saves | None = None  # KV blocks to save once it has run (sync); async queues them itself


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        if device.type == "cpu":
            configure_threads(config.num_threads)
        self.model_config: ModelConfig = load_model_config(config.model)
        # The model's bound; the KV pool may cut it once sized (fit_max_model_len, below).
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_position_embeddings)
        logger.info(
            "loading model %s (%s, %s, quantization %s)",
            config.model or "SmolLM2-135M-Instruct (embedded)",
            dtype,
            device,
            config.resolved_quantization,
        )
        # --tensor-parallel-size: the other ranks load their shards while this one loads its own.
        self.tp_group = (
            None if config.tensor_parallel_size == 1 else start_tensor_parallel(config, device, dtype)
        )
        model = load_model(
            config.model,
            dtype=dtype,
            device=device,
            quantization=config.resolved_quantization,
            tp=None if self.tp_group is None else self.tp_group.tp,
        )
        backend = select_backend(device, config.attention_backend)
        spec = config.speculative_config
        # Before KV sizing, so that a draft model's weights are not counted as free memory.
        self.proposer = (
            None
            if spec is None
            else build_proposer(
                spec,
                self.model_config,
                backend,
                block_size=config.block_size,
                max_model_len=self.max_model_len,
                device=device,
                dtype=dtype,
            )
        )
        num_blocks = kv_pool_blocks(
            model, backend, config, self.model_config, dtype, device, self.max_model_len
        )
        self.max_model_len = fit_max_model_len(config, self.max_model_len, num_blocks)
        if self.tp_group is not None:
            self.tp_group.share_num_blocks(num_blocks)
            logger.info(
                "tensor parallel heads: %s",
                describe_head_split(self.model_config, config.tensor_parallel_size),
            )
        self.lora = None
        if config.enable_lora:
            self.lora = LoRAManager(
                self.model_config,
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.lora_cpu_capacity,
                device=device,
                dtype=dtype,
                kernel="triton" if device.type == "cuda" else "torch",
                tp=None if self.tp_group is None else self.tp_group.tp,
            )
        self.scheduler = _core.Scheduler(config.scheduler_config(self.max_model_len, num_blocks))
        self.spec_counters = None if spec is None else SpecDecodingCounters(spec.num_speculative_tokens)
        # Drafts are proposed from the tokens a step accepts, so the next step cannot be
        # scheduled before they are known (docs/scheduler.md, "Speculative decoding in the engine").
        async_scheduling = config.async_scheduling and spec is None
        if spec is not None:
            logger.info(
                "speculative decoding: %s, %d tokens per step%s",
                spec.method,
                spec.num_speculative_tokens,
                "; async scheduling is off" if config.async_scheduling else "",
            )
        self.runner = ModelRunner(
            model,
            backend,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            device=device,
            dtype=dtype,
            seed=config.seed,
            lora=self.lora,
            step_channel=None if self.tp_group is None else self.tp_group.channel,
        )
        self.scheduler.set_async_scheduling(async_scheduling)
        # One worker thread runs the forward passes in order (async scheduling); the
        # host prepares the next step meanwhile.
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="fastsched-forward") if async_scheduling else None
        )
        self._in_flight: deque[_Step] = deque()
        self.kv_transfer = self._make_kv_transfer(dtype)  # --kv-transfer-config
        self._last_step_end = 0.0  # perf_counter() when the last step was collected
        self._last_step_end_wall = 0.0
        # The tokenizer may add an end-of-turn id (GGUF chat models) to the model's EOS ids.
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        tokenizer_eos = tokenizer.eos_token_ids
        self.sampling_defaults = load_generation_defaults(config.model, config.generation_config)
        if self.sampling_defaults:
            logger.info(
                "sampling defaults from the model's generation config (--generation-config %s): %s",
                config.generation_config,
                self.sampling_defaults,
            )
        self.eos_token_ids = tuple(dict.fromkeys((*self.model_config.eos_token_ids, *tokenizer_eos)))
        self.vocab_size = self.model_config.vocab_size
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)
        self._outputs = StepOutputs(self.scheduler, self.eos_token_ids)
        self._columns = self._outputs.columns
        self._row_states: dict[int, RowState] = {}  # live handle -> what the runner needs when it takes a row
        # S15 input waiting for a step in flight to be collected (add_stream_input).
        self._deferred_inputs: list[tuple[str, list[int], int, bool]] = []
        self.stats = StatsLogger(config.log_stats_interval, spec=self.spec_counters)
        self.step_tracer = StepTracer(config.step_trace) if config.step_trace else None  # --step-trace
        self.prefill_meter = PrefillThroughputMeter()  # read by the TTFT-SLO valve (--ttft-slo)
        self.step_time_meter = StepTimeMeter()  # read by the goodput valve (--tpot-slo)
        sc = self.scheduler.config
        logger.info(
            "attention backend: %s; scheduler: policy=%s max_num_seqs=%d max_num_active_seqs=%d "
            "max_num_batched_tokens=%d max_model_len=%d block_size=%d prefix_caching=%s",
            backend.name,
            sc.policy,
            sc.max_num_seqs,
            sc.max_num_active_seqs,
            sc.max_num_batched_tokens,
            sc.max_model_len,
            sc.block_size,
            sc.enable_prefix_caching,
        )
        freeze_start_up_heap()

    def _make_kv_transfer(self, dtype: torch.dtype) -> KVTransfer | None:
        kv_config = self.config.kv_transfer_config
        if kv_config is None:
            return None
        identity = store_identity(
            self.config.model,
            self.model_config,
            self.config.block_size,
            dtype,
            self.config.prefix_caching_hash_algo,
        )
        logger.info(
            "KV connector %s (%s) at %s, store key %s",
            kv_config.kv_connector,
            kv_config.kv_role,
            kv_config.shared_storage_path,
            identity.key,
        )
        # Copies into and out of the KV cache run in forward-pass order: on the forward thread when there is one.
        executor = self._executor
        ordered = (lambda fn: executor.submit(fn)) if executor is not None else (lambda fn: fn())
        return KVTransfer(
            kv_config, make_connector(kv_config, identity), self.scheduler, self.runner, ordered
        )

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest, client: int = 0) -> None:
        """Queues a request; a prompt that can never run is answered as ignored. ``client``
        tags its outputs (``OutputBatch.clients``): the engine process's frontend index.

        The request gate (``fastsched.request_gate``) has judged the request; what stays here is
        the engine process's own guard at its socket, with the gate's check functions: a token id
        outside the vocabulary would fail the embedding inside a step and end the engine, so a
        message carrying one is refused alone (``ValueError``), never run."""
        params = request.params
        n = len(request.prompt_token_ids)
        check_prompt(request.prompt_token_ids, params.max_tokens, self.max_model_len, self.vocab_size)
        if self.scheduler.handle_of(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            if request.streaming:
                # Input arriving between segments would go past the matcher, which sees outputs only.
                raise ValueError("structured_outputs cannot be used by a streaming-input session")
            grammar = self.structured.compile(params.structured_outputs)
        if params.prompt_logprobs is not None and (request.streaming or self.tp_group is not None):
            raise ValueError("prompt_logprobs is not implemented with streaming input or tensor parallelism")
        # A constrained request ends where its grammar does, by the EOS the grammar then forces.
        ignore_eos = params.ignore_eos and grammar is None
        eos = None if ignore_eos or not self.eos_token_ids else self.eos_token_ids[0]
        lora_id = self._lora_id(request)
        stop_ids = list(params.stop_token_ids or [])
        if not ignore_eos:
            stop_ids += [t for t in self.eos_token_ids[1:] if t not in stop_ids]
        handle = self.scheduler.add_request(
            request.request_id,
            request.prompt_token_ids,
            params.max_tokens,
            min_tokens=params.min_tokens,
            eos_token_id=eos,
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
            priority=request.priority,
            arrival_time=request.arrival_time,
            lora_id=lora_id,
            streaming=request.streaming,
            cache_salt=request.cache_salt,
            skip_reading_prefix_cache=bool(params.skip_reading_prefix_cache),
        )
        self._outputs.add_request(handle, request, client, lora_id)
        if lora_id is not None and self.lora is not None:
            self.lora.acquire(lora_id)  # its CPU copy stays until the request ends (_prepare)
        generator = make_generator(params.seed, self.runner.device) if params.seed is not None else None
        eos_ids = () if ignore_eos else self.eos_token_ids
        self._row_states[handle] = RowState(params, n, eos_ids, generator)
        if grammar is not None:
            self.structured.add(handle, grammar)
        self.stats.on_arrival(n)
        if self.kv_transfer is not None:
            self.kv_transfer.on_add(handle, lora_id)

    def _lora_id(self, request: EngineCoreRequest) -> int | None:
        """The scheduler's id of the request's adapter (S7, S8), registered (and read from
        disk) the first time it is seen; None for the base model."""
        lora = request.lora_request
        if lora is None:
            return None
        if self.lora is None:
            raise ValueError(
                f"request {request.request_id!r} names LoRA adapter {lora.name!r} but the engine was "
                "started without enable_lora"
            )
        self.lora.register(lora)
        return lora.id

    def lora_adapters_of(self, handles: Sequence[int]) -> list[str]:
        """The names of the adapters the requests ``handles`` use, sorted (vLLM's
        lora_requests_info labels)."""
        if self.lora is None or not len(handles):
            return []
        ids = np.unique(self._columns.lora_id[np.asarray(handles, dtype=np.int64)])
        return sorted(self.lora.name_of(int(i)) for i in ids if i > 0)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' blocks at once (S18); unknown or finished ids are ignored.
        A step in flight that holds one of them still runs, but its token for it is dropped."""
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)

    def add_stream_input(
        self, request_id: str, token_ids: Sequence[int], max_tokens: int, is_last: bool = False
    ) -> None:
        """S15: a streaming session's next segment: ``token_ids`` then up to ``max_tokens``
        generated tokens. ``ValueError`` naming the value for a token id outside the vocabulary,
        an empty input, or input the scheduler refuses (not an open session, growth past
        ``max_model_len``); ``KeyError`` for an id the engine does not hold."""
        if not token_ids:
            raise ValueError(f"session {request_id!r}: stream input must hold at least one token")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"session {request_id!r}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        handle = self.scheduler.handle_of(request_id)
        if handle is None:
            raise KeyError(f"no live request {request_id!r}")
        if any(np.count_nonzero(step.so.req_handles == handle) for step in self._in_flight):
            # Async scheduling: a step launched before the segment ended still holds the
            # session's (dropped) token; input given before that step is collected would
            # let the scheduler take that token as the new segment's. Applied once it is.
            self._deferred_inputs.append((request_id, list(token_ids), max_tokens, is_last))
            return
        self._apply_stream_input(request_id, token_ids, max_tokens, is_last)

    def _apply_stream_input(
        self, request_id: str, token_ids: Sequence[int], max_tokens: int, is_last: bool
    ) -> None:
        self.scheduler.add_stream_input(request_id, token_ids, max_tokens, is_last)

    def _apply_deferred_inputs(self) -> None:
        """Stream input held back by ``add_stream_input`` whose session no step in flight holds now.
        The frontend checked it, so a refusal here means the session has ended meanwhile."""
        if not self._deferred_inputs:
            return
        held = np.concatenate([step.so.req_handles for step in self._in_flight]) if self._in_flight else None
        waiting = []
        for entry in self._deferred_inputs:
            handle = self.scheduler.handle_of(entry[0])
            if handle is not None and held is not None and np.count_nonzero(held == handle):
                waiting.append(entry)
                continue
            try:
                self._apply_stream_input(*entry)
            except (KeyError, ValueError) as e:
                logger.warning("stream input for %s dropped: %s", entry[0], e)
        self._deferred_inputs = waiting

    def client_of(self, request_id: str) -> int | None:
        """The frontend a live request came from (``add_request``'s ``client``), else None."""
        handle = self.scheduler.handle_of(request_id)
        return None if handle is None else int(self._columns.client[handle])

    def close_stream(self, request_id: str) -> EngineCoreOutput | None:
        """S15: ends a session once its input is served; unknown or finished ids are ignored.
        A session waiting for input ends at once, which no step reports: its final output
        (finish reason ``stop``, no tokens) is returned instead. A session still generating
        ends with its segment, in that step's outputs."""
        handle = self.scheduler.handle_of(request_id)
        if handle is None:
            return None
        waiting = self.scheduler.request_info(handle)["status"] == "waiting_for_streaming_req"
        self.scheduler.close_stream(request_id)
        return EngineCoreOutput(request_id, [], "stop") if waiting else None

    def pause(self, mode: str) -> None:
        """S13: ``"new"`` lets running requests finish and admits nobody; ``"all"`` schedules
        nothing, every request keeping its place and KV. ``ValueError`` for another mode."""
        self.set_pause_state(pause_state(mode))

    def resume(self) -> None:
        """S13: schedules again from where the pause stopped."""
        self.set_pause_state("unpaused")

    def reload_weights(self, model: str) -> None:
        """Loads the weights of ``model`` (a checkpoint of the served architecture) into the
        running model and drops the prefix cache, whose KV they make stale: the RL use of S13,
        new weights between rollouts. Only while paused with mode ``all`` (:class:`NotPausedError`
        otherwise): no step runs meanwhile. Requests held by the pause keep their KV, computed
        with the old weights. With tensor parallelism every rank loads its own shards, and all
        swap them in or none does (``fastsched.worker.weight_reload``). ``ValueError`` with the
        cause when any rank cannot load or fit the checkpoint (the old weights stay), or with a
        KV connector (its store would serve KV of the old weights)."""
        if self.config.kv_transfer_config is not None:
            raise ValueError(
                "weights cannot be reloaded with --kv-transfer-config: the KV store's blocks, keyed "
                "by the served model, were computed with the old weights"
            )
        if self.pause_state != "paused_all":
            raise NotPausedError(
                f"weights can be reloaded only while paused with mode all; the engine is {self.pause_state}"
            )
        group = self.tp_group
        if group is not None:
            group.channel.send_reload(model)  # the other ranks load their shards meanwhile
        config, tp = self.config, None if group is None else group.tp
        new, error = load_checked(
            model,
            self.runner.model,
            dtype=config.torch_dtype,
            device=config.torch_device,
            quantization=config.resolved_quantization,
            tp=tp,
        )
        failed = swap_in(self.runner.model, new, error, None if group is None else group.channel)
        if failed is not None:
            raise ValueError(f"the weights of {model} were not loaded, the served ones stay: {failed}")
        self.scheduler.reset_prefix_cache()
        logger.info("reloaded weights from %s; prefix cache dropped", model)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (vLLM's ``reset_prefix_cache``): later prompts are
        computed afresh, e.g. between benchmark runs. Requests in flight keep their blocks."""
        self.scheduler.reset_prefix_cache()
        logger.info("prefix cache reset")

    def set_pause_state(self, state: PauseState) -> None:
        """The scheduler's pause state (``unpaused``, ``paused_new``, ``paused_all``)."""
        self.scheduler.set_pause_state(state)

    @property
    def pause_state(self) -> PauseState:
        """The pause state in force (S13), as the scheduler holds it."""
        return self.scheduler.pause_state

    def request_times(self, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival, first scheduled, first token) wall-clock times of the requests ``handles``,
        which the engine still holds (live, or finished in the last step; an ``OutputBatch``'s
        ``handles``); NaN where not known yet."""
        handles = np.asarray(handles, dtype=np.uint32)
        c = self._columns
        return (
            self.scheduler.arrival_times(handles),
            c.first_scheduled_time[handles],
            c.first_token_time[handles],
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or bool(self._deferred_inputs) or self.scheduler.has_requests()

    @property
    def num_steps_in_flight(self) -> int:
        """Steps scheduled and not yet collected: with async scheduling, 1 between two
        ``step()`` calls while requests run (its forward pass may be running); else 0."""
        return len(self._in_flight)

    def shutdown(self) -> None:
        """Stops the forward-pass thread (async scheduling) and tensor-parallel workers, and
        writes out the step trace (the engine process skips finalizers); not used after."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.step_tracer is not None:
            self.step_tracer.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self.tp_group is not None:
            self.tp_group.stop()

    def check_workers(self) -> None:
        """Raises ``RuntimeError`` once a tensor-parallel worker has died: the engine ends with it."""
        if self.tp_group is not None:
            self.tp_group.check()

    # ------------------------------------------------------------ the step

    def step(self) -> OutputBatch:
        """Collects one forward pass; returns the deltas of every request that progressed or ended.

        Synchronous: schedules a step, runs it, collects it. Async: also schedules and
        launches the next step before collecting this one, so that one step is always in
        flight between calls while requests remain; the first call collects the step it
        launched itself.
        """
        if not self._in_flight:
            if not self.scheduler.has_requests():
                return OutputBatch.empty()
            self._launch()
        # Only when a request will still run once the steps in flight land: the next step
        # would otherwise be a forward pass whose every token is dropped (the scheduler's call).
        if self._executor is not None and self.scheduler.runs_after_in_flight():
            self._launch()
        return self._collect_oldest()

    def _launch(self) -> None:
        """Schedules a step, prepares its inputs and starts its forward pass (on the worker thread)."""
        launched, launched_wall = time.perf_counter(), time.time()
        if self.kv_transfer is not None:
            self.kv_transfer.before_schedule()
        so = self.scheduler.schedule()
        try:
            step = self._prepare(so, launched, launched_wall, first_in_flight=not self._in_flight)
            if self.kv_transfer is not None:
                step.saves = self.kv_transfer.after_schedule()
                if step.saves is not None and self._executor is not None:
                    # After this step's forward pass, before the next one's (which may reuse the blocks).
                    self._executor.submit(self.kv_transfer.save, step.saves)
                    step.saves = None
        except BaseException:
            # The scheduler holds the step in flight: close it (and those before it) too.
            self._in_flight.append(_Step(so, None, None, launched, launched_wall, False, _NO_ROWS))
            self._abandon_in_flight()
            raise
        self._in_flight.append(step)

    def _prepare(
        self, so: _core.SchedulerOutput, launched: float, launched_wall: float, first_in_flight: bool
    ) -> _Step:
        backlogged = self.scheduler.num_waiting > 0
        c = self._columns
        self.structured.remove(so.finished)
        for h in so.finished.tolist():
            # Reported finished (or aborted): the handle may be reused after this step.
            if self._row_states.pop(h, None) is not None:
                self._outputs.num_final_only -= bool(c.final_only[h])
                if c.lora_id[h] and self.lora is not None:
                    self.lora.release(int(c.lora_id[h]))
        # Read now: a request aborted before this step is collected leaves the scheduler then.
        prompt_lens = self.scheduler.num_prompt_tokens(so.req_handles)
        if np.count_nonzero(so.kinds):
            c.first_scheduled_time[so.req_handles[so.kinds == KIND_NEW]] = launched_wall
        prepared = self.runner.prepare(so, self.scheduler.token_ids, self._row_states.__getitem__)
        self._outputs.plan_step(so, prompt_lens, prepared)
        # Its token bitmask needs the tokens of the step before it: now, or once that one is collected.
        prepared.bitmask = self.structured.step_bitmask(prepared.sampled_handles, fill_now=first_in_flight)
        if self.lora is not None and len(so):
            prepared.lora = self.lora.plan(c.lora_id[so.req_handles], so.num_scheduled_tokens)
        future = None
        if self._executor is not None and prepared.num_reqs:
            future = self._executor.submit(self.runner.execute, prepared)
        return _Step(so, prepared, future, launched, launched_wall, backlogged, prompt_lens)

    def _collect_oldest(self) -> OutputBatch:
        step = self._in_flight[0]
        try:
            assert step.prepared is not None, "a step whose preparation failed is never collected"
            executed = step.future.result() if step.future is not None else self.runner.execute(step.prepared)
            result = self.runner.fetch(executed)
        except BaseException:
            self._abandon_in_flight()
            self.check_workers()  # a failed tensor-parallel worker is the cause, not the collective's error
            raise
        self._in_flight.popleft()
        if step.saves is not None and self.kv_transfer is not None:
            self.kv_transfer.save(step.saves)
        if self.proposer is None:
            eco = self.scheduler.update_from_tokens(result.tokens)
            self._apply_deferred_inputs()
            self.runner.write_sampled(step.prepared, result)
        else:
            eco = self._update_speculative(step, result)
            self._apply_deferred_inputs()
        following = self._in_flight[0].prepared if self._in_flight else None
        self.structured.advance(eco, following.bitmask if following is not None else None)
        outputs = self._outputs.collect(eco, step.so, result)
        self.stats.on_step(len(eco.token_ids), self.scheduler.stats)
        so = step.so
        self.stats.on_iteration(so.total_num_scheduled_tokens)
        prompt_lens = step.prompt_lens
        prefill, partial = prefill_tokens(so.num_scheduled_tokens, so.num_computed_tokens, prompt_lens)
        # A step lasts from its launch, or from the end of the step before it when that
        # came later (async: it was launched while that one ran), to its collection.
        end, end_wall = time.perf_counter(), time.time()
        duration = end - max(step.launched, self._last_step_end)
        self.prefill_meter.observe(prefill, duration, step.backlogged or partial)
        self.step_time_meter.observe(so.total_num_scheduled_tokens, duration)
        if self.step_tracer is not None:
            start = max(step.launched_wall, self._last_step_end_wall)
            self.step_tracer.on_step(StepShape.of(so, prompt_lens), start, end_wall)
        self._last_step_end, self._last_step_end_wall = end, end_wall
        return outputs

    def _update_speculative(self, step: _Step, result: StepResult) -> _core.EngineCoreOutputs:
        """Speculative decoding: the step's tokens (accepted drafts and the target's own), then
        the next step's drafts for the requests still running, proposed from the sequences
        those tokens extend (as vLLM's ``post_step``). Requests that ask for logprobs get no
        drafts (one token, one logprobs entry per step), nor do constrained ones (structured
        outputs: one grammar step, one token bitmask per step)."""
        so, prepared = step.so, step.prepared
        assert prepared is not None
        tokens, offsets = result.tokens, result.token_offsets
        if offsets is None:  # nothing verified: at most one token per request
            got = tokens >= 0
            offsets = np.zeros(len(so) + 1, dtype=np.int64)
            np.cumsum(got, out=offsets[1:])
            tokens = tokens[got]
        self.runner.write_sampled(prepared, result)
        if prepared.spec is not None and self.spec_counters is not None and result.num_accepted is not None:
            self.spec_counters.observe(prepared.spec.num_real_drafts, result.num_accepted)
        eco = self.scheduler.update_from_output(offsets.astype(np.uint32), tokens.astype(np.uint32))
        handles = so.req_handles[result.sampled_positions]
        drafting = (self._columns.logprobs[handles] < 0) & ~np.isin(
            handles, eco.handles[eco.finish_reasons != 0]
        )
        if self.structured.num_constrained:
            drafting &= ~self.structured._is_constrained(handles)
        handles = handles[drafting]
        drafts = self.proposer.propose(self.runner.token_sequences(handles))
        self.scheduler.update_draft_token_ids(handles, *draft_rows(drafts))
        return eco

    def _abandon_in_flight(self) -> None:
        """A step failed (a runner error, Ctrl-C): its KV and that of the step after it
        were not (fully) computed, so their requests cannot go on. Aborts them and closes
        the steps so that the engine stays usable. The runner's rows of those requests are
        given up at the next schedule(), which reports the aborts."""
        steps = list(self._in_flight)
        self._in_flight.clear()
        for s in steps:
            if s.prepared is not None and s.prepared.bitmask is not None:
                s.prepared.bitmask.abandon()
        for s in steps:
            if s.future is not None:
                try:
                    s.future.result()  # let the worker finish before the next step is run
                except BaseException:
                    pass
        handles = np.unique(np.concatenate([s.so.req_handles for s in steps]))
        self.abort_requests(self.scheduler.request_ids(handles))
        for s in steps:
            self.scheduler.update_from_tokens(np.full(len(s.so), -1, dtype=np.int64))
            if s.prepared is not None:
                self.runner.abandon(s.prepared)
        if self.lora is not None:
            self.lora.forget_slots()  # a failed step may have planned copies it never made
