"""``LLM.generate`` takes vLLM's prompt dicts ({"prompt": ...} / {"prompt_token_ids": ...},
with an optional "cache_salt"), and refuses any other key by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_gpu_blocks=64, max_model_len=128, block_size=16)


def test_dict_prompts_generate_like_plain_ones(
    llm: LLM, random_prompt: Callable[[int, int], list[int]]
) -> None:
    ids = random_prompt(20, 1)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    plain = llm.generate([ids], params, use_tqdm=False)[0]
    as_dict = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert as_dict.prompt_token_ids == ids
    assert as_dict.outputs[0].token_ids == plain.outputs[0].token_ids
    text = llm.generate([{"prompt": "hello there"}], params, use_tqdm=False)[0]
    assert text.prompt == "hello there" and len(text.outputs[0].token_ids) == 4


def test_cache_salt_separates_prefix_caches(llm: LLM, random_prompt: Callable[[int, int], list[int]]) -> None:
    """vLLM's cache_salt: the same prompt under another salt shares no cached block."""
    ids = random_prompt(40, 2)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(prompt: object) -> int | None:
        return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens

    cached({"prompt_token_ids": ids, "cache_salt": "tenant-a"})
    assert cached({"prompt_token_ids": ids, "cache_salt": "tenant-a"}) == 32  # two full blocks
    assert cached({"prompt_token_ids": ids, "cache_salt": "tenant-b"}) == 0
    assert cached({"prompt_token_ids": ids}) == 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, "'multi_modal_data' is not supported"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of"),
        ({"cache_salt": "x"}, "exactly one of"),
        ({"prompt": [1, 2]}, "prompt must be a string"),
        ({"prompt_token_ids": "12"}, "prompt_token_ids must be a list"),
        ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ],
)
def test_bad_prompt_dicts_are_refused_by_name(llm: LLM, prompt: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
