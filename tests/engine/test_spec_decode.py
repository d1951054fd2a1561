"""Speculative decoding through ``fastsched.LLM`` (S17): greedy outputs are token-identical
to transformers' with and without drafts, whatever else the engine does (chunked prefill,
prefix hits, preemption), the drafts are in the step's scheduled tokens, and max_tokens
and stops hold exactly although a step may accept several tokens.

fp32 on CPU, the tiny checkpoint. The draft-model drafter is the tiny model itself, so
every greedy draft is accepted and each step emits ``k + 1`` tokens; n-gram drafts come
from prompts that repeat a phrase.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.lora import LoRARequest
from fastsched.tools.tiny_lora import make_tiny_lora
from fastsched.tools.tiny_model import make_tiny_model

K = 3
PROMPT_LENGTHS = (3, 11, 26, 41, 63, 80)
MAX_TOKENS = (16, 24, 20, 17, 23, 18)
SMALL_POOL = dict(num_gpu_blocks=9, max_model_len=128)  # as test_correctness: forces preemptions


def ngram(k: int = K) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def draft_model(model_dir: Path, k: int = K) -> dict[str, object]:
    return {"model": str(model_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def repetitive_prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    """Prompts that repeat a phrase (so n-gram lookup finds matches), of several lengths."""
    return [(random_prompt(max(2, n // 4), seed=i) * 4)[:n] for i, n in enumerate(PROMPT_LENGTHS)]


def make_llm(model_dir: Path, spec: dict[str, object] | None, **engine_args: object) -> LLM:
    return LLM(model=str(model_dir), log_stats_interval=0, speculative_config=spec, **engine_args)


def greedy(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


CONFIGS = {
    "default": {},
    "chunked-prefill": dict(max_num_batched_tokens=16, max_num_seqs=16),
    "preemption": SMALL_POOL,
    "chunked-preemption": dict(**SMALL_POOL, max_num_batched_tokens=16, max_num_seqs=16),
    "preemption-no-prefix-caching": dict(**SMALL_POOL, enable_prefix_caching=False),
    "priority-preemption": dict(**SMALL_POOL, policy="priority"),
}


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_s17_greedy_tokens_with_drafts_match_transformers(
    tiny_model_dir, repetitive_prompts, greedy_reference, drafter: str, config: str
) -> None:
    spec = ngram() if drafter == "ngram" else draft_model(tiny_model_dir)
    llm = make_llm(tiny_model_dir, spec, **CONFIGS[config])
    assert greedy(llm, repetitive_prompts, MAX_TOKENS) == greedy_reference(repetitive_prompts, MAX_TOKENS)
    counters = llm.engine.spec_counters
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens > 0
    if drafter == "draft-model":  # the target drafting for itself: every greedy draft holds
        assert counters.num_accepted_tokens == counters.num_draft_tokens
    if config in ("preemption", "preemption-no-prefix-caching", "priority-preemption"):
        assert llm.engine.scheduler.stats()["num_preemptions_total"] > 0


@pytest.mark.parametrize("config", ["default", "chunked-preemption"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_s17_gemma3_greedy_tokens_with_drafts_match_transformers(
    gemma3_model_dir, repetitive_prompts, gemma3_greedy_reference, drafter: str, config: str
) -> None:
    """The tiny Gemma 3 (sliding-window layers of 16 tokens) as target and draft: verification
    rows past the window see the same keys as one-token decodes."""
    spec = ngram() if drafter == "ngram" else draft_model(gemma3_model_dir)
    llm = make_llm(gemma3_model_dir, spec, **CONFIGS[config])
    expected = gemma3_greedy_reference(repetitive_prompts, MAX_TOKENS)
    assert greedy(llm, repetitive_prompts, MAX_TOKENS) == expected
    counters = llm.engine.spec_counters
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens > 0
    if drafter == "draft-model":
        assert counters.num_accepted_tokens == counters.num_draft_tokens


def test_s8_prefix_hits_with_drafts_give_the_tokens_of_transformers(
    tiny_model_dir, random_prompt, greedy_reference
) -> None:
    prefix = random_prompt(48, seed=100) * 2
    prompts = [prefix + random_prompt(n, seed=101 + i) for i, n in enumerate((5, 12, 20))]
    llm = make_llm(tiny_model_dir, ngram())
    expected = greedy_reference(prompts, [20, 16, 24])
    assert greedy(llm, prompts, [20, 16, 24]) == expected
    assert greedy(llm, prompts, [20, 16, 24]) == expected
    assert llm.engine.scheduler.stats()["prefix_cache_hits"] > 0


def test_speculation_turns_async_scheduling_off(tiny_model_dir) -> None:
    llm = make_llm(tiny_model_dir, ngram(), async_scheduling=True)
    assert llm.engine.num_steps_in_flight == 0 and llm.engine._executor is None


def test_s1_a_steps_scheduled_tokens_include_its_drafts(tiny_model_dir, random_prompt) -> None:
    llm = make_llm(tiny_model_dir, draft_model(tiny_model_dir))
    engine = llm.engine
    prompt = random_prompt(10, seed=7)
    engine.add_request(
        EngineCoreRequest("r", prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    )
    scheduled, emitted = [], []
    while engine.has_unfinished_requests():
        before = engine.stats.iteration_tokens_sum
        batch = engine.step()
        scheduled.append(engine.stats.iteration_tokens_sum - before)
        emitted.append(len(batch.token_ids))
    # The prefill samples one token; each later step verifies K drafts after one real token
    # and, the drafter being the target, emits all K + 1. (A last step may only report the finish.)
    assert scheduled[:3] == [10, 1 + K, 1 + K] and not any(scheduled[3:])
    assert emitted[:3] == [1, 1 + K, 1 + K] and not any(emitted[3:])


def test_max_tokens_is_exact_when_a_step_accepts_more_than_is_left(
    tiny_model_dir, random_prompt, greedy_reference
) -> None:
    llm = make_llm(tiny_model_dir, draft_model(tiny_model_dir))
    prompt = random_prompt(12, seed=3)
    for max_tokens in (1, 2, 6, 7):  # 1 + 4 + 4 ... cut inside an accepted run
        (out,) = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
        )
        assert out.outputs[0].token_ids == greedy_reference([prompt], [max_tokens])[0]
        assert out.outputs[0].finish_reason == "length"


def test_a_stop_token_among_accepted_drafts_ends_the_output_there(
    tiny_model_dir, random_prompt, greedy_reference
) -> None:
    prompt = random_prompt(12, seed=3)
    reference = greedy_reference([prompt], [16])[0]
    j = next(i for i in range(2, 16) if reference[i] not in reference[:i])  # inside a run of K + 1
    llm = make_llm(tiny_model_dir, draft_model(tiny_model_dir))
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[reference[j]]), use_tqdm=False
    )
    assert out.outputs[0].token_ids == reference[: j + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", reference[j])
    assert not llm.engine.has_unfinished_requests()


def test_stop_strings_give_the_text_of_the_engine_without_drafts(tiny_model_dir) -> None:
    prompts = ["def hello(world):", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=20)
    texts = []
    for spec in (None, draft_model(tiny_model_dir), ngram()):
        llm = make_llm(tiny_model_dir, spec)
        base = llm.generate(prompts, params, use_tqdm=False)
        stops = [o.outputs[0].text[6:9] for o in base]
        outs = llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=20, stop=s) for s in stops], use_tqdm=False
        )
        texts.append(
            [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in [*base, *outs]]
        )
        assert all(reason == "stop" for _, _, reason in texts[-1][2:])
    assert texts[1] == texts[0] and texts[2] == texts[0]


def test_penalties_and_min_tokens_see_the_drafts_before_each_position(
    tiny_model_dir, repetitive_prompts
) -> None:
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=20,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            min_tokens=12,
        )
    ] * 3
    prompts = repetitive_prompts[2:5]
    expected = [
        o.outputs[0].token_ids
        for o in make_llm(tiny_model_dir, None).generate(prompts, params, use_tqdm=False)
    ]
    for spec in (draft_model(tiny_model_dir), ngram()):
        llm = make_llm(tiny_model_dir, spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_random_sampling_and_logprobs_run_with_drafts(tiny_model_dir, repetitive_prompts) -> None:
    llm = make_llm(tiny_model_dir, draft_model(tiny_model_dir))
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=15, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, logprobs=2),
    ]
    outs = llm.generate(repetitive_prompts[:3], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [15, 15, 15]
    logprobs = outs[2].outputs[0].logprobs
    assert len(logprobs) == 15 and all(t in entry for t, entry in zip(outs[2].outputs[0].token_ids, logprobs))
    assert llm.engine.spec_counters.num_accepted_tokens > 0


def test_the_stats_line_reports_the_acceptance_rate(tiny_model_dir, repetitive_prompts, caplog) -> None:
    llm = LLM(
        model=str(tiny_model_dir), log_stats_interval=1e-9, speculative_config=draft_model(tiny_model_dir)
    )
    with caplog.at_level(logging.INFO, logger="fastsched.engine"):
        greedy(llm, repetitive_prompts[:2], [9, 9])
    lines = [r.getMessage() for r in caplog.records if "draft acceptance rate" in r.getMessage()]
    assert lines and all(
        "draft acceptance rate: 100.0%, mean acceptance length: 4.00" in line for line in lines
    )


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_up(tiny_model_dir, tmp_path) -> None:
    other = make_tiny_model(tmp_path / "other", vocab_size=512)
    with pytest.raises(ValueError, match=r"vocab_size \(512\) differs from the target model's \(1024\)"):
        make_llm(tiny_model_dir, draft_model(other))


@pytest.mark.parametrize("weights", ["fp32", "int8", "fp8"])
def test_constrained_requests_beside_speculated_ones_keep_their_grammar(tiny_model_dir, weights: str) -> None:
    """Structured outputs: a constrained request gets no drafts (its mask applies at its one
    emitted position), so its output is the engine's without drafts, next to requests that
    speculate; on dense and on 8-bit weights."""
    schema = {
        "type": "object",
        "properties": {"size": {"enum": ["small", "large"]}},
        "required": ["size"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema}),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": r"[a-f]{4,9}"}),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    prompts = ["Describe a box:", "letters", "def main():"]
    texts = []
    for spec in (None, draft_model(tiny_model_dir)):
        llm = make_llm(tiny_model_dir, spec, **WEIGHTS[weights])
        texts.append(
            [
                (o.outputs[0].text, o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)
            ]
        )
    assert texts[1] == texts[0]
    assert llm.engine.spec_counters.num_accepted_tokens > 0


# The model's weights as served: dense fp32, 4-bit (the int4 kernel, bf16 inside), 4-bit with bf16 activations and KV,
# 8-bit projections (int8 kernel; fp8 upcast on CPU).
WEIGHTS = {
    "fp32": {},
    "int4": {"quantization": "int4"},
    "int4-bf16": {"quantization": "int4", "dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
}


@pytest.mark.parametrize("weights", WEIGHTS)
def test_lora_requests_with_drafts_give_their_adapters_tokens_without(
    tiny_model_dir, repetitive_prompts, tmp_path, weights: str
) -> None:
    """The drafter knows nothing of adapters; verification runs the target with each row's
    adapter, so a request's greedy tokens are its adapter's, drafts or not; on dense and on
    4-bit weights (LoRA's delta is added to the quantized layer's output)."""
    adapter = make_tiny_lora(tiny_model_dir, tmp_path / "a", rank=8, seed=1)
    lora = [LoRARequest("a", 1, str(adapter)), None, LoRARequest("a", 1, str(adapter))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for spec in (None, ngram(), draft_model(tiny_model_dir)):
        llm = make_llm(
            tiny_model_dir, spec, enable_lora=True, max_loras=2, max_lora_rank=8, **WEIGHTS[weights]
        )
        prompts = [repetitive_prompts[2], repetitive_prompts[2], repetitive_prompts[3]]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert tokens[0][0] != tokens[0][1]  # the adapter changes the output: it was applied
