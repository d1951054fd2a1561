"""Executes the scheduler's decision: one forward pass over a flattened, mixed batch.

The scheduler (Rust) decides which requests compute how many tokens; the runner
turns its arrays into the model's inputs (token ids, positions, KV slot mapping,
block tables, sampling parameters) with numpy gathers, runs the model once over all
of them, computes logits only for requests whose prompt is complete, and samples one
token each. Preparing (host) and executing (forward pass and sampling) are separate
calls so that the engine can prepare step N+1 while step N executes (async scheduling).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastsched._core import SchedulerOutput
from fastsched.attention import AttentionBackend, AttentionMetadata
from fastsched.distributed.step_channel import READ_BLOCKS, WRITE_BLOCKS, StepChannel, StepInputs
from fastsched.lora.slots import LoRAManager, LoRAMapping
from fastsched.models.config import ModelConfig
from fastsched.sample import LogprobsTensors, Sampler, SamplingMetadata, TokenHistories, to_device
from fastsched.sample.prompt_logprobs import (
    LogprobsTap,
    PromptLogprobsPlan,
    ScoredPrompts,
    compute_prompt_logprobs,
)
from fastsched.spec_decode import SpecStep, rejection_sample, verification_logprobs
from fastsched.structured.bitmask import StepBitmask
from fastsched.worker.input_batch import InputBatch, Reservation, RowState
from fastsched.worker.kv_blocks import BlockShards, read_blocks, write_blocks

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One sampled token per scheduled request (-1 for a partial prefill), and logprobs.
    A step that verified drafts gives several per request instead, as CSR rows."""

    tokens: np.ndarray  # [num_scheduled] int64; with token_offsets, the rows' tokens one after the other
    sampled_positions: np.ndarray  # indices into the scheduled requests that sampled
    logprobs: LogprobsTensors | None  # rows aligned with sampled_positions, on the CPU
    token_offsets: np.ndarray | None = None  # [num_scheduled + 1] (speculative steps)
    num_accepted: np.ndarray | None = None  # drafts accepted per sampled request (speculative steps)
    pooled: dict[int, np.ndarray] | None = None  # handle -> embedding, of the step's pooling requests
    prompt_logprobs: ScoredPrompts | None = None  # the rows of PreparedStep.prompt_logprobs scored


@dataclass
class PreparedStep:
    """One step's model inputs, built on the host from the scheduler's arrays (:meth:`ModelRunner.prepare`).

    Everything here belongs to the step alone, so a worker thread can run its forward
    pass while the host prepares the next one."""

    num_reqs: int
    input_ids: np.ndarray  # [T] int64; placeholders (see below) hold stale values
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    sampled_positions: np.ndarray  # scheduled requests that sample a token, in order
    sampled_handles: np.ndarray  # their handles
    logits_indices: np.ndarray | None  # their last tokens in the flat batch; None: every token
    reservation: Reservation  # where each sampled token goes in its row
    sampling: SamplingMetadata | None  # None when no request samples
    # Async scheduling: input tokens sampled by the previous step, not known when this
    # step was prepared: input_ids[placeholder_dst] = previous sampled[placeholder_src].
    placeholder_dst: np.ndarray
    placeholder_src: np.ndarray
    # ... and the same tokens for the penalties' histories: sampling row, previous index.
    penalty_rows: np.ndarray
    penalty_src: np.ndarray
    spec: SpecStep | None = None  # the drafts this step verifies (speculative decoding)
    # Structured outputs: the constrained rows' token bitmask, set by the engine after prepare().
    bitmask: StepBitmask | None = None
    lora: LoRAMapping | None = None  # the step's adapters (the engine plans them); None: base model only
    # Pooling requests (embeddings) whose prompt this step completes, set by the engine after prepare():
    # the flat index of each one's last prompt token, and its handle.
    pool_tokens: np.ndarray | None = None
    pool_handles: np.ndarray | None = None
    # The rows that score prompt tokens (prompt_logprobs; the engine plans them); None: no row does.
    prompt_logprobs: PromptLogprobsPlan | None = None


@dataclass
class ExecutedStep:
    """A step whose forward pass and sampling were issued (:meth:`ModelRunner.execute`)."""

    step: PreparedStep
    sampled: torch.Tensor | None  # [num sampled] int64 on the host (copy in flight until ``ready``)
    logprobs: LogprobsTensors | None  # likewise
    ready: torch.cuda.Event | None  # None on the CPU: the results are there already
    num_sampled: torch.Tensor | None = None  # tokens per sampled request when drafts were verified
    pooled: torch.Tensor | None = None  # [len(step.pool_tokens), hidden] float32 (copied as ``sampled``)
    prompt_logprobs: ScoredPrompts | None = None  # on the CPU already


