"""A step's outputs, built from the scheduler's arrays (the engine's share of docs/design.md §1).

:class:`StepOutputs` turns what a collected step produced (the scheduler's
``EngineCoreOutputs`` and the runner's ``StepResult``) into one :class:`OutputBatch`: numpy
over all rows, Python only for the rows that need something of their own (a first token,
logprobs, a stop token id, an error, an embedding, a final-only request's whole output). The per-request
values it needs and the scheduler does not hold live in :class:`RequestColumns`, indexed by
scheduler handle, written by :meth:`StepOutputs.add_request`.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from fastsched import _core
from fastsched.engine.output_batch import OutputBatch, select_csr
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.sample import LogprobsTensors
from fastsched.sample.prompt_logprobs import PromptLogprobsStore, plan_prompt_logprobs
from fastsched.worker.model_runner import PreparedStep, StepResult

FINISH_STOP = 1
FINISH_ABORT = 3
FINISH_IGNORED = 4


class RequestColumns:
    """Per-request values a step reads or writes that the scheduler does not hold (it holds
    the request itself: its id, prompt, limits, arrival and progress, which the engine asks
    it for), as numpy arrays indexed by scheduler handle: a step gathers them for all its
    rows at once. Written by ``add_request``; a handle's values are overwritten when the
    scheduler reuses it for a new request."""

    def __init__(self, size: int = 64) -> None:
        # The handle's id: the step's outputs name their rows without a call per row (the
        # scheduler maps ids to handles, and answers handle -> id one call per row).
        self.request_id = np.empty(size, dtype=object)
        self.final_only = np.zeros(size, dtype=bool)
        # Rows a step must look at one by one: a request before its first token (first-token
        # time, prefix-cache hit to report) and any request with logprobs.
        self.watch = np.zeros(size, dtype=bool)
        self.client = np.zeros(size, dtype=np.int64)
        self.logprobs = np.full(size, -1, dtype=np.int64)  # -1: none requested
        self.prompt_logprobs = np.full(size, -1, dtype=np.int64)  # -1: none requested, or returned already
        self.cached_reported = np.zeros(size, dtype=bool)
        self.first_scheduled_time = np.full(size, math.nan)
        self.first_token_time = np.full(size, math.nan)
        self.lora_id = np.zeros(size, dtype=np.int64)  # 0: the base model
        self.pool = np.zeros(size, dtype=bool)  # a pooling request (embeddings)

    def ensure(self, handle: int) -> None:
        """Grows every column (doubling) so that ``handle`` indexes it."""
        size = len(self.request_id)
        if handle < size:
            return
        new_size = max(2 * size, handle + 1)
        for name, column in vars(self).items():
            grown = np.empty(new_size, dtype=column.dtype)
            grown[:size] = column
            setattr(self, name, grown)


class StepOutputs:
    """The engine's outputs of each collected step, and the columns they are read from."""

    def __init__(self, scheduler: _core.Scheduler, eos_token_ids: tuple[int, ...]) -> None:
        self.scheduler = scheduler
        self.eos_set = frozenset(eos_token_ids)  # a stop at one of these reports no stop token id
        self.columns = RequestColumns()
        self.num_final_only = 0  # live final-only requests: while there are none, no row is filtered
        self.prompt_store = PromptLogprobsStore()
        self.num_scoring = 0  # live requests whose prompt logprobs are not returned yet

    def add_request(self, handle: int, request: EngineCoreRequest, client: int, lora_id: int | None) -> None:
        """A new request's columns (``EngineCore.add_request``, once the scheduler gave it ``handle``)."""
        params = request.params
        c = self.columns
        c.ensure(handle)
        c.request_id[handle] = request.request_id
        c.final_only[handle] = request.final_only
        c.watch[handle] = not request.final_only or params.logprobs is not None
        self.num_final_only += request.final_only
        c.client[handle] = client
        c.logprobs[handle] = -1 if params.logprobs is None else params.logprobs
        c.cached_reported[handle] = False
        c.first_scheduled_time[handle] = c.first_token_time[handle] = math.nan
        c.lora_id[handle] = lora_id or 0
        c.pool[handle] = request.pooling
        k = params.prompt_logprobs
        c.prompt_logprobs[handle] = -1 if k is None else k
        self.prompt_store.drop(handle)  # a handle reused after an abandoned step
        if k is not None:
            c.watch[handle] = True
            self.num_scoring += 1

    def plan_step(self, so: _core.SchedulerOutput, prompt_lens: np.ndarray, step: PreparedStep) -> None:
        """What step ``so`` computes beyond its samples (``prompt_lens``: its requests'): the rows
        that score prompt tokens (prompt_logprobs) and the pooling requests' last prompt tokens."""
        if not len(so):
            return
        computed = so.num_computed_tokens.astype(np.int64)
        scheduled = so.num_scheduled_tokens.astype(np.int64)
        if self.num_scoring:
            step.prompt_logprobs = plan_prompt_logprobs(
                so.req_handles,
                computed,
                scheduled,
                prompt_lens,
                self.columns.prompt_logprobs[so.req_handles],
                self.scheduler.token_ids,
            )
        # S20: a pooling request is prefill-only, so it is not among the sampled rows: its
        # embedding is taken in the step that computes its last prompt token.
        completes = (
            self.columns.pool[so.req_handles]
            & (computed < prompt_lens)
            & (computed + scheduled >= prompt_lens)
        )
        if np.count_nonzero(completes):
            rows = np.flatnonzero(completes)
            step.pool_tokens = step.query_start_loc[1:][rows].astype(np.int64) - 1
            step.pool_handles = so.req_handles[rows]

    def _return_prompt_logprobs(self, batch: OutputBatch, row: int, handle: int, returned: bool) -> None:
        """Row ``row`` returns its request's prompt logprobs (``returned``) or drops them (an abort)."""
        self.columns.prompt_logprobs[handle] = -1
        self.num_scoring -= 1
        if returned:
            batch.prompt_logprobs[row] = self.prompt_store.take(
                handle, int(self.scheduler.num_prompt_tokens(np.array([handle], dtype=np.uint32))[0])
            )
        else:
            self.prompt_store.drop(handle)

    def collect(
        self, eco: _core.EngineCoreOutputs, so: _core.SchedulerOutput, result: StepResult
    ) -> OutputBatch:
        """The step's outputs as an OutputBatch, from the scheduler's arrays: numpy over all
        rows, Python only for watched rows (see ``RequestColumns.watch``) and finished ones."""
        handles = eco.handles
        offsets = eco.token_offsets
        tokens = eco.token_ids
        reasons = eco.finish_reasons
        cached = eco.num_cached_tokens
        segment_ended = eco.segment_ended
        c = self.columns
        if self.num_final_only and len(handles):
            # Final-only requests show up only when they finish.
            keep = ~c.final_only[handles] | (reasons != 0)
            if np.count_nonzero(keep) < len(keep):
                rows = np.flatnonzero(keep)
                offsets, tokens = select_csr(offsets, tokens, rows)
                handles, reasons, cached = handles[rows], reasons[rows], cached[rows]
                segment_ended = segment_ended[rows]
        if result.prompt_logprobs is not None:
            for h, start, entries in result.prompt_logprobs.entries():
                self.prompt_store.add(h, start, entries)
        n = len(handles)
        if not n:
            return OutputBatch.empty()
        batch = OutputBatch(
            request_ids=c.request_id[handles].tolist(),
            token_offsets=offsets,
            token_ids=tokens,
            finish_reasons=reasons,
            num_cached_tokens=np.full(n, -1, dtype=np.int64),
            first_token=np.zeros(n, dtype=bool),
            clients=c.client[handles],
            handles=handles.astype(np.int64),
        )
        if np.count_nonzero(segment_ended):
            batch.segment_ends = set(np.flatnonzero(segment_ended).tolist())
        if result.pooled:
            # The step that computed a pooling request's prompt also finished it (S20).
            for i in np.flatnonzero(np.isin(handles, list(result.pooled))).tolist():
                batch.pooled[i] = result.pooled[int(handles[i])]
        watch = c.watch[handles]
        if np.count_nonzero(watch):
            self._collect_watched(batch, handles, np.flatnonzero(watch), cached, so, result)
        if np.count_nonzero(reasons):
            self._collect_finished(batch, handles, cached)
        return batch

    def _collect_finished(self, batch: OutputBatch, handles: np.ndarray, cached: np.ndarray) -> None:
        """Stop token ids, why ignored requests could not run, and final-only requests' outputs."""
        c = self.columns
        offsets, tokens, reasons = batch.token_offsets, batch.token_ids, batch.finish_reasons
        for i in np.flatnonzero(reasons).tolist():
            h = int(handles[i])
            if reasons[i] == FINISH_STOP and offsets[i + 1] > offsets[i]:
                last = int(tokens[offsets[i + 1] - 1])
                if last not in self.eos_set:
                    batch.stop_reasons[i] = last
            elif reasons[i] == FINISH_IGNORED:
                batch.errors[i] = self.scheduler.ignore_reason(h)
            if c.final_only[h]:
                batch.num_cached_tokens[i] = cached[i]
            if c.prompt_logprobs[h] >= 0:  # a prefill-only request (S20), an abort or an ignored prompt
                self._return_prompt_logprobs(batch, i, h, reasons[i] != FINISH_ABORT)
        if self.num_final_only:
            self._final_only_tokens(batch, handles)

    def _collect_watched(
        self,
        batch: OutputBatch,
        handles: np.ndarray,
        watched: np.ndarray,
        cached: np.ndarray,
        so: _core.SchedulerOutput,
        result: StepResult,
    ) -> None:
        """First tokens (their time, the prefix-cache hit reported once) and logprobs."""
        c = self.columns
        wh = handles[watched]
        offsets = batch.token_offsets
        got = offsets[watched + 1] > offsets[watched]
        first = got & np.isnan(c.first_token_time[wh])
        batch.first_token[watched[first]] = True
        c.first_token_time[wh[first]] = time.time()
        hit = cached[watched]
        report = (hit >= 0) & ~c.cached_reported[wh]
        batch.num_cached_tokens[watched[report]] = hit[report]
        c.cached_reported[wh[report]] = True
        for i in watched[got & (c.prompt_logprobs[wh] >= 0)].tolist():
            self._return_prompt_logprobs(batch, i, int(handles[i]), True)
        k = c.logprobs[wh]
        wants = (k >= 0) & got
        if np.count_nonzero(wants) and result.logprobs is not None:
            # Each row's index among the step's sampled rows, where its logprobs are.
            sampled_handles = so.req_handles[result.sampled_positions]
            order = np.argsort(sampled_handles)
            j_of = order[np.searchsorted(sampled_handles, wh[wants], sorter=order)]
            rows = watched[wants]
            tokens = batch.token_ids[offsets[rows]].tolist()
            for i, entry in zip(rows.tolist(), _logprobs_entries(result.logprobs, j_of, tokens, k[wants])):
                batch.logprobs[i] = [entry]
        c.watch[wh] = (
            (k >= 0)
            | (c.prompt_logprobs[wh] >= 0)
            | ~c.cached_reported[wh]
            | np.isnan(c.first_token_time[wh])
        )

    def _final_only_tokens(self, batch: OutputBatch, handles: np.ndarray) -> None:
        """Finished final-only rows get all their output tokens (read from the scheduler,
        which holds a finished request until the next schedule())."""
        c = self.columns
        offsets = batch.token_offsets
        pieces = []
        prompt_lens = self.scheduler.num_prompt_tokens(handles).tolist()
        for i, h in enumerate(handles.tolist()):
            if c.final_only[h]:
                pieces.append(self.scheduler.token_ids(h)[prompt_lens[i] :])
            else:
                pieces.append(batch.token_ids[offsets[i] : offsets[i + 1]])
        batch.token_offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=batch.token_offsets[1:])
        batch.token_ids = np.concatenate(pieces)


def _logprobs_entries(
    lp: LogprobsTensors, rows: np.ndarray, tokens: list[int], k: np.ndarray
) -> list[dict[int, tuple[float, int]]]:
    """Sampled rows ``rows`` of ``lp``: each one's token (``tokens``) with its (logprob, rank),
    plus its ``k`` most likely tokens'. The tensors are read once, as lists, for all rows."""
    index = torch.from_numpy(rows)
    sampled = lp.sampled_logprobs[index].tolist()
    ranks = lp.sampled_ranks[index].tolist()
    top_ids = lp.topk_token_ids[index].tolist()
    top_values = lp.topk_logprobs[index].tolist()
    entries = []
    for token, value, rank, ids, values, k_i in zip(tokens, sampled, ranks, top_ids, top_values, k.tolist()):
        entry = {token: (value, rank)}
        for r, (t, v) in enumerate(zip(ids[:k_i], values[:k_i]), start=1):
            entry.setdefault(t, (v, r))
        entries.append(entry)
    return entries
