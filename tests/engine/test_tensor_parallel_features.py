"""Tensor parallelism combined with speculative decoding and structured outputs (issue 24;
docs/deploy.md "Tensor parallelism"): both run on rank 0 only (the drafter, the rejection
sampler and the bitmask read the logits gathered there; the other ranks compute the same
rows for the gather), so with two gloo ranks in fp32 an engine gives the greedy tokens and
the constrained texts of the unsharded one.

One engine per (configuration, tensor_parallel_size) runs both the drafted prompts and the
constrained requests: with a drafter the constrained rows take the verification path's
mask (S17, a step emits several tokens per request), without one async scheduling's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from fastsched import LLM, SamplingParams

PROMPT_LENGTHS = (3, 11, 26, 41, 63)
MAX_TOKENS = 16
SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["small", "large"]}, "count": {"type": "integer", "maximum": 99}},
    "required": ["size", "count"],
    "additionalProperties": False,
}
CONSTRAINED = [
    SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA}),
    SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": r"[a-f]{4,9}"}),
]
# 8 usable blocks of 16 tokens, prompts of up to 63 + 16: requests are preempted.
SMALL_POOL = dict(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16)


def _ngram() -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _draft_model(model_dir: Path) -> dict[str, object]:
    return {"model": str(model_dir), "num_speculative_tokens": 3}


DRAFTERS: dict[str, Callable[[Path], dict[str, object] | None]] = {
    "ngram": lambda _: _ngram(),
    "draft-model": _draft_model,
    "no-drafter-async": lambda _: None,
}


@pytest.fixture(scope="module")
def repetitive_prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    """Prompts that repeat a phrase, so that n-gram lookup finds drafts."""
    return [(random_prompt(max(2, n // 4), seed=i) * 4)[:n] for i, n in enumerate(PROMPT_LENGTHS)]


def _run(
    model_dir: Path, prompts: list[list[int]], spec: dict[str, object] | None, tp: int
) -> tuple[list[list[int]], list[str], tuple[int, int]]:
    """(greedy tokens, constrained texts, (drafts, accepted)) of one engine; its workers are stopped."""
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        log_stats_interval=0,
        num_threads=1,
        speculative_config=spec,
        tensor_parallel_size=tp,
        **SMALL_POOL,
    )
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        texts = [
            o.outputs[0].text
            for o in llm.generate(["Describe a box:", "two two"], CONSTRAINED, use_tqdm=False)
        ]
        counters = llm.engine.spec_counters
        return (
            tokens,
            texts,
            (0, 0) if counters is None else (counters.num_draft_tokens, counters.num_accepted_tokens),
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize("drafter", DRAFTERS, ids=list(DRAFTERS))
def test_tp2_drafted_and_constrained_outputs_equal_tp1(
    tiny_model_dir: Path, repetitive_prompts: list[list[int]], drafter: str
) -> None:
    spec = DRAFTERS[drafter](tiny_model_dir)
    tokens, texts, (drafts, accepted) = _run(tiny_model_dir, repetitive_prompts, spec, tp=2)
    assert (tokens, texts) == _run(tiny_model_dir, repetitive_prompts, spec, tp=1)[:2]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert 4 <= len(texts[1]) <= 9 and set(texts[1]) <= set("abcdef")
    if spec is not None:
        assert accepted > 0
    if (
        drafter == "draft-model"
    ):  # the target drafting for itself, unsharded on rank 0: every greedy draft holds
        assert accepted == drafts
