"""LoRA with tensor parallelism (issue 24; docs/lora.md, docs/deploy.md): each rank holds its
slice of every adapter, cut like the base layer (vLLM's scheme, ``fastsched.lora.sharding``),
and follows rank 0's slot plan, which travels with the step's inputs. Greedy tokens of a
batch mixing the base model and two adapters over two gloo ranks equal one rank's.

The slicing and its arithmetic are checked without a process group first: the column-parallel
deltas tile the whole delta, the row-parallel partial deltas (with the base layer's bias on
rank 0 only) sum to it, counted once.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from fastsched import LLM, SamplingParams
from fastsched.distributed.parallel import TensorParallel
from fastsched.lora import LoRARequest, step_wire
from fastsched.lora.adapter import load_adapter
from fastsched.lora.sharding import COLUMN_PARALLEL, local_projection_shapes, shard_adapter
from fastsched.model_loader import load_model_config
from fastsched.models.tp_shard import shard_weight

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MAX_RANK = 8


def _rank(rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, group=None, cpu_group=None, device=torch.device("cpu"))  # type: ignore[arg-type]


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


# ------------------------------------------------------------------ the slices, no process group


def test_column_parallel_deltas_of_the_ranks_tile_the_whole_delta(
    base_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    config = load_model_config(base_dir)
    whole = load_adapter(adapters["full"].path, 1, config, MAX_RANK)
    shards = [shard_adapter(whole, config, _rank(r, 2)) for r in range(2)]
    x = torch.randn(5, config.hidden_size)
    for module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        a, b = whole.weights[1][module]
        assert all(torch.equal(s.weights[1][module][0], a) for s in shards), "A is replicated"
        parts = [x @ s.weights[1][module][0].T @ s.weights[1][module][1].T for s in shards]
        torch.testing.assert_close(torch.cat(parts, dim=1), x @ a.T @ b.T)


@pytest.mark.parametrize("module", ["o_proj", "down_proj"])
def test_row_parallel_partial_outputs_with_their_deltas_sum_to_the_whole_layer_once(
    base_dir: Path, adapters: dict[str, LoRARequest], module: str
) -> None:
    """What each rank adds before the all-reduce: its partial base product, the bias on rank 0
    only, and its partial delta. The sum is the unsharded layer with its delta, each once."""
    config = load_model_config(base_dir)
    whole = load_adapter(adapters["full"].path, 1, config, MAX_RANK)
    in_features, out_features = local_projection_shapes(config, None)[module]
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(7, in_features)
    a, b = whole.weights[0][module]
    expected = x @ weight.T + bias + x @ a.T @ b.T
    prefix = "layers.0.self_attn" if module == "o_proj" else "layers.0.mlp"
    total = torch.zeros(7, out_features)
    for r in range(2):
        tp = _rank(r, 2)
        w_r = shard_weight(f"{prefix}.{module}.weight", weight, config, tp)
        b_r = shard_weight(f"{prefix}.{module}.bias", bias, config, tp)
        a_r, b_lora = shard_adapter(whole, config, tp).weights[0][module]
        assert torch.equal(b_lora, b), "B is replicated"
        x_r = x[:, r * (in_features // 2) : (r + 1) * (in_features // 2)]
        total += x_r @ w_r.T + b_r + x_r @ a_r.T @ b_lora.T
    torch.testing.assert_close(total, expected)


def test_each_projection_is_column_or_row_parallel_like_its_base_layer(base_dir: Path) -> None:
    config = load_model_config(base_dir)
    whole, half = local_projection_shapes(config, None), local_projection_shapes(config, _rank(1, 2))
    for module, (in_features, out_features) in whole.items():
        split = (
            (in_features, out_features // 2)
            if module in COLUMN_PARALLEL
            else (in_features // 2, out_features)
        )
        assert half[module] == split, module


def test_the_step_plan_reaches_the_other_ranks_as_rank_0_made_it() -> None:
    slots = np.array([0, 0, -1, 1, 1, 1], dtype=np.int64)
    loads = [(1, 7, "/adapters/ü-seven"), (0, 3, "/a/three")]
    plan = step_wire.decode(step_wire.encode(loads, slots, frozenset({"qkv_proj", "down_proj"})))
    assert plan.loads == loads
    assert np.array_equal(plan.token_slots, slots)
    assert plan.projections == {"qkv_proj", "down_proj"}


# ------------------------------------------------------------------ two gloo ranks


def _generate(llm: LLM, prompts: Sequence[list[int]], loras: Sequence[LoRARequest | None]) -> list[list[int]]:
    outputs = llm.generate(list(prompts), GREEDY, lora_request=list(loras), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("max_loras", [2, 1], ids=["both-adapters-in-slots", "one-slot-reloaded"])
def test_tp2_batch_of_two_adapters_and_the_base_model_gives_the_tokens_of_tp1(
    base_dir: Path, adapters: dict[str, LoRARequest], max_loras: int
) -> None:
    """A 256-token budget for 291 prompt tokens: the first step (over DENSE_MAX_TOKENS) takes
    the segmented (sgmv) path, a prompt is chunked, the decodes take the dense (bgmv) one, on
    both ranks. With one slot the adapters take turns in it (S7), so the other rank's slot
    is rewritten as rank 0's is."""
    prompts = [_prompt(n, seed) for seed, n in enumerate([9, 40, 150, 17, 70, 5])]
    names = ["full", None, "qv", "qv", "full", None]
    loras = [adapters[n] if n else None for n in names]
    args = dict(
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=MAX_RANK,
        num_gpu_blocks=256,
        max_model_len=512,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        dtype="float32",
        num_threads=1,
        log_stats_interval=0,
    )
    reference = _generate(LLM(str(base_dir), **args), prompts, loras)
    llm = LLM(str(base_dir), tensor_parallel_size=2, **args)
    try:
        assert _generate(llm, prompts, loras) == reference
    finally:
        llm.shutdown()
