"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): each prompt token scored
by the logits of the position before it, in the step that computes that position.

A step's plan (:func:`plan_prompt_logprobs`) names the rows of the flat token batch whose
logits score a prompt token: for a request that computes positions ``[c, c + n)`` of a
``P``-token prompt, positions ``c .. min(c + n, P - 1) - 1``, row ``p`` scoring prompt
token ``p + 1``. The first prompt token has no position before it and gets no entry; the
last position's logits are the sampling row and score the first output token instead.

:func:`compute_prompt_logprobs` runs the LM head over those rows a chunk at a time
(``PROMPT_LOGPROBS_CHUNK`` rows), so that a long prompt never holds more than a chunk's
``rows x vocab`` logits at once; what it keeps per row is the scored token's logprob and
rank and the top ``k``. Logprobs are of the raw logits (no temperature or penalties), as
vLLM's default ``logprobs_mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastsched.sample.sampler import LogprobsTensors, gather_logprobs

# Rows of logits materialised at once: 256 x a 152k vocabulary in fp32 is 155 MB.
PROMPT_LOGPROBS_CHUNK = 256

# One prompt position's entry: token id -> (logprob, rank), the scored token first.
PromptLogprobsEntry = dict[int, tuple[float, int]]
# Sees each chunk's full log-softmax rows (plan, index of its first row, [rows, vocab] fp32)
# before they are reduced: how a tool (``fastsched perplexity``) reads whole distributions.
LogprobsTap = Callable[["PromptLogprobsPlan", int, torch.Tensor], None]


@dataclass
class PromptLogprobsPlan:
    """The rows of one step that score prompt tokens, grouped by request in step order."""

    flat_indices: np.ndarray  # [R] int64: rows of the step's flat token batch
    target_ids: np.ndarray  # [R] int64: the prompt token each row scores
    num_top: int  # the largest k asked for among the step's requests
    handles: np.ndarray  # [G] the requests, each with its rows one after the other
    starts: np.ndarray  # [G] the position of each request's first row (its prompt index - 1)
    counts: np.ndarray  # [G] rows per request
    top_k: np.ndarray  # [G] the k each request asked for

    def row_positions(self) -> np.ndarray:
        """Each row's position: row ``r`` scores prompt token ``row_positions()[r] + 1`` of its request."""
        first_rows = np.cumsum(self.counts) - self.counts
        within = np.arange(len(self.flat_indices)) - np.repeat(first_rows, self.counts)
        return np.repeat(self.starts, self.counts) + within

    def row_handles(self) -> np.ndarray:
        """Each row's request."""
        return np.repeat(self.handles, self.counts)


def plan_prompt_logprobs(
    req_handles: np.ndarray,
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
    prompt_lens: np.ndarray,
    k_of: np.ndarray,
    tokens_of: Callable[[int], np.ndarray],
) -> PromptLogprobsPlan | None:
    """The step's plan, or None when no scheduled request scores prompt tokens in it.
    ``k_of``: the step's requests' ``prompt_logprobs`` (-1: none, or already returned);
    ``tokens_of(handle)``: a request's token ids (its prompt first)."""
    computed = num_computed.astype(np.int64)
    ends = np.minimum(computed + num_scheduled, prompt_lens.astype(np.int64) - 1)
    counts = np.where(k_of >= 0, np.maximum(ends - computed, 0), 0)
    groups = np.flatnonzero(counts)
    if not len(groups):
        return None
    row_starts = np.zeros(len(req_handles), dtype=np.int64)
    np.cumsum(num_scheduled[:-1], out=row_starts[1:])
    g_counts = counts[groups]
    within = np.arange(int(g_counts.sum())) - np.repeat(np.cumsum(g_counts) - g_counts, g_counts)
    flat = np.repeat(row_starts[groups], g_counts) + within
    targets = np.concatenate(
        [
            tokens_of(int(req_handles[g]))[computed[g] + 1 : computed[g] + 1 + counts[g]]
            for g in groups.tolist()
        ]
    ).astype(np.int64)
    return PromptLogprobsPlan(
        flat_indices=flat,
        target_ids=targets,
        num_top=int(k_of[groups].max()),
        handles=req_handles[groups],
        starts=computed[groups],
        counts=g_counts,
        top_k=k_of[groups],
    )


