"""The prompt-logprobs plan (which rows of a step score which prompt tokens) and its scoring a
chunk of rows at a time (``sample/prompt_logprobs.py``), without a model."""

from __future__ import annotations

import numpy as np
import torch

from fastsched.sample.prompt_logprobs import (
    PromptLogprobsStore,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)

TOKENS = {7: np.arange(100, 120), 8: np.arange(200, 206), 9: np.arange(300, 310)}


def test_plan_scores_each_computed_position_but_the_prompts_last_with_the_next_token() -> None:
    # Request 7 computes positions 4..11 of 20, request 8 (no prompt logprobs) 0..5, request 9
    # its last chunk 6..9 of a 10-token prompt: position 9 samples and scores nothing.
    plan = plan_prompt_logprobs(
        np.array([7, 8, 9]),
        np.array([4, 0, 6]),
        np.array([8, 6, 4]),
        np.array([20, 6, 10]),
        np.array([2, -1, 0]),
        TOKENS.__getitem__,
    )
    assert plan is not None
    assert plan.flat_indices.tolist() == [*range(8), 14, 15, 16]
    assert plan.target_ids.tolist() == [*range(105, 113), 307, 308, 309]
    assert plan.row_positions().tolist() == [*range(4, 12), 6, 7, 8]
    assert plan.row_handles().tolist() == [7] * 8 + [9] * 3
    assert (plan.num_top, plan.top_k.tolist()) == (2, [2, 0])
    none = plan_prompt_logprobs(
        np.array([8]), np.array([0]), np.array([6]), np.array([6]), np.array([-1]), TOKENS.__getitem__
    )
    assert none is None


def test_logits_are_computed_a_chunk_of_rows_at_a_time_and_only_for_planned_rows() -> None:
    plan = plan_prompt_logprobs(
        np.array([7]), np.array([0]), np.array([20]), np.array([20]), np.array([1]), TOKENS.__getitem__
    )
    assert plan is not None
    hidden = torch.randn(20, 8)
    head = torch.randn(8, 400)
    calls = []

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows @ head

    scored = compute_prompt_logprobs(hidden, plan, compute_logits, chunk=8)
    assert calls == [8, 8, 3]  # 19 rows: position 19 is the sampling row
    full = (hidden[:19] @ head).log_softmax(-1)
    expected = full.gather(1, torch.from_numpy(plan.target_ids)[:, None]).squeeze(1)
    assert torch.allclose(scored.logprobs.sampled_logprobs, expected, atol=1e-6)
    ((handle, start, entries),) = scored.entries()
    assert (handle, start, len(entries)) == (7, 0, 19)
    assert entries[0][101] == (expected[0].item(), int((full[0] >= full[0, 101]).sum()))


def test_store_drops_what_a_restarted_prefill_recomputes_and_pads_unscored_positions() -> None:
    store = PromptLogprobsStore()
    store.add(1, 0, [{5: (-1.0, 1)}, {6: (-2.0, 1)}])
    store.add(1, 0, [{5: (-1.5, 1)}])  # preempted and recomputed from position 0
    store.add(1, 1, [{6: (-2.5, 1)}, {7: (-3.0, 2)}])
    assert store.take(1, 4) == [None, {5: (-1.5, 1)}, {6: (-2.5, 1)}, {7: (-3.0, 2)}]
    store.add(2, 8, [{9: (-0.5, 1)}])  # a prefix-cache hit of 8 tokens, unscored
    assert store.take(2, 10) == [None] * 9 + [{9: (-0.5, 1)}]
