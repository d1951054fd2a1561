"""Prompt logprobs (vLLM's ``prompt_logprobs``) and prefill-only requests (``max_tokens=0``,
S20) through ``fastsched.LLM`` on the tiny model in fp32, against transformers' own
log-softmax of the same checkpoint.

Tolerance: 1e-4 absolute on each logprob. Both sides are fp32 on the CPU, with different
kernels (paged attention, another GEMM blocking): their differences are ~1e-6; a wrong
row (an off-by-one position, another request's token) is off by whole units.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastsched import LLM, SamplingParams

TOLERANCE = 1e-4
PROMPT_LEN = 45  # three 16-token blocks minus three: a cache hit stops short of the end


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """``reference(prompt)``: transformers' log-softmax at every position, [len, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(prompt: list[int]) -> torch.Tensor:
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return run


def make_llm(tiny_model_dir: Path, **kwargs: object) -> LLM:
    return LLM(
        model=str(tiny_model_dir),
        num_gpu_blocks=64,
        max_model_len=256,
        max_num_seqs=8,
        log_stats_interval=0,
        dtype="float32",
        **kwargs,
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir)


def assert_matches(
    prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int, first_scored: int = 1
) -> None:
    """Entry ``i`` scores ``prompt[i]`` with the logits of position ``i - 1``; the entries
    before ``first_scored`` are None."""
    assert len(prompt_logprobs) == len(prompt)
    assert all(e is None for e in prompt_logprobs[:first_scored])
    for i in range(first_scored, len(prompt)):
        entry, row = prompt_logprobs[i], ref[i - 1]
        token = prompt[i]
        assert token in entry, f"position {i}: the prompt token is always in its entry"
        assert abs(entry[token].logprob - row[token].item()) < TOLERANCE, i
        assert entry[token].rank == int((row >= row[token]).sum())
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < TOLERANCE, (i, t)
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= k)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert torch.allclose(torch.tensor([v for _, v in ranked]), row.topk(k).values, atol=TOLERANCE)
        assert len(entry) in (k, k + 1)


def run(llm: LLM, prompt: list[int], params: SamplingParams):
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def test_prompt_logprobs_equal_transformers_log_softmax(llm, reference, random_prompt) -> None:
    prompt = random_prompt(PROMPT_LEN, seed=11)
    out = run(llm, prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4))
    assert_matches(out.prompt_logprobs, prompt, reference(prompt), k=4)
    assert len(out.outputs[0].token_ids) == 3
    assert run(llm, prompt, SamplingParams(temperature=0, max_tokens=3)).prompt_logprobs is None


def test_s20_max_tokens_0_ends_after_the_prompt_with_no_token(llm, reference, random_prompt) -> None:
    prompt = random_prompt(PROMPT_LEN, seed=12)
    out = run(llm, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    (completion,) = out.outputs
    assert (completion.token_ids, completion.text, completion.finish_reason) == ([], "", "length")
    assert_matches(out.prompt_logprobs, prompt, reference(prompt), k=0)
    assert not llm.engine.has_unfinished_requests()


def test_s19_prompt_logprobs_skip_a_prefix_cache_hit_and_leave_their_blocks_to_others(
    llm, reference, random_prompt
) -> None:
    prompt = random_prompt(PROMPT_LEN, seed=13)
    assert run(llm, prompt, SamplingParams(max_tokens=1)).num_cached_tokens == 0  # caches 2 blocks
    scored = run(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert scored.num_cached_tokens == 0, "skip_reading_prefix_cache defaults to True"
    assert_matches(scored.prompt_logprobs, prompt, reference(prompt), k=2)
    # Set to False, the hit is taken and its positions are not scored (None).
    hit = run(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=2, skip_reading_prefix_cache=False))
    assert hit.num_cached_tokens == 32
    assert_matches(hit.prompt_logprobs, prompt, reference(prompt), k=2, first_scored=33)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_over_chunked_prefill_beside_other_requests(
    tiny_model_dir, reference, random_prompt, async_scheduling: bool
) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    prompts = [random_prompt(PROMPT_LEN, seed=14), random_prompt(30, seed=15), random_prompt(20, seed=16)]
    params = [
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=0, prompt_logprobs=1),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches(outs[0].prompt_logprobs, prompts[0], reference(prompts[0]), k=3)
    assert outs[1].prompt_logprobs is None
    assert_matches(outs[2].prompt_logprobs, prompts[2], reference(prompts[2]), k=1)
    assert len(outs[0].outputs[0].token_ids) == 4 and outs[2].outputs[0].token_ids == []


def test_prompt_logprobs_with_n_2(llm, reference, random_prompt) -> None:
    prompt = random_prompt(20, seed=17)
    out = run(llm, prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, prompt_logprobs=1))
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 5 for o in out.outputs)
    assert_matches(out.prompt_logprobs, prompt, reference(prompt), k=1)


def test_prompt_logprobs_are_bounded_like_logprobs() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in \\[0, 20\\], got 21"):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams().skip_reading_prefix_cache is False
