"""Verifying drafts: the rejection-sampling rule of speculative decoding, batched.

A request with ``s`` drafts ``d_1..d_s`` has ``s + 1`` target distributions, one per
verified position (``p_j`` predicts the token after ``d_j``'s prefix). Draft ``j`` is
accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, where ``q_j`` is the
distribution the drafter drew it from; the first rejected position instead emits a
token drawn from the residual ``max(0, p_j - q_j)`` (normalised), and when every draft
is accepted the last position emits a bonus token drawn from ``p_{s+1}``. The emitted
tokens are then distributed exactly as tokens drawn from the target one at a time
(Leviathan et al., 2023). Greedy rows are the limit of that rule: a draft is accepted
when it is the target's argmax, and the first mismatch emits the argmax.

Our drafters are deterministic (n-gram lookup, a draft model decoding greedily), so
``q_j`` is one-hot: acceptance with probability ``p_j(d_j)`` and the residual is ``p_j``
without ``d_j``. ``draft_probs`` takes a general ``q`` for drafters that sample.

The target's logits are processed as :class:`~fastsched.sample.Sampler` does
(min_tokens bans, penalties, then for random rows temperature, min_p, top-k/top-p),
with metadata holding one row per verified position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastsched.sample import SamplingMetadata
from fastsched.sample.sampler import apply_min_p, apply_penalties, apply_top_k_top_p


@dataclass
class Verified:
    """The tokens a verification step emits, row after row (``num_accepted[i] + 1`` for row ``i``)."""

    token_ids: torch.Tensor  # [sum(num_accepted + 1)] int64
    num_accepted: torch.Tensor  # [B] int64, drafts accepted per row
    emitted_positions: torch.Tensor  # [B] int64, index among the positions of each row's last token


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    num_drafts: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verified:
    """Verifies each row's drafts against the target's ``logits``.

    ``logits``: ``[B + D, vocab]`` fp32, row ``i``'s ``num_drafts[i] + 1`` positions one
    after the other (left unchanged); ``metadata``: one row per position. ``draft_token_ids``:
    ``[D]``, row after row; a negative id is a placeholder that is never accepted.
    ``draft_probs``: ``[D, vocab]`` proposal distributions, ``None`` for deterministic drafts.
    ``generator`` draws for unseeded rows; seeded rows use their own (``metadata.generators``,
    keyed by position).
    """
    device = logits.device
    num_rows = num_drafts.shape[0]
    counts = num_drafts.to(device) + 1
    starts = torch.cumsum(counts, 0) - counts
    row_of_draft = torch.repeat_interleave(torch.arange(num_rows, device=device), num_drafts.to(device))
    draft_pos = torch.arange(draft_token_ids.shape[0], device=device) + row_of_draft  # skip one bonus per row
    valid = draft_token_ids >= 0
    drafts = draft_token_ids.clamp_min(0)

    processed = logits.clone()
    if metadata.min_tokens_mask is not None:
        processed[metadata.min_tokens_mask] = float("-inf")
    if metadata.penalties is not None:
        apply_penalties(processed, metadata.penalties)
    target_argmax = processed.argmax(dim=-1)
    accept = target_argmax[draft_pos] == drafts
    probs = None
    if not metadata.all_greedy:
        probs = _random_probs(processed, metadata)
        p_draft = probs[draft_pos, drafts]
        q_draft = (
            torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(1, drafts[:, None])[:, 0]
        )
        uniform = _uniform(draft_pos, metadata, generator)
        random_accept = uniform * q_draft < p_draft
        accept = torch.where(metadata.is_greedy[draft_pos], accept, random_accept)
    accept &= valid

    # Drafts accepted before a row's first rejection.
    rejected = (~accept).to(torch.int64)
    rejected_before = torch.cumsum(rejected, 0) - rejected
    first_of_row = torch.zeros(num_rows, dtype=torch.int64, device=device)
    has_drafts = num_drafts.to(device) > 0
    first_draft = torch.cumsum(num_drafts.to(device), 0) - num_drafts.to(device)
    first_of_row[has_drafts] = rejected_before[first_draft[has_drafts]]
    leading = (rejected_before + rejected - first_of_row[row_of_draft]) == 0
    num_accepted = torch.zeros(num_rows, dtype=torch.int64, device=device).index_add_(
        0, row_of_draft, leading.to(torch.int64)
    )

    emitted = starts + num_accepted
    final = target_argmax[emitted]
    if probs is not None:
        final = torch.where(
            metadata.is_greedy[emitted],
            final,
            _recover(
                probs,
                emitted,
                num_accepted < num_drafts.to(device),
                first_draft + num_accepted,
                drafts,
                valid,
                draft_probs,
                starts,
                metadata,
                generator,
            ),
        )

    # Position j of row i emits when j <= num_accepted[i]: the drafts before, then ``final``.
    tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=device)
    tokens[draft_pos] = drafts
    tokens[emitted] = final
    row_of_pos = torch.repeat_interleave(torch.arange(num_rows, device=device), counts)
    within = torch.arange(logits.shape[0], device=device) - starts[row_of_pos]
    return Verified(tokens[within <= num_accepted[row_of_pos]], num_accepted, emitted)


def _random_probs(processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row samples from, as the sampler builds it."""
    scaled = processed / metadata.temperature.unsqueeze(1)
    if metadata.min_p is not None:
        apply_min_p(scaled, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
    return scaled.softmax(dim=-1)


def _uniform(
    positions: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    """One uniform draw per draft; a seeded row draws from its own generator."""
    uniform = torch.rand(positions.shape[0], device=positions.device, generator=generator)
    if metadata.generators:
        for d, pos in enumerate(positions.tolist()):
            own = metadata.generators.get(pos)
            if own is not None:
                uniform[d] = torch.rand(1, device=positions.device, generator=own)[0]
    return uniform


def _recover(
    probs: torch.Tensor,
    emitted: torch.Tensor,
    was_rejected: torch.Tensor,
    rejected_draft: torch.Tensor,
    drafts: torch.Tensor,
    valid: torch.Tensor,
    draft_probs: torch.Tensor | None,
    starts: torch.Tensor,
    metadata: SamplingMetadata,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Each random row's last token: from the residual ``max(0, p - q)`` at its rejected
    position, or from ``p`` at its bonus position (every draft accepted)."""
    dist = probs[emitted].clone()
    rows = torch.nonzero(was_rejected).flatten()
    if rows.numel():
        d = rejected_draft[rows]
        if draft_probs is None:
            keep = valid[d]  # a placeholder draft takes nothing away
            dist[rows[keep], drafts[d[keep]]] = 0.0
        else:
            dist[rows] = (dist[rows] - draft_probs[d]).clamp_min_(0.0)
        empty = dist[rows].sum(dim=-1) <= 0
        dist[rows[empty]] = probs[emitted[rows[empty]]]  # p == q: the residual is empty, p itself is exact
    # Exponential race, as the sampler: argmax(p / E) with E ~ Exp(1) is a draw from p (normalised or not).
    race = torch.empty_like(dist).exponential_(generator=generator)
    if metadata.generators:
        for i, start in enumerate(starts.tolist()):
            own = metadata.generators.get(start)
            if own is not None:
                race[i].exponential_(generator=own)
    return dist.div_(race).argmax(dim=-1)
