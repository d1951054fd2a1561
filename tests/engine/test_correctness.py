"""Greedy decoding through ``fastsched.LLM`` gives transformers' tokens, whatever the
engine does between steps: one big step or chunked prefills, prefix-cache hits or
none, preemptions and recomputation, either queue policy.

fp32 on CPU, the tiny checkpoint and the tiny Gemma 3 (sliding-window layers of 16 tokens,
which the prompts, chunks, prefix hits and recomputations all reach past). Prompts are
token ids (no tokenizer in the loop) of lengths 3..80 with different ``max_tokens``, so
requests join and leave the batch at different steps. EOS is ignored on both sides so
every request runs its full length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams

PROMPT_LENGTHS = (3, 11, 26, 41, 63, 80)
MAX_TOKENS = (16, 24, 20, 17, 23, 18)
BLOCK_SIZE = 16  # the engine's default
SHARED_PREFIX_LEN = 3 * BLOCK_SIZE
SUFFIX_LENGTHS = (5, 12, 20, 33)
SUFFIX_MAX_TOKENS = (20, 16, 24, 18)
# A pool of 8 usable blocks (128 tokens) for requests of up to 80 + 24 tokens: it
# cannot hold two of the long ones at once, so running requests must be preempted.
SMALL_POOL = dict(num_gpu_blocks=9, max_model_len=128)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request: pytest.FixtureRequest) -> tuple[Path, Callable]:
    """(checkpoint directory, its transformers greedy reference)."""
    if request.param == "gemma3":
        return request.getfixturevalue("gemma3_model_dir"), request.getfixturevalue("gemma3_greedy_reference")
    return request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("greedy_reference")


@pytest.fixture(scope="module")
def mixed_prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    return [random_prompt(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def shared_prefix_prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    prefix = random_prompt(SHARED_PREFIX_LEN, seed=100)
    return [prefix + random_prompt(n, seed=101 + i) for i, n in enumerate(SUFFIX_LENGTHS)]


def make_llm(model_dir: Path, **engine_args: object) -> LLM:
    return LLM(model=str(model_dir), log_stats_interval=0, **engine_args)


def greedy(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_tokens_match_transformers_with_the_default_config(model, mixed_prompts) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir)
    assert greedy(llm, mixed_prompts, MAX_TOKENS) == greedy_reference(mixed_prompts, MAX_TOKENS)


def test_chunked_prefill_under_a_small_token_budget_gives_the_tokens_of_transformers(
    model, mixed_prompts
) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=16)
    assert greedy(llm, mixed_prompts, MAX_TOKENS) == greedy_reference(mixed_prompts, MAX_TOKENS)
    # S1: no step computed more than 16 tokens (the last sampled token is never computed).
    computed = sum(PROMPT_LENGTHS) + sum(MAX_TOKENS) - len(PROMPT_LENGTHS)
    assert llm.engine.scheduler.stats()["num_steps"] >= -(-computed // 16)


def test_s8_prompts_sharing_a_prefix_hit_the_cache_and_give_the_tokens_of_transformers(
    model, shared_prefix_prompts
) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir)
    expected = greedy_reference(shared_prefix_prompts, SUFFIX_MAX_TOKENS)
    # Same step: blocks are cached when scheduled, so the later prompts hit the first one's prefix.
    assert greedy(llm, shared_prefix_prompts, SUFFIX_MAX_TOKENS) == expected
    first_hits = llm.engine.scheduler.stats()["prefix_cache_hits"]
    assert first_hits == (len(SUFFIX_LENGTHS) - 1) * SHARED_PREFIX_LEN
    # A later call: every prompt hits its own full blocks, left cached by the first call.
    assert greedy(llm, shared_prefix_prompts, SUFFIX_MAX_TOKENS) == expected
    assert llm.engine.scheduler.stats()["prefix_cache_hits"] > first_hits + SHARED_PREFIX_LEN * len(
        SUFFIX_LENGTHS
    )


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_s4_preempted_requests_resume_with_the_tokens_of_transformers(
    model, mixed_prompts, enable_prefix_caching: bool
) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir, **SMALL_POOL, enable_prefix_caching=enable_prefix_caching)
    assert greedy(llm, mixed_prompts, MAX_TOKENS) == greedy_reference(mixed_prompts, MAX_TOKENS)
    assert llm.engine.scheduler.stats()["num_preemptions_total"] > 0


def test_s8_without_prefix_caching_nothing_hits_and_tokens_match_transformers(
    model, shared_prefix_prompts
) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir, enable_prefix_caching=False)
    expected = greedy_reference(shared_prefix_prompts, SUFFIX_MAX_TOKENS)
    assert greedy(llm, shared_prefix_prompts, SUFFIX_MAX_TOKENS) == expected
    assert greedy(llm, shared_prefix_prompts, SUFFIX_MAX_TOKENS) == expected
    assert llm.engine.scheduler.stats()["prefix_cache_hits"] == 0


def test_s3_priority_policy_preempts_and_gives_the_tokens_of_transformers(model, mixed_prompts) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir, **SMALL_POOL, policy="priority")
    assert greedy(llm, mixed_prompts, MAX_TOKENS) == greedy_reference(mixed_prompts, MAX_TOKENS)
    assert llm.engine.scheduler.stats()["num_preemptions_total"] > 0


def test_s4_s8_chunking_prefix_hits_and_preemption_together_give_the_tokens_of_transformers(
    model, mixed_prompts, shared_prefix_prompts
) -> None:
    model_dir, greedy_reference = model
    llm = make_llm(model_dir, **SMALL_POOL, max_num_batched_tokens=16, max_num_seqs=16)
    prompts = [p for pair in zip(mixed_prompts, shared_prefix_prompts) for p in pair] + mixed_prompts[4:]
    max_tokens = [n for pair in zip(MAX_TOKENS, SUFFIX_MAX_TOKENS) for n in pair] + list(MAX_TOKENS[4:])
    assert greedy(llm, prompts, max_tokens) == greedy_reference(prompts, max_tokens)
    stats = llm.engine.scheduler.stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["prefix_cache_hits"] + stats["prefix_cache_preempted_hits"] > 0
