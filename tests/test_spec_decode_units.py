"""Speculative decoding's parts on their own: the rejection sampler (greedy rule, and the
random rule's output distribution against the target's by a chi-square test), n-gram
prompt lookup, the ``--speculative-config`` parser and the acceptance counters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastsched.config import EngineConfig
from fastsched.sample import SamplingMetadata
from fastsched.sampling_params import SamplingParams
from fastsched.spec_decode import NgramProposer, SpecDecodingCounters, rejection_sample
from fastsched.speculative_config import parse_speculative_config

VOCAB = 6
# Chi-square critical value for 5 degrees of freedom at p = 0.001: a correct sampler fails
# once in a thousand seeds; the seed is fixed, so the test is deterministic.
CHI2_CRITICAL_DF5 = 20.52


def metadata(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[1]] * n, [[]] * n, [()] * n, [None] * n, VOCAB)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_rows_keep_the_longest_matching_prefix_then_the_targets_token() -> None:
    # Target argmax per position: row 0: 2, 4, 1, 5; row 1: 3, 0; row 2: 1 (no drafts).
    argmax = [2, 4, 1, 5, 3, 0, 1]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), VOCAB).float() * 5
    drafts = torch.tensor([2, 4, 0, 3])  # row 0: two match, the third does not; row 1: match
    out = rejection_sample(
        logits, metadata([SamplingParams(temperature=0)] * 7), torch.tensor([3, 1, 0]), drafts
    )
    assert out.num_accepted.tolist() == [2, 1, 0]
    assert out.token_ids.tolist() == [2, 4, 1, 3, 0, 1]


def test_a_placeholder_draft_is_never_accepted() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 5.0  # the argmax is token 0, which a -1 placeholder is clamped to internally
    out = rejection_sample(
        logits, metadata([SamplingParams(temperature=0)] * 3), torch.tensor([2]), torch.tensor([-1, -1])
    )
    assert out.num_accepted.tolist() == [0] and out.token_ids.tolist() == [0]


@pytest.mark.parametrize("proposal", ["one-hot", "distribution"])
def test_random_rows_emit_tokens_distributed_as_the_target(proposal: str) -> None:
    """Each row: one draft, then a bonus position. The first emitted token must follow the
    target's p at position 0 whatever was drafted; when the draft is accepted, the second
    follows p at position 1."""
    rows = 20000
    p0_logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0])
    p1_logits = torch.tensor([0.1, 1.5, -1.0, 0.2, 0.7, 0.3])
    logits = torch.stack([p0_logits, p1_logits]).repeat(rows, 1)
    generator = torch.Generator().manual_seed(1234)
    if proposal == "one-hot":  # n-gram and greedy draft models: always the same draft
        drafts, q = torch.full((rows,), 3), None
    else:
        q_dist = torch.tensor([0.05, 0.4, 0.2, 0.1, 0.2, 0.05])
        drafts = torch.multinomial(q_dist, rows, replacement=True, generator=generator)
        q = q_dist.repeat(rows, 1)
    md = metadata([SamplingParams(temperature=1.0)] * (2 * rows))
    out = rejection_sample(logits, md, torch.ones(rows, dtype=torch.long), drafts, q, generator)
    starts = torch.cumsum(out.num_accepted + 1, 0) - (out.num_accepted + 1)
    first = out.token_ids[starts]
    assert (
        chi_square(torch.bincount(first, minlength=VOCAB).float(), p0_logits.softmax(0)) < CHI2_CRITICAL_DF5
    )
    accepted = out.num_accepted == 1
    second = out.token_ids[starts[accepted] + 1]
    assert (
        chi_square(torch.bincount(second, minlength=VOCAB).float(), p1_logits.softmax(0)) < CHI2_CRITICAL_DF5
    )
    if proposal == "one-hot":  # accepted with probability p(draft)
        assert abs(accepted.float().mean().item() - p0_logits.softmax(0)[3].item()) < 0.02


def test_ngram_lookup_prefers_the_longest_ngram_and_its_first_occurrence() -> None:
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = np.array([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 1, 2, 3])
    assert proposer.propose_one(tokens).tolist() == [9, 9, 1]  # "1 2 3" first followed by 9 9 1
    assert proposer.propose_one(np.array([5, 6, 8])).tolist() == []  # no earlier match
    assert proposer.propose_one(np.array([5, 6, 5])).tolist() == [6, 5]  # fewer than k near the end


def test_ngram_lookup_agrees_with_a_brute_force_search() -> None:
    proposer = NgramProposer(4, prompt_lookup_min=2, prompt_lookup_max=4)
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 5, rng.integers(1, 40))
        length, expected = len(tokens), []
        for n in range(min(4, length - 1), 1, -1):
            starts = [s for s in range(length - n) if (tokens[s : s + n] == tokens[length - n :]).all()]
            if starts:
                expected = tokens[starts[0] + n : starts[0] + n + 4].tolist()
                break
        assert proposer.propose_one(tokens).tolist() == expected, tokens


def test_speculative_config_parses_vllms_json_and_names_bad_fields() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'
    )
    assert (
        config.method,
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
    ) == ("ngram", 4, 5, 5)
    assert parse_speculative_config({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    for bad, message in [
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be at least 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}', "unsupported fields: draft_tp"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_max (2) must be at least prompt_lookup_min (4)",
        ),
        ('{"num_speculative_tokens": 2}', "needs a method"),
        ("not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_speculative_config(bad)


def test_engine_config_passes_k_to_the_scheduler_as_draft_slots() -> None:
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5}')
    assert config.scheduler_config(1024, 64).num_speculative_tokens == 5
    assert EngineConfig().scheduler_config(1024, 64).num_speculative_tokens == 0


def test_counters_count_accepted_tokens_by_position() -> None:
    counters = SpecDecodingCounters(3)
    counters.observe(np.array([3, 3, 0, 2]), np.array([3, 1, 0, 0]))
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (3, 8, 4)
    assert counters.num_accepted_tokens_per_pos == [2, 1, 1]
    assert counters.acceptance_rate == 0.5