_EMPTY = np.zeros(0, dtype=np.int64)


def _array_to(device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    """numpy -> tensor on ``device``: on the CPU the array itself, without a copy (a step's
    arrays are its own); to a GPU through :func:`to_device`."""
    if device.type == "cpu":
        return torch.from_numpy
    return lambda a: to_device(torch.from_numpy(a), device)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    """Prepares steps on the host (:meth:`prepare`, :meth:`write_sampled`), runs them
    (:meth:`execute`) and gets their results (:meth:`fetch`). ``execute`` touches only
    the step's own inputs, the model, the KV cache and the sampled tokens of the step it
    ran before, so it may run on a worker thread while the host prepares the next step;
    steps must be executed in the order they were prepared."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        lora: LoRAManager | None = None,
        step_channel: StepChannel | None = None,
    ) -> None:
        self.model = model
        # Tensor parallelism: each step's inputs go to the other ranks before its forward pass.
        self.step_channel = step_channel
        self.lora = lora
        self.config: ModelConfig = model.config
        self.block_shards = (
            None if step_channel is None else BlockShards(step_channel.tp, self.config, block_size, dtype)
        )
        self.backend = backend
        self.device = device
        self.block_size = block_size
        cfg = self.config
        # Uninitialised on purpose: attention only reads slots it has written.
        self.kv_caches = [
            torch.empty(
                2,
                num_blocks,
                block_size,
                getattr(model, "num_local_kv_heads", cfg.num_kv_heads),
                cfg.head_dim,
                dtype=dtype,
                device=device,
            )
            for _ in range(cfg.num_layers)
        ]
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, cfg.vocab_size)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)
        self._on_device = _array_to(device)
        # The tokens sampled by the last step executed, on the device: the next step's placeholders.
        self._last_sampled = torch.zeros(0, dtype=torch.int64, device=device)
        self.prompt_logprobs_tap: LogprobsTap | None = None  # see fastsched.sample.prompt_logprobs

    def read_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        """Whole KV blocks, copied to the CPU: [n, layers, 2 (K, V), block_size, kv_heads, head_dim]
        (what a KV connector saves); with tensor parallelism, every rank's heads gathered here."""
        if self.block_shards is None:
            return read_blocks(self.kv_caches, block_ids)
        assert self.step_channel is not None
        with self.step_channel.waiting():
            self.step_channel.send_command(READ_BLOCKS, block_ids)
            whole = self.block_shards.gather(read_blocks(self.kv_caches, block_ids))
        assert whole is not None
        return whole

    def write_blocks(self, block_ids: np.ndarray, blocks: torch.Tensor) -> None:
        """Fills KV blocks with ``blocks`` as :meth:`read_blocks` returns them (a KV connector's load)."""
        if self.block_shards is not None:
            assert self.step_channel is not None
            with self.step_channel.waiting():
                self.step_channel.send_command(WRITE_BLOCKS, block_ids)
                blocks = self.block_shards.scatter(blocks, len(block_ids))
        write_blocks(self.kv_caches, block_ids, blocks)

    def prepare(
        self,
        so: SchedulerOutput,
        tokens_of: Callable[[int], np.ndarray],
        row_state_of: Callable[[int], RowState],
    ) -> PreparedStep:
        """Applies the scheduler's decision to the batch and builds the step's inputs (host only)."""
        batch = self.batch
        batch.release(so.finished)
        batch.release(so.preempted)
        n_reqs = len(so)
        rows = batch.update(so, tokens_of, row_state_of) if n_reqs else _EMPTY
        computed = so.num_computed_tokens.astype(np.int64)
        total = so.total_num_scheduled_tokens
        has_drafts = n_reqs and np.count_nonzero(so.num_spec_tokens)
        if has_drafts:
            self._write_drafts(so, rows, computed)
        if total == n_reqs:
            # One token per request (decodes, the common step): no per-token expansion.
            token_rows, positions = rows, computed
            query_start = np.arange(n_reqs + 1, dtype=np.int32)
            seq_lens = computed + 1
            max_query_len = 1 if n_reqs else 0
        else:
            num_sched = so.num_scheduled_tokens.astype(np.int64)
            starts = np.zeros(n_reqs + 1, dtype=np.int64)
            np.cumsum(num_sched, out=starts[1:])
            req_of_token = np.repeat(np.arange(n_reqs), num_sched)
            token_rows = rows[req_of_token]
            positions = np.arange(total) - (starts[:-1] - computed)[req_of_token]
            query_start = starts.astype(np.int32)
            seq_lens = computed + num_sched
            max_query_len = int(num_sched.max())
        max_model_len = batch.token_ids.shape[1]
        input_ids = batch.token_ids.reshape(-1).take(token_rows * max_model_len + positions)
        placeholder_dst = placeholder_src = _EMPTY
        if batch.num_unwritten_steps:
            placeholder_dst = np.flatnonzero(batch.pending_pos[token_rows] == positions)
            placeholder_src = batch.pending_index[token_rows[placeholder_dst]]
        bs = self.block_size
        table = batch.block_table
        slots = table.reshape(-1).take(token_rows * table.shape[1] + positions // bs).astype(np.int64) * bs
        slots += positions % bs
        max_seq_len = int(seq_lens.max(initial=0))
        max_blocks = -(-max_seq_len // bs)

        # Only requests whose prompt is now complete produce a token, prefill-only ones none (S20).
        sampled_positions = np.flatnonzero((seq_lens >= batch.num_tokens[rows]) & ~batch.prefill_only[rows])
        sampled_rows = rows[sampled_positions]
        sampling = None
        penalty_rows = penalty_src = _EMPTY
        spec = logits_indices = None
        if len(sampled_positions) != total:
            logits_indices = query_start[1:][sampled_positions] - 1
        if has_drafts:
            spec = SpecStep.of(so, sampled_positions, rows=sampled_rows)
            logits_indices = spec.logits_indices(query_start[1:][sampled_positions])
            sampling = self._verification_sampling(sampled_rows, spec)
        elif len(sampled_rows):
            # Host tensors: execute() moves them, so that this thread never waits for the device.
            sampling = batch.sampling.gather(
                sampled_rows,
                lambda: batch.num_tokens[sampled_rows] - batch.num_prompt_tokens[sampled_rows],
                self._history(sampled_rows),
            )
            if sampling.penalties is not None and batch.num_unwritten_steps:
                pending = batch.pending_pos[sampled_rows] >= 0
                penalty_rows = np.flatnonzero(pending & batch.sampling.penalized[sampled_rows])
                penalty_src = batch.pending_index[sampled_rows[penalty_rows]]
        return PreparedStep(
            num_reqs=n_reqs,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=query_start,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=table[rows, :max_blocks],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sampled_positions=sampled_positions,
            sampled_handles=so.req_handles[sampled_positions],
            logits_indices=logits_indices,
            reservation=batch.reserve(sampled_rows),
            sampling=sampling,
            placeholder_dst=placeholder_dst,
            placeholder_src=placeholder_src,
            penalty_rows=penalty_rows,
            penalty_src=penalty_src,
            spec=spec,
        )

    def _write_drafts(self, so: SchedulerOutput, rows: np.ndarray, computed: np.ndarray) -> None:
        """Puts the drafts a step verifies after each row's real tokens, as its inputs (speculative
        decoding, never with async scheduling). Past ``num_tokens`` they are scratch: only the
        accepted ones become the row's tokens (:meth:`write_sampled`). A ``-1`` placeholder
        is fed as token 0; it is never accepted."""
        num_spec = so.num_spec_tokens.astype(np.int64)
        first = computed + so.num_scheduled_tokens - num_spec  # the first draft's position
        within = np.arange(int(num_spec.sum())) - np.repeat(np.cumsum(num_spec) - num_spec, num_spec)
        positions = np.repeat(first, num_spec) + within
        self.batch.token_ids[np.repeat(rows, num_spec), positions] = np.maximum(so.spec_token_ids, 0)

    def _verification_sampling(self, sampled_rows: np.ndarray, spec: SpecStep) -> SamplingMetadata:
        """Sampling metadata with one row per verified position: position ``j`` of a request
        has its ``j`` drafts before it in its output (penalties and ``min_tokens`` see them)."""
        batch = self.batch
        rows = np.repeat(sampled_rows, spec.num_positions)
        within = spec.position_in_row
        num_tokens = batch.num_tokens[rows]

        def history(used: np.ndarray) -> TokenHistories:
            end = num_tokens[used] + within[used]
            return TokenHistories(
                batch.token_ids[rows[used], : int(end.max())], batch.num_prompt_tokens[rows[used]], end
            )

        return batch.sampling.gather(
            rows, lambda: num_tokens - batch.num_prompt_tokens[rows] + within, history
        )

    def _history(self, sampled_rows: np.ndarray) -> Callable[[np.ndarray], TokenHistories]:
        """The token ids of sampled rows ``used`` for the penalties, written ones only: the
        token of a position still pending is added by execute() (async scheduling)."""
        batch = self.batch

        def history(used: np.ndarray) -> TokenHistories:
            rows = sampled_rows[used]
            pending = batch.pending_pos[rows]
            end = np.where(pending >= 0, pending, batch.num_tokens[rows])
            return TokenHistories(batch.token_ids[rows, : int(end.max())], batch.num_prompt_tokens[rows], end)

        return history

    def execute(self, step: PreparedStep) -> ExecutedStep:
        """Issues the forward pass and sampling of a prepared step; on a GPU it returns once
        they are queued, with the results' copy to the host under way (:meth:`fetch` waits
        for it), so the next step can be issued while this one runs. See the class
        docstring for threads. With tensor parallelism the hung-worker watch times it."""
        if self.step_channel is None:
            return self._execute(step)
        with self.step_channel.waiting():
            return self._execute(step)

    @torch.inference_mode()
    def _execute(self, step: PreparedStep) -> ExecutedStep:
        if step.num_reqs == 0:
            return ExecutedStep(step, None, None, None)
        on_device = self._on_device

        input_ids = on_device(step.input_ids)
        if len(step.placeholder_dst):
            input_ids[on_device(step.placeholder_dst)] = self._last_sampled[on_device(step.placeholder_src)]
        metadata = AttentionMetadata.from_host(step, on_device)
        if self.step_channel is not None:
            self.step_channel.send(
                StepInputs(
                    input_ids,
                    step.positions,
                    step.slot_mapping,
                    step.query_start_loc,
                    step.seq_lens,
                    step.block_tables,
                    step.max_query_len,
                    step.max_seq_len,
                    step.logits_indices,
                    step.sampling is not None,
                    None if step.lora is None else step.lora.wire,
                )
            )
        self.backend.prepare(metadata)
        lora = None if step.lora is None or self.lora is None else self.lora.activate(step.lora)
        hidden = self.model(
            input_ids, on_device(step.positions), self.kv_caches, metadata, self.backend, lora
        )
        pooled = None
        if step.pool_tokens is not None:
            # vLLM's pooling of a generative model served for embeddings: the last token's, L2-normalised.
            last = hidden[on_device(step.pool_tokens)].float()
            pooled = torch.nn.functional.normalize(last, dim=-1).to("cpu", non_blocking=True)
        prompt_lp = None
        if step.prompt_logprobs is not None:
            prompt_lp = compute_prompt_logprobs(
                hidden, step.prompt_logprobs, self.model.compute_logits, tap=self.prompt_logprobs_tap
            )
        executed = self._sample(step, hidden)
        executed.pooled, executed.prompt_logprobs = pooled, prompt_lp
        if pooled is not None and executed.ready is None and self.device.type != "cpu":
            # A step of prefill-only rows samples nothing (S20): the embeddings' copy needs its own event.
            executed.ready = torch.cuda.Event()
            executed.ready.record()
        return executed

    def _sample(self, step: PreparedStep, hidden: torch.Tensor) -> ExecutedStep:
        """Logits and sampling of a step whose forward pass gave ``hidden``."""
        dev = self.device
        on_device = self._on_device
        if step.sampling is None:
            return ExecutedStep(step, None, None, None)
        sampling = step.sampling if dev.type == "cpu" else step.sampling.to(dev)
        if len(step.penalty_rows):
            sampling.add_output_tokens(
                on_device(step.penalty_rows), self._last_sampled[on_device(step.penalty_src)]
            )
        if step.logits_indices is not None:
            hidden = hidden[on_device(step.logits_indices.astype(np.int64))]
        logits = self.model.compute_logits(hidden).float()
        if step.spec is not None:
            return self._verify(step, logits, sampling)
        if step.bitmask is not None:
            step.bitmask.apply(logits)
        out = self.sampler(logits, sampling)
        self._last_sampled = out.sampled_token_ids
        if dev.type == "cpu":
            return ExecutedStep(step, out.sampled_token_ids, out.logprobs, None)
        # Non-blocking copies into pinned memory, ready when the event is.
        tokens = out.sampled_token_ids.to("cpu", non_blocking=True)
        logprobs = out.logprobs
        if logprobs is not None:
            logprobs = LogprobsTensors(
                *(
                    getattr(logprobs, f.name).to("cpu", non_blocking=True)
                    for f in dataclasses.fields(logprobs)
                )
            )
        ready = torch.cuda.Event()
        ready.record()
        return ExecutedStep(step, tokens, logprobs, ready)

    def _verify(self, step: PreparedStep, logits: torch.Tensor, sampling: SamplingMetadata) -> ExecutedStep:
        """Rejection sampling of a step's drafts (speculative decoding); see :mod:`fastsched.spec_decode`."""
        spec = step.spec
        assert spec is not None
        on_device = self._on_device
        if step.bitmask is not None:
            # Constrained requests get no drafts (at most -1 placeholders, never accepted): only
            # their first position can emit a token, so their mask applies there.
            first = on_device(spec.first_positions)
            masked = logits[first]
            step.bitmask.apply(masked)
            logits[first] = masked
        verified = rejection_sample(
            logits,
            sampling,
            on_device(spec.num_drafts),
            on_device(spec.draft_token_ids),
            generator=self.sampler.generator,
        )
        logprobs = verification_logprobs(logits, sampling, verified)
        num_sampled = verified.num_accepted + 1
        if self.device.type == "cpu":
            return ExecutedStep(step, verified.token_ids, logprobs, None, num_sampled)
        tokens = verified.token_ids.to("cpu", non_blocking=True)
        num_sampled = num_sampled.to("cpu", non_blocking=True)
        if logprobs is not None:
            logprobs = LogprobsTensors(
                *(
                    getattr(logprobs, f.name).to("cpu", non_blocking=True)
                    for f in dataclasses.fields(logprobs)
                )
            )
        ready = torch.cuda.Event()
        ready.record()
        return ExecutedStep(step, tokens, logprobs, ready, num_sampled)

    def fetch(self, executed: ExecutedStep) -> StepResult:
        """Waits for an executed step's results (on a GPU, for the device) and returns them on the host."""
        result = self._fetch(executed)
        result.prompt_logprobs = executed.prompt_logprobs
        if executed.pooled is not None:
            assert executed.step.pool_handles is not None
            if executed.ready is not None:
                executed.ready.synchronize()
            result.pooled = dict(zip(executed.step.pool_handles.tolist(), executed.pooled.numpy()))
        return result

    def _fetch(self, executed: ExecutedStep) -> StepResult:
        step = executed.step
        if executed.sampled is None:
            return StepResult(
                tokens=np.full(step.num_reqs, -1, dtype=np.int64), sampled_positions=_EMPTY, logprobs=None
            )
        if executed.ready is not None:
            executed.ready.synchronize()
        sampled = executed.sampled.numpy()
        if executed.num_sampled is not None:
            counts = executed.num_sampled.numpy()
            per_request = np.zeros(step.num_reqs, dtype=np.int64)
            per_request[step.sampled_positions] = counts
            offsets = np.zeros(step.num_reqs + 1, dtype=np.int64)
            np.cumsum(per_request, out=offsets[1:])
            return StepResult(
                tokens=sampled,
                sampled_positions=step.sampled_positions,
                logprobs=executed.logprobs,
                token_offsets=offsets,
                num_accepted=counts - 1,
            )
        if len(sampled) == step.num_reqs:  # every request sampled (decodes): the common step
            tokens = sampled
        else:
            tokens = np.full(step.num_reqs, -1, dtype=np.int64)
            tokens[step.sampled_positions] = sampled
        return StepResult(tokens=tokens, sampled_positions=step.sampled_positions, logprobs=executed.logprobs)

    def abandon(self, step: PreparedStep) -> None:
        """A prepared step that will never be written (it failed): its reserved positions
        belong to requests that are being aborted, whose rows are given up."""
        self.batch.num_unwritten_steps -= 1

    def write_sampled(self, step: PreparedStep, result: StepResult) -> None:
        """Records a finished step's sampled tokens in the batch, for the steps prepared after it."""
        if result.num_accepted is not None:
            self.batch.write_accepted(step.reservation, result.num_accepted + 1, result.tokens)
            return
        self.batch.write_sampled(
            step.sampled_handles, step.reservation, result.tokens[step.sampled_positions]
        )

    def token_sequences(self, handles: np.ndarray) -> list[np.ndarray]:
        """The tokens (prompt and outputs, all written) of requests holding a row: what a drafter reads."""
        batch = self.batch
        rows = batch.row_of_handle[handles]
        return [batch.token_ids[row, : batch.num_tokens[row]] for row in rows.tolist()]
