"""Batched sampling: one step's logits ``[B, vocab]`` to one token per row.

The order follows vLLM V1, so that the same parameters mean the same thing here:
raw logprobs (of the unprocessed logits) -> min_tokens mask -> penalties ->
greedy argmax -> temperature -> min_p -> top-k/top-p -> exponential race.
Every per-row parameter arrives as a tensor built once per step
(:meth:`SamplingMetadata.build`), so the only per-row Python in the hot path is
one draw per seeded row from that request's own generator.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from fastsched.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one seeded request, created once and kept in the request's state.

    Its state advances by one draw per generated token and by nothing else, which is
    what makes a seeded request's tokens independent of the batch it shares.  The seed
    is reduced modulo 2**64 because torch rejects larger or negative-overflowing ints.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)
    return generator


@dataclass
class PenaltyTensors:
    """Presence, frequency and repetition penalties with the token histories they need."""

    presence: torch.Tensor  # [B] fp32, 0 where off
    frequency: torch.Tensor  # [B] fp32, 0 where off
    repetition: torch.Tensor  # [B] fp32, 1 where off
    output_counts: torch.Tensor  # [B, vocab] int32, occurrences of each token in the output
    seen_mask: torch.Tensor  # [B, vocab] bool, token occurs in the prompt or the output


@dataclass
class SamplingMetadata:
    """One step's per-row sampling parameters as tensors; fields are ``None`` when no row uses them."""

    temperature: torch.Tensor  # [B] fp32, 1 on greedy rows so that dividing is a no-op
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64 in [1, vocab]; vocab where off
    top_p: torch.Tensor | None  # [B] fp32; 1 where off
    min_p: torch.Tensor | None  # [B] fp32; 0 where off
    generators: dict[int, torch.Generator]  # row -> its request's generator (seeded, non-greedy rows)
    penalties: PenaltyTensors | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) banned this step
    max_num_logprobs: int | None  # largest ``logprobs`` requested in the batch

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[Collection[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Gather row ``i``'s parameters from ``params[i]`` and its histories.

        Histories are read only for rows that use penalties (prompt and output) or
        are still below ``min_tokens`` (output length).  ``eos_token_ids[i]`` are
        banned with ``stop_token_ids`` until row ``i`` has ``min_tokens`` outputs,
        unless it ignores EOS; ids outside the vocabulary can never be sampled and
        are skipped.  ``generators[i]`` is used only when row ``i`` samples randomly.
        """
        greedy = [p.is_greedy for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=tensor(temperature),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=not random_rows,
            all_random=len(random_rows) == len(params),
            top_k=torch.tensor(top_k, device=device) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=tensor(min_p) if any(p > 0.0 for p in min_p) else None,
            generators={i: g for i in random_rows if (g := generators[i]) is not None},
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            min_tokens_mask=_build_min_tokens_mask(params, output_token_ids, eos_token_ids, vocab_size, device),
            max_num_logprobs=max(requested) if requested else None,
        )


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _bin_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``[B, vocab]`` occurrence counts; only the flat ids cross to the device, not a dense matrix."""
    lengths = torch.tensor([len(t) for t in token_ids], device=device)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.int32, device=device)
    counts.scatter_add_(0, rows * vocab_size + flat, torch.ones_like(flat, dtype=torch.int32))
    return counts.view(len(token_ids), vocab_size)


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> PenaltyTensors | None:
    used = [_has_penalty(p) for p in params]
    if not any(used):
        return None
    # Rows without penalties get neutral values, so their histories need not be read.
    output_counts = _bin_counts([o if u else () for o, u in zip(output_token_ids, used)], vocab_size, device)
    prompt_counts = _bin_counts([t if u else () for t, u in zip(prompt_token_ids, used)], vocab_size, device)
    return PenaltyTensors(
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        output_counts=output_counts,
        seen_mask=(output_counts > 0) | (prompt_counts > 0),
    )


def _build_min_tokens_mask(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[Collection[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids[i]))
        banned_in_vocab = [t for t in banned if 0 <= t < vocab_size]
        rows += [i] * len(banned_in_vocab)
        tokens += banned_in_vocab
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.tensor(tokens, device=device)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """vLLM's penalties, in place.

    Repetition (tokens in prompt or output): positive logits divided by the penalty,
    negative ones multiplied.  Frequency: minus penalty x output count.  Presence:
    minus penalty once for any token in the output.
    """
    repetition = torch.where(penalties.seen_mask, penalties.repetition.unsqueeze(1), 1.0)
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= penalties.frequency.unsqueeze(1) * penalties.output_counts
    logits -= penalties.presence.unsqueeze(1) * (penalties.output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's most likely one, in place."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's ``k`` largest logits, then its smallest nucleus of mass ``>= p``.

    One ascending sort serves both masks; ties at the k-th value are all kept.
    The most likely token always survives top-p.
    """
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside_nucleus = cumulative <= (1.0 - top_p).unsqueeze(1)
        outside_nucleus[:, -1] = False
        sorted_logits.masked_fill_(outside_nucleus, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


@dataclass
class LogprobsTensors:
    """Logprobs of the raw (unprocessed) logits; row ``i`` reads ``topk_*[i, :params[i].logprobs]``."""

    sampled_logprobs: torch.Tensor  # [B] fp32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] int64, 1 when the sampled token is the most likely
    topk_token_ids: torch.Tensor  # [B, K] int64, K = max_num_logprobs, most likely first
    topk_logprobs: torch.Tensor  # [B, K] fp32


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Samples one token per row; owns only the generator for unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # None draws unseeded rows from torch's default generator.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` (``[B, vocab]`` fp32), which is left unchanged for the raw logprobs."""
        processed = logits.clone()
        if metadata.min_tokens_mask is not None:
            processed[metadata.min_tokens_mask] = float("-inf")
        if metadata.penalties is not None:
            apply_penalties(processed, metadata.penalties)

        if metadata.all_greedy:
            sampled = processed.argmax(dim=-1)
        else:
            greedy = None if metadata.all_random else processed.argmax(dim=-1)
            random = self._sample_random(processed, metadata)
            sampled = random if greedy is None else torch.where(metadata.is_greedy, greedy, random)

        k = metadata.max_num_logprobs
        logprobs = None if k is None else _gather_logprobs(logits.log_softmax(dim=-1), sampled, k)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        logits.div_(metadata.temperature.unsqueeze(1))
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p.  A seeded
        # row's q comes from its own generator, one vocab-sized draw per token, so it
        # does not depend on the rows beside it; unseeded rows share one draw.
        q = torch.empty_like(probs)
        if len(metadata.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, generator in metadata.generators.items():
            q[row].exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))
    topk = raw_logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        sampled_logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=(raw_logprobs >= sampled_logprobs).sum(dim=-1),
        topk_token_ids=topk.indices,
        topk_logprobs=topk.values,
    )
