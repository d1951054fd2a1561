"""``--quantization int8`` / ``fp8`` (a dense checkpoint's projections 8-bit, one scale a
channel) through the whole engine: prefix-cache hits (S8) give the tokens computed without
them. LoRA, speculative decoding and structured outputs over these weights: test_spec_decode.py."""

from __future__ import annotations

import pytest

from fastsched import LLM, SamplingParams
from fastsched.models.channel_quant_linear import ChannelQuantLinear

KINDS = ("int8", "fp8")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", KINDS)
def test_s8_prefix_hits_on_8bit_weights_give_the_tokens_computed_without_the_cache(
    tiny_model_dir, random_prompt, kind: str
) -> None:
    prefix = random_prompt(48, 1)
    prompts = [prefix + random_prompt(n, 10 + n) for n in (5, 9, 17)]
    uncached = LLM(
        model=str(tiny_model_dir), quantization=kind, enable_prefix_caching=False, log_stats_interval=0
    )
    expected = _greedy(uncached, prompts)
    cached = LLM(model=str(tiny_model_dir), quantization=kind, log_stats_interval=0)
    model = cached.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, ChannelQuantLinear)
    assert _greedy(cached, prompts) == expected
    hits = cached.engine.scheduler.stats()["prefix_cache_hits"]
    assert hits >= 2 * 48  # the later two prompts share the first one's three full blocks
    assert _greedy(cached, prompts) == expected
    assert cached.engine.scheduler.stats()["prefix_cache_hits"] > hits
