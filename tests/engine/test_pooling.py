"""Pooling requests (``EngineCoreRequest.pooling``, the gateway's /v1/embeddings) as S20
prefill-only requests: the step that computes the last prompt token reports its hidden
state, L2-normalised, and that step's update finishes the request as length-capped with no
token, whether the prompt takes one step or several (chunked prefill), beside requests that
generate, with and without async scheduling.

The reference is transformers' last hidden state (after the final norm) of the same fp32
checkpoint, normalised. Tolerance 1e-4 per component: both sides are fp32 on the CPU with
different kernels (~1e-6 apart); the hidden state of another position or request is off by
far more.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreOutput, EngineCoreRequest
from fastsched.sampling_params import SamplingParams

TOLERANCE = 1e-4
PROMPT_LEN = 45


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """``reference(prompt)``: the normalised last hidden state of the prompt's last token."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(prompt: list[int]) -> np.ndarray:
        last = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        return torch.nn.functional.normalize(last.float(), dim=-1).numpy()

    return run


def run_to_end(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[EngineCoreOutput]]:
    for request in requests:
        core.add_request(request)
    deltas: dict[str, list[EngineCoreOutput]] = defaultdict(list)
    while core.has_unfinished_requests():
        for out in core.step():
            assert not any(o.finish_reason for o in deltas[out.request_id]), "a delta after the finish"
            deltas[out.request_id].append(out)
    return deltas


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_num_batched_tokens", [256, 16])  # one step; three chunks
def test_s20_a_pooling_request_ends_with_its_embedding_and_no_token(
    tiny_model_dir, reference, random_prompt, async_scheduling, max_num_batched_tokens
) -> None:
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=str(tiny_model_dir),
            log_stats_interval=0,
            dtype="float32",
            num_gpu_blocks=64,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
        )
    )
    prompt, other = random_prompt(PROMPT_LEN, seed=3), random_prompt(20, seed=4)
    deltas = run_to_end(
        core,
        [
            EngineCoreRequest("embed", prompt, SamplingParams(max_tokens=0), pooling=True),
            EngineCoreRequest("gen", other, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        ],
    )
    embed = deltas["embed"]
    assert [o.finish_reason for o in embed][-1] == "length"
    assert [t for o in embed for t in o.new_token_ids] == []
    pooled = [o.pooled for o in embed if o.pooled is not None]
    assert len(pooled) == 1 and embed[-1].pooled is not None, "once, with the finish"
    np.testing.assert_allclose(pooled[0], reference(prompt), atol=TOLERANCE)
    assert sum(len(o.new_token_ids) for o in deltas["gen"]) == 5
    assert all(o.pooled is None for o in deltas["gen"])
    core.shutdown()


def test_s20_pooling_requests_of_one_step_each_get_their_own_embedding(
    tiny_model_dir, reference, random_prompt
) -> None:
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=str(tiny_model_dir),
            log_stats_interval=0,
            dtype="float32",
            num_gpu_blocks=64,
            max_model_len=256,
            max_num_seqs=8,
        )
    )
    prompts = [random_prompt(n, seed=10 + n) for n in (7, 30, 18)]
    deltas = run_to_end(
        core,
        [
            EngineCoreRequest(f"e{i}", p, SamplingParams(max_tokens=0), pooling=True)
            for i, p in enumerate(prompts)
        ],
    )
    for i, prompt in enumerate(prompts):
        (out,) = deltas[f"e{i}"]
        assert out.finish_reason == "length" and out.new_token_ids == []
        np.testing.assert_allclose(out.pooled, reference(prompt), atol=TOLERANCE)
    core.shutdown()
