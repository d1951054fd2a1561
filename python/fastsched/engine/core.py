"""EngineCore: the busy loop schedule -> execute -> update_from_output -> outputs.

It owns the model runner and the Rust scheduler and speaks in token ids only;
text (detokenization, stop strings, ``n`` fan-out) is the output processor's
job, in the frontend or in ``fastsched.LLM``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastsched import _core
from fastsched.attention import select_backend
from fastsched.config import EngineConfig
from fastsched.engine.prefill_meter import PrefillThroughputMeter, prefill_tokens
from fastsched.engine.protocol import FINISH_REASONS, EngineCoreOutput, EngineCoreRequest
from fastsched.engine.stats import StatsLogger
from fastsched.engine.step_trace import StepShape, StepTracer
from fastsched.inputs import check_prompt
from fastsched.model_loader import load_model_config, load_tokenizer
from fastsched.model_loader.weights import load_model
from fastsched.models.config import ModelConfig
from fastsched.sample import LogprobsTensors, make_generator
from fastsched.worker.kv_sizing import determine_num_blocks, profile_peak_bytes
from fastsched.worker.model_runner import ModelRunner, RowState, StepResult

logger = logging.getLogger(__name__)

@dataclass
class _Request:
    """The engine's record of a live request, keyed by its scheduler handle."""

    core: EngineCoreRequest
    output_token_ids: list[int]
    row: RowState
    num_cached_tokens: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        self.model_config: ModelConfig = load_model_config(config.model)
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_position_embeddings)
        if self.model_config.sliding_window and self.max_model_len > self.model_config.sliding_window:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's sliding_window "
                f"({self.model_config.sliding_window}), which no attention backend implements"
            )
        logger.info("loading model %s (%s, %s)", config.model or "SmolLM2-135M-Instruct (embedded)", dtype, device)
        model = load_model(config.model, dtype=dtype, device=device)
        backend = select_backend(device, config.attention_backend)
        peak = 0
        if device.type == "cuda" and config.num_gpu_blocks is None:
            peak = profile_peak_bytes(model, backend, config, dtype, device, self.max_model_len)
        num_blocks = determine_num_blocks(config, self.model_config, dtype, device, self.max_model_len, peak)
        self.scheduler = _core.Scheduler(config.scheduler_config(self.max_model_len, num_blocks))
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
        )
        # The tokenizer may add an end-of-turn id (GGUF chat models) to the model's EOS ids.
        tokenizer_eos = load_tokenizer(config.tokenizer or config.model).eos_token_ids
        self.eos_token_ids = tuple(dict.fromkeys((*self.model_config.eos_token_ids, *tokenizer_eos)))
        self.vocab_size = self.model_config.vocab_size
        self._requests: dict[int, _Request] = {}
        self._handles: dict[str, int] = {}
        self.stats = StatsLogger(config.log_stats_interval)
        self.step_tracer = StepTracer(config.step_trace) if config.step_trace else None  # --step-trace
        self.prefill_meter = PrefillThroughputMeter()  # read by the TTFT-SLO valve (--ttft-slo)
        sc = self.scheduler.config
        logger.info(
            "attention backend: %s; scheduler: policy=%s max_num_seqs=%d max_num_active_seqs=%d "
            "max_num_batched_tokens=%d max_model_len=%d block_size=%d prefix_caching=%s",
            backend.name, sc.policy, sc.max_num_seqs, sc.max_num_active_seqs, sc.max_num_batched_tokens,
            sc.max_model_len, sc.block_size, sc.enable_prefix_caching,
        )

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request; a prompt that can never run is answered as ignored."""
        params = request.params
        n = len(request.prompt_token_ids)
        check_prompt(request.prompt_token_ids, params.max_tokens, self.max_model_len, self.vocab_size)
        if request.request_id in self._handles:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        eos = None if params.ignore_eos or not self.eos_token_ids else self.eos_token_ids[0]
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in self.eos_token_ids[1:] if t not in stop_ids]
        handle = self.scheduler.add_request(
            request.request_id,
            request.prompt_token_ids,
            params.max_tokens,
            min_tokens=params.min_tokens,
            eos_token_id=eos,
            stop_token_ids=stop_ids,
            ignore_eos=params.ignore_eos,
            priority=request.priority,
            arrival_time=request.arrival_time,
        )
        outputs: list[int] = []
        generator = make_generator(params.seed, self.runner.device) if params.seed is not None else None
        row = RowState(params, request.prompt_token_ids, outputs, () if params.ignore_eos else self.eos_token_ids, generator)
        self._requests[handle] = _Request(request, outputs, row)
        self._handles[request.request_id] = handle
        self.stats.on_arrival(n)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' blocks at once (S18); unknown or finished ids are ignored."""
        for request_id in request_ids:
            if self.scheduler.abort_request(request_id) is not None:
                self._handles.pop(request_id, None)

    def request_times(self, request_id: str) -> tuple[float, float | None, float | None] | None:
        """(arrival, first scheduled, first token) wall-clock times of a request the engine
        still holds (live, or finished in the last step); None otherwise."""
        handle = self._handles.get(request_id)
        record = self._requests.get(handle) if handle is not None else None
        if record is None:
            return None
        return record.core.arrival_time, record.first_scheduled_time, record.first_token_time

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    # ------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """One forward pass; returns the deltas of every request that progressed or ended."""
        if not self.scheduler.has_requests():
            return []
        now = time.time()
        started = time.perf_counter()
        so = self.scheduler.schedule()
        backlogged = self.scheduler.num_waiting > 0
        for h in so.finished.tolist():
            record = self._requests.pop(h, None)
            if record is not None:
                self._handles.pop(record.core.request_id, None)
        handles = so.req_handles.tolist()
        prompt_lens = []
        for h in handles:
            record = self._requests[h]
            prompt_lens.append(len(record.core.prompt_token_ids))
            if record.first_scheduled_time is None:
                record.first_scheduled_time = now
        try:
            result = self.runner.execute(so, self._tokens_of, self._row_state_of)
        except BaseException:
            # The step's KV was not (fully) computed: its requests cannot go on.
            # Abort them and close the step so the engine stays usable.
            self.abort_requests([self._requests[h].core.request_id for h in handles])
            self.scheduler.update_from_tokens(np.full(len(handles), -1, dtype=np.int64))
            raise
        eco = self.scheduler.update_from_tokens(result.tokens)
        outputs = self._collect(eco, result, handles)
        self.stats.on_step(outputs, self.scheduler.stats)
        self.stats.on_iteration(so.total_num_scheduled_tokens)
        prefill, partial = prefill_tokens(so.num_scheduled_tokens, so.num_computed_tokens, prompt_lens)
        self.prefill_meter.observe(prefill, time.perf_counter() - started, backlogged or partial)
        if self.step_tracer is not None:
            self._trace_step(self.step_tracer, so, prompt_lens, now)
        return outputs

    def _trace_step(self, tracer: StepTracer, so: _core.SchedulerOutput, prompt_lens: list[int],
                    start: float) -> None:
        """--step-trace: the step's shape and the time since ``start`` (see fastsched.engine.step_trace)."""
        end = time.time()
        tracer.on_step(StepShape.of(so, np.asarray(prompt_lens, dtype=np.int64)), start, end)

    def _tokens_of(self, handle: int) -> list[int]:
        record = self._requests[handle]
        return record.core.prompt_token_ids + record.output_token_ids

    def _row_state_of(self, handle: int) -> RowState:
        return self._requests[handle].row

    def _collect(self, eco: _core.EngineCoreOutputs, result: StepResult, handles: list[int]) -> list[EngineCoreOutput]:
        logprobs_at: dict[int, int] = {}
        if result.logprobs is not None:
            logprobs_at = {handles[i]: j for j, i in enumerate(result.sampled_positions.tolist())}
        outputs = []
        offsets = eco.token_offsets.tolist()
        token_ids = eco.token_ids.tolist()
        for i, (h, reason) in enumerate(zip(eco.handles.tolist(), eco.finish_reasons.tolist())):
            record = self._requests[h]
            new = token_ids[offsets[i] : offsets[i + 1]]
            record.output_token_ids.extend(new)
            out = EngineCoreOutput(record.core.request_id, new, FINISH_REASONS.get(reason))
            cached = int(eco.num_cached_tokens[i])
            if cached >= 0 and record.num_cached_tokens is None:
                record.num_cached_tokens = cached
                out.num_cached_tokens = cached
            if new and record.first_token_time is None:
                record.first_token_time = time.time()
            if out.finish_reason == "stop" and new and new[-1] not in self.eos_token_ids:
                out.stop_reason = new[-1]
            if out.finish_reason == "ignored":
                out.error = self.scheduler.ignore_reason(h)
            if new and record.core.params.logprobs is not None and h in logprobs_at:
                j, k = logprobs_at[h], record.core.params.logprobs
                out.new_logprobs = [_row_logprobs(result.logprobs, j, new[0], k)]
            outputs.append(out)
        return outputs


def _row_logprobs(lp: LogprobsTensors, j: int, token: int, k: int) -> dict[int, tuple[float, int]]:
    """Sampled row ``j``: its token's (logprob, rank) plus the ``k`` most likely tokens'."""
    row = {token: (float(lp.sampled_logprobs[j]), int(lp.sampled_ranks[j]))}
    ids = lp.topk_token_ids[j, :k].tolist()
    values = lp.topk_logprobs[j, :k].tolist()
    for rank, (t, v) in enumerate(zip(ids, values), start=1):
        row.setdefault(t, (v, rank))
    return row