@dataclass
class ScoredPrompts:
    """A step's plan with its rows scored, on the CPU (``sampled_*``: the scored prompt tokens')."""

    plan: PromptLogprobsPlan
    logprobs: LogprobsTensors

    def entries(self) -> list[tuple[int, int, list[PromptLogprobsEntry]]]:
        """Per request of the plan: (handle, position of its first row, its entries in order)."""
        plan, lp = self.plan, self.logprobs
        tokens = plan.target_ids.tolist()
        values = lp.sampled_logprobs.tolist()
        ranks = lp.sampled_ranks.tolist()
        top_ids = lp.topk_token_ids.tolist()
        top_values = lp.topk_logprobs.tolist()
        out = []
        lo = 0
        for h, start, count, k in zip(
            plan.handles.tolist(), plan.starts.tolist(), plan.counts.tolist(), plan.top_k.tolist()
        ):
            entries = []
            for r in range(lo, lo + count):
                entry: PromptLogprobsEntry = {tokens[r]: (values[r], ranks[r])}
                for rank, (t, v) in enumerate(zip(top_ids[r][:k], top_values[r][:k]), start=1):
                    entry.setdefault(t, (v, rank))
                entries.append(entry)
            out.append((h, start, entries))
            lo += count
        return out


@torch.inference_mode()
def compute_prompt_logprobs(
    hidden: torch.Tensor,
    plan: PromptLogprobsPlan,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    chunk: int = PROMPT_LOGPROBS_CHUNK,
    tap: LogprobsTap | None = None,
) -> ScoredPrompts:
    """Scores the plan's rows of ``hidden`` (the step's flat hidden states)."""
    device = hidden.device
    index = torch.from_numpy(plan.flat_indices).to(device)
    targets = torch.from_numpy(plan.target_ids).to(device)
    # At least one column, so that topk and its list form never see a zero-width tensor.
    k = max(plan.num_top, 1)
    parts = []
    for lo in range(0, len(index), chunk):
        rows = index[lo : lo + chunk]
        logprobs = compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        if tap is not None:
            tap(plan, lo, logprobs)
        parts.append(gather_logprobs(logprobs, targets[lo : lo + chunk], k))
    names = ("sampled_logprobs", "sampled_ranks", "topk_token_ids", "topk_logprobs")
    joined = (torch.cat([getattr(p, n) for p in parts]).cpu() for n in names)
    return ScoredPrompts(plan, LogprobsTensors(*joined))


class PromptLogprobsStore:
    """The prompt logprobs computed so far per request (engine side), until the output that
    returns them: the one with the request's first token, or its finish (a prefill-only
    request). A prefill that starts again (a preemption recomputes from position 0) drops
    what was computed from where it restarts."""

    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[int, list[PromptLogprobsEntry]]]] = {}

    def add(self, handle: int, start: int, entries: list[PromptLogprobsEntry]) -> None:
        parts = [p for p in self._parts.get(handle, []) if p[0] < start]
        parts.append((start, entries))
        self._parts[handle] = parts

    def take(self, handle: int, num_prompt_tokens: int) -> list[PromptLogprobsEntry | None]:
        """The request's prompt logprobs, one per prompt token once its prefill is done:
        ``None`` for the first, and for those taken from the prefix cache unscored
        (``skip_reading_prefix_cache=False``); the scored ones run to the prompt's end."""
        scored = [e for _, entries in self._parts.pop(handle, []) for e in entries]
        return [None] * (num_prompt_tokens - len(scored)) + scored

    def drop(self, handle: int) -> None:
        """Forgets an ended (e.g. aborted) request's."""
        self._parts.pop(handle, None)
