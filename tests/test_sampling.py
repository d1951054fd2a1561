"""Sampling parameters, the batched sampler and stop strings, as specifications."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from contextlib import AbstractContextManager

import numpy as np
import pytest
import torch

from fastsched.frontend.stop import StopChecker
from fastsched.sample import RowSamplingParams, Sampler, SamplingMetadata, TokenHistories, make_generator
from fastsched.sample.sampler import apply_penalties, apply_top_k_top_p
from fastsched.sampling_params import SamplingParams

EOS = 0


def metadata(
    params: Sequence[SamplingParams],
    vocab_size: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    """One row per params; histories empty and no generators unless given; EOS is token 0."""
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        eos_token_ids=[{EOS}] * n,
        generators=generators or [None] * n,
        vocab_size=vocab_size,
    )


def fixed_sampler(seed: int = 0) -> Sampler:
    return Sampler(generator=make_generator(seed))


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()


def invalid(message: str) -> AbstractContextManager[pytest.ExceptionInfo[ValueError]]:
    return pytest.raises(ValueError, match=re.escape(message))


# --- SamplingParams --------------------------------------------------------------


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (16, 0, [], [], False)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logprobs, p.include_stop_str_in_output, p.skip_special_tokens) == (None, False, True)


def test_n_and_token_counts_are_validated() -> None:
    with invalid("n must be at least 1, got 0"):
        SamplingParams(n=0)
    with invalid("max_tokens must be non-negative, got -1"):
        SamplingParams(max_tokens=-1)
    with invalid("min_tokens must be non-negative, got -1"):
        SamplingParams(min_tokens=-1)
    with invalid("min_tokens must be less than or equal to max_tokens=4, got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_temperature_is_validated() -> None:
    with invalid("temperature must be non-negative, got -1.0"):
        SamplingParams(temperature=-1.0)
    with invalid("temperature must be a finite number within float32's range"):
        SamplingParams(temperature=math.nan)


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, 1e300])
def test_non_finite_or_beyond_float32_floats_are_rejected(name: str, value: float) -> None:
    """Issue 11 defect 7: temperature Infinity or 1e300 used to be accepted (inf in the
    float32 sampler, NaN where min_tokens or top-k put -inf)."""
    with invalid(f"{name} must be a finite number within float32's range"):
        SamplingParams(**{name: value})


def test_truncation_parameters_are_validated() -> None:
    with invalid("top_p must be in (0, 1], got 1.5"):
        SamplingParams(top_p=1.5)
    with invalid("top_p must be in (0, 1], got 0.0"):
        SamplingParams(top_p=0.0)
    with invalid("top_k must be -1 (disable), 0 (disable) or at least 1, got -2"):
        SamplingParams(top_k=-2)
    with invalid("min_p must be in [0, 1], got 1.1"):
        SamplingParams(min_p=1.1)
    SamplingParams(top_k=-1)


def test_penalties_are_validated() -> None:
    with invalid("presence_penalty must be in [-2, 2], got 2.5"):
        SamplingParams(presence_penalty=2.5)
    with invalid("frequency_penalty must be in [-2, 2], got -3.0"):
        SamplingParams(frequency_penalty=-3.0)
    with invalid("repetition_penalty must be greater than zero, got 0.0"):
        SamplingParams(repetition_penalty=0.0)


def test_logprobs_and_seed_are_validated() -> None:
    with invalid("logprobs must be in [0, 20], got 21"):
        SamplingParams(logprobs=21)
    with invalid("logprobs must be in [0, 20], got -1"):
        SamplingParams(logprobs=-1)
    with invalid("seed must be an int or None, got 1.5"):
        SamplingParams(seed=1.5)  # type: ignore[arg-type]
    with invalid("seed must be an int or None, got True"):
        SamplingParams(seed=True)


def test_stop_accepts_a_string_a_list_or_none() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    with invalid("stop must not contain an empty string, got ['a', '']"):
        SamplingParams(stop=["a", ""])


def test_clone_is_independent_and_greedy_means_zero_temperature() -> None:
    p = SamplingParams(stop=["x"], temperature=0.0)
    q = p.clone()
    q.stop.append("y")  # type: ignore[union-attr]
    assert p.stop == ["x"] and q.stop == ["x", "y"]
    assert p.is_greedy and not SamplingParams(temperature=0.5).is_greedy


# --- Sampler: greedy and truncation ---------------------------------------------


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(8, 100, generator=make_generator(1))
    out = Sampler()(logits, metadata([SamplingParams(temperature=0.0)] * 8, 100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_top_k_1_equals_greedy_in_a_mixed_batch() -> None:
    logits = torch.randn(16, 100, generator=make_generator(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.3)] * 8
    out = fixed_sampler()(logits, metadata(params, 100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_samples_only_from_the_k_largest() -> None:
    row = torch.randn(50, generator=make_generator(3))
    logits = row.expand(4000, 50)
    out = fixed_sampler()(logits, metadata([SamplingParams(top_k=5, temperature=2.0)] * 4000, 50))
    allowed = set(row.topk(5).indices.tolist())
    assert set(out.sampled_token_ids.tolist()) == allowed


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    masked = apply_top_k_top_p(logits.expand(1, 4).clone(), None, torch.tensor([0.7]))
    assert torch.isinf(masked[0, 2:]).all() and torch.equal(masked[0, :2], logits[:2])
    out = fixed_sampler()(logits.expand(2000, 4), metadata([SamplingParams(top_p=0.7)] * 2000, 4))
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1e-6]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2000, 4)
    # threshold 0.35 * 0.5 = 0.175: tokens 2 (0.15) and 3 (0.05) are dropped
    out = fixed_sampler()(logits, metadata([SamplingParams(min_p=0.35)] * 2000, 4))
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_reshapes_the_distribution(temperature: float) -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    params = [SamplingParams(temperature=temperature)] * 20000
    out = fixed_sampler()(probs.log().expand(20000, 3), metadata(params, 3))
    assert torch.allclose(frequencies(out.sampled_token_ids, 3), expected, atol=0.02)


# --- Sampler: penalties (vLLM's definitions) ------------------------------------

LOGITS = [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]


def penalised(params: SamplingParams) -> list[float]:
    """Row 0 of a two-row batch whose second row has no penalties (and must be left alone)."""
    md = metadata([params, SamplingParams()], 6, prompts=[PROMPT, PROMPT], outputs=[OUTPUT, OUTPUT])
    assert md.penalties is not None
    logits = apply_penalties(torch.tensor([LOGITS, LOGITS]), md.penalties)
    assert logits[1].tolist() == LOGITS
    return logits[0].tolist()


def test_presence_penalty_subtracts_once_for_tokens_in_the_output() -> None:
    assert penalised(SamplingParams(presence_penalty=0.5)) == [2.0, -1.0, 0.0, -1.0, 3.0, 1.0]


def test_frequency_penalty_subtracts_per_occurrence_in_the_output() -> None:
    assert penalised(SamplingParams(frequency_penalty=0.25)) == [2.0, -1.0, 0.0, -0.75, 3.0, 1.0]


def test_repetition_penalty_shrinks_logits_of_tokens_in_prompt_or_output() -> None:
    # positive / 2, negative * 2, for tokens 0, 1 (prompt) and 2, 3 (output)
    assert penalised(SamplingParams(repetition_penalty=2.0)) == [1.0, -2.0, 0.25, -1.0, 3.0, 1.0]


def test_penalties_combine_repetition_first() -> None:
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    assert penalised(p) == [1.0, -2.0, 0.25 - 0.5 - 0.5, -1.0 - 0.25 - 0.5, 3.0, 1.0]


def test_penalties_steer_greedy_sampling() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    md = metadata([SamplingParams(temperature=0.0, frequency_penalty=2.0)], 3, outputs=[[1]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2]


# --- Sampler: seeds, min_tokens, logprobs -----------------------------------------


def seeded_tokens(position: int, others: list[SamplingParams]) -> list[int]:
    """20 steps of the seed-7 request at ``position`` in a batch with ``others``."""
    vocab = 64
    target = SamplingParams(seed=7, temperature=0.9, top_p=0.95, presence_penalty=0.3)
    params = others[:position] + [target] + others[position:]
    generators = [None if p.seed is None else make_generator(p.seed) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler()  # unseeded rows draw from torch's default generator
    for step in range(20):
        logits = torch.randn(len(params), vocab)
        logits[position] = torch.randn(vocab, generator=make_generator(100 + step))
        md = metadata(
            params, vocab, prompts=[[1, 2, 3]] * len(params), outputs=outputs, generators=generators
        )
        for row, token in enumerate(sampler(logits, md).sampled_token_ids.tolist()):
            outputs[row].append(token)
    return outputs[position]


def test_seeded_request_samples_the_same_tokens_in_any_batch() -> None:
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=10),
        SamplingParams(seed=7, temperature=0.9),
        SamplingParams(min_p=0.1, frequency_penalty=1.0),
        SamplingParams(seed=123, top_p=0.5, logprobs=3),
    ]
    alone = seeded_tokens(0, [])
    assert seeded_tokens(2, others) == alone
    assert seeded_tokens(5, others) == alone
    assert len(set(alone)) > 1  # really sampled, not collapsed to greedy


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[99]),
    ]
    md = metadata(params, 4, outputs=[[5, 5], [5, 5, 5], [5]])
    # row 0 is below min_tokens: EOS and stop id 1 banned; row 1 reached it; row 2 ignores EOS
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, EOS, EOS]


def test_logprobs_are_of_the_raw_logits() -> None:
    logits = torch.randn(3, 40, generator=make_generator(4))
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=2),
        SamplingParams(),
        SamplingParams(temperature=0.0, min_p=0.2, logprobs=5),
    ]
    out = fixed_sampler()(logits, metadata(params, 40, prompts=[[1, 2]] * 3))
    raw = logits.log_softmax(dim=-1)
    lp = out.logprobs
    assert lp is not None
    assert lp.topk_token_ids.shape == lp.topk_logprobs.shape == (3, 5)
    assert torch.equal(lp.topk_logprobs, raw.topk(5).values)
    assert torch.equal(lp.topk_token_ids, raw.topk(5).indices)
    tokens = out.sampled_token_ids
    assert torch.equal(lp.sampled_logprobs, raw[torch.arange(3), tokens])
    assert torch.equal(lp.sampled_ranks, (raw > raw[torch.arange(3), tokens].unsqueeze(1)).sum(-1) + 1)
    assert lp.sampled_ranks[2] == 1  # greedy row took the most likely token
    assert torch.equal(logits, torch.randn(3, 40, generator=make_generator(4)))  # input left unchanged


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    out = Sampler()(torch.randn(2, 10), metadata([SamplingParams(logprobs=0), SamplingParams()], 10))
    assert out.logprobs is not None
    assert out.logprobs.topk_token_ids.shape == (2, 0) and out.logprobs.sampled_logprobs.shape == (2,)


# --- StopChecker -------------------------------------------------------------------


def feed(checker: StopChecker, deltas: Sequence[str]) -> list[str]:
    return [checker.append(d) for d in deltas]


def test_stop_string_spanning_tokens_is_excluded_from_the_output() -> None:
    checker = StopChecker(["\nUser:"])
    streamed = feed(checker, ["Hello", " there\nUs", "er: more"])
    assert checker.stopped and checker.matched_stop == "\nUser:"
    assert checker.text == "Hello there" and "".join(streamed) == "Hello there"


def test_stop_string_is_kept_with_include_stop_str_in_output() -> None:
    checker = StopChecker(["END"], include_stop_str_in_output=True)
    streamed = feed(checker, ["ab E", "ND tail"])
    assert checker.text == "ab END" and "".join(streamed) == "ab END"


def test_the_stop_string_completing_first_wins() -> None:
    checker = StopChecker(["abcd", "bc"])
    checker.append("xabcdy")
    assert checker.matched_stop == "bc" and checker.text == "xa"


def test_stream_holds_back_a_possible_stop_prefix() -> None:
    checker = StopChecker(["###", "STOP"])
    assert checker.append("hello #") == "hello "  # "#" may start "###"
    assert checker.append("#") == ""  # "##" still may
    assert checker.append("!") == "##!"  # "##!" cannot: released
    assert checker.append(" ST") == " "  # "ST" may start "STOP"
    assert checker.append("OP") == ""  # matched: held text was the stop string
    assert checker.text == "hello ##! "


def test_nothing_is_held_back_when_the_tail_is_no_stop_prefix() -> None:
    checker = StopChecker(["###"])
    assert checker.append("abc") == "abc"


def test_flush_releases_held_back_text_at_a_non_stop_finish() -> None:
    checker = StopChecker(["STOP"])
    assert checker.append("go ST") == "go "
    assert checker.flush() == "ST" and checker.text == "go ST" and not checker.stopped


def test_append_after_stop_is_an_error() -> None:
    checker = StopChecker(["x"])
    checker.append("ax")
    with pytest.raises(RuntimeError, match="already stopped"):
        checker.append("b")


def test_penalty_histories_of_different_lengths_count_only_their_own_tokens() -> None:
    """Rows' histories are read as one padded array: what lies past a row's end (a shorter
    row's padding, or an earlier request's tokens left in a batch row) is never counted,
    and a row without penalties is left alone."""
    vocab = 8
    penalty = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    rows = RowSamplingParams(4, vocab)
    for row, p in enumerate([penalty, SamplingParams(), penalty, penalty]):
        rows.set_row(row, p, (), None)
    token_ids = np.array(
        [
            [1, 2, 2, 7, 7, 7],  # prompt [1], output [2, 2]; 7s past the end
            [5, 5, 5, 5, 5, 5],  # not penalized: never read
            [3, 4, 4, 4, 6, 0],  # prompt [3, 4], output [4, 4, 6, 0]
            [6, 6, 7, 7, 7, 7],
        ]
    )  # prompt [6, 6], no output yet
    num_prompt, end = np.array([1, 1, 2, 2]), np.array([3, 6, 6, 2])

    def history(used: np.ndarray) -> TokenHistories:
        assert used.tolist() == [0, 2, 3]
        return TokenHistories(token_ids[used], num_prompt[used], end[used])

    md = rows.gather(np.arange(4), lambda: end - num_prompt, history)
    assert md.penalties is not None
    logits = torch.tensor([[3.0, -1.0, 0.5, -0.5, 2.0, 1.0, -2.0, 4.0]] * 4)
    expected = logits.clone()
    for row in (0, 2, 3):
        seen = set(token_ids[row, : end[row]].tolist())
        output = token_ids[row, num_prompt[row] : end[row]].tolist()
        for token in seen:
            value = expected[row, token].item()
            value = value / 2.0 if value > 0 else value * 2.0
            expected[row, token] = value - 0.25 * output.count(token) - 0.5 * (token in output)
    assert apply_penalties(logits, md.penalties).tolist() == expected.tolist()


def test_async_output_tokens_join_the_penalized_rows_histories() -> None:
    """A token known only after the metadata was built (async scheduling) counts as output."""
    vocab = 6
    rows = RowSamplingParams(3, vocab)
    for row, p in enumerate(
        [SamplingParams(frequency_penalty=1.0), SamplingParams(), SamplingParams(presence_penalty=0.5)]
    ):
        rows.set_row(row, p, (), None)
    history = np.array([[0, 1], [2, 2], [3, 3]])
    md = rows.gather(
        np.arange(3),
        lambda: np.array([1, 1, 1]),
        lambda used: TokenHistories(history[used], np.array([1, 1]), np.array([2, 2])),
    )
    md.add_output_tokens(torch.tensor([0, 2]), torch.tensor([1, 5]))
    logits = apply_penalties(torch.zeros(3, vocab), md.penalties)
    assert logits.tolist() == [[0, -2, 0, 0, 0, 0], [0] * 6, [0, 0, 0, -0.5, 0, -0.5]]


def test_top_k_top_p_on_the_cpu_sort_matches_torch_sort() -> None:
    """The CPU path sorts with numpy; without ties it must mask exactly as torch.sort does."""
    logits = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)) * 4
    top_k = torch.randint(1, 513, (64,), generator=torch.Generator().manual_seed(4))
    top_p = torch.rand(64, generator=torch.Generator().manual_seed(5))
    sorted_logits, order = logits.sort(dim=-1)
    kth_largest = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    outside_nucleus = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)
    outside_nucleus[:, -1] = False
    expected = logits.clone().scatter_(1, order, sorted_logits.masked_fill(outside_nucleus, float("-inf")))
    assert torch.equal(apply_top_k_top_p(logits.clone(), top_k, top_p), expected)
