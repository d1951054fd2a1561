"""Tensor parallelism (issue 24; docs/deploy.md "Tensor parallelism"): a model sharded over
two gloo ranks on the CPU gives, greedy and in fp32, the tokens of the unsharded model,
whatever the scheduler does between steps (chunked prefill, prefix hits, preemption); a
dead worker fails the engine; shutting down leaves no worker behind.

The shard layout itself (which rows and columns a rank holds) is checked without any
process group: a :class:`TensorParallel` whose collectives are never called.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from fastsched import LLM, SamplingParams
from fastsched.config import EngineConfig
from fastsched.distributed.parallel import TensorParallel, data_parallel_devices
from fastsched.kernels.quant_matmul import Int4Weight
from fastsched.model_loader import load_model_config
from fastsched.models.config import ModelConfig
from fastsched.models.tp_shard import describe_head_split, head_ranges, local_heads, shard_weight

PROMPT_LENGTHS = (3, 11, 26, 41, 63, 80)
MAX_TOKENS = (16, 24, 20, 17, 23, 18)
# 8 usable blocks of 16 tokens for prompts of up to 80 + 24 tokens: requests are preempted.
SMALL_POOL = dict(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=16)


def _rank(rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, group=None, cpu_group=None, device=torch.device("cpu"))  # type: ignore[arg-type]


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _greedy(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    prefix = random_prompt(48, seed=100)  # three shared blocks: prefix-cache hits
    mixed = [random_prompt(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    return mixed + [prefix + random_prompt(n, seed=101 + i) for i, n in enumerate((5, 12, 20))]


# ------------------------------------------------------------------ the shard layout


def test_column_parallel_rows_and_row_parallel_columns_tile_the_weight(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    full = torch.randn(config.intermediate_size, config.hidden_size)
    down = torch.randn(config.hidden_size, config.intermediate_size)
    gate = [shard_weight("layers.0.mlp.gate_proj.weight", full, config, _rank(r, 2)) for r in range(2)]
    cols = [shard_weight("layers.0.mlp.down_proj.weight", down, config, _rank(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat(gate), full)
    assert torch.equal(torch.cat(cols, dim=1), down)


def test_row_parallel_bias_is_added_by_rank_0_only(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    bias = torch.randn(config.hidden_size)
    assert torch.equal(shard_weight("layers.0.self_attn.o_proj.bias", bias, config, _rank(0, 2)), bias)
    assert not shard_weight("layers.0.self_attn.o_proj.bias", bias, config, _rank(1, 2)).any()


def test_vocab_shards_are_padded_to_equal_rows_and_cover_the_vocabulary(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    vocab = config.vocab_size + 1  # odd: the last rank's shard is padded
    config = type(config)(**{**config.__dict__, "vocab_size": vocab})
    embed = torch.randn(vocab, config.hidden_size)
    shards = [shard_weight("embed_tokens.weight", embed, config, _rank(r, 2)) for r in range(2)]
    assert shards[0].shape == shards[1].shape == (-(-vocab // 2), config.hidden_size)
    assert torch.equal(torch.cat(shards)[:vocab], embed)
    assert not torch.cat(shards)[vocab:].any()


def test_fewer_kv_heads_than_ranks_replicates_the_kv_head_each_rank_reads(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)  # 4 query heads, 2 KV heads
    k = torch.randn(config.num_kv_heads * config.head_dim, config.hidden_size)
    hd = config.head_dim
    assert local_heads(config, _rank(0, 4)) == (1, 1)
    # Ranks 0 and 1 hold query heads 0 and 1, both of which read KV head 0.
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert torch.equal(
            shard_weight("layers.0.self_attn.k_proj.weight", k, config, _rank(rank, 4)),
            k[head * hd : (head + 1) * hd],
        )


def test_int4_weights_shard_before_packing_and_dequantize_to_the_dense_shards(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    dense = torch.randn(config.hidden_size, config.intermediate_size)
    quantized = Int4Weight.quantize(dense)
    for rank in range(2):
        shard = shard_weight("layers.0.mlp.down_proj.weight", quantized, config, _rank(rank, 2))
        assert isinstance(shard, Int4Weight)
        width = config.intermediate_size // 2
        assert torch.equal(shard.dequantize(), quantized.dequantize()[:, rank * width : (rank + 1) * width])


def test_int4_row_parallel_shard_not_in_whole_groups_is_refused_naming_the_layer(
    tiny_model_dir: Path,
) -> None:
    config = load_model_config(tiny_model_dir)  # o_proj is 64 columns wide: 16 per rank at 4 ranks
    weight = Int4Weight.quantize(torch.randn(config.hidden_size, config.num_heads * config.head_dim))
    with pytest.raises(ValueError, match="o_proj.weight.*groups of 32"):
        shard_weight("layers.0.self_attn.o_proj.weight", weight, config, _rank(1, 4))


def test_kv_heads_that_neither_split_nor_replicate_evenly_are_refused_naming_the_counts(
    tiny_model_dir: Path,
) -> None:
    config = load_model_config(tiny_model_dir)  # 4 query heads, 2 KV heads: 3 ranks cannot share 2 KV heads
    with pytest.raises(
        ValueError, match="4 attention heads and 2 KV heads do not split over tensor_parallel_size 3"
    ):
        local_heads(config, _rank(0, 3))
    with pytest.raises(ValueError, match="tensor_parallel_size 8"):  # more ranks than query heads
        local_heads(config, _rank(0, 8))


@pytest.fixture(scope="module")
def smollm2_config() -> ModelConfig:
    return load_model_config(None)  # the embedded GGUF: 9 query heads, 3 KV heads, head_dim 64


def test_smollm2_over_two_ranks_splits_by_whole_kv_groups_unevenly(smollm2_config: ModelConfig) -> None:
    """Rank 0 holds KV heads 0-1 with the 6 query heads that read them, rank 1 KV head 2 with
    query heads 6-8: the q/k/v rows and o_proj columns tile the weights, in uneven widths."""
    config = smollm2_config
    assert [head_ranges(config, r, 2) for r in range(2)] == [
        (range(6), range(2)),
        (range(6, 9), range(2, 3)),
    ]
    assert [local_heads(config, _rank(r, 2)) for r in range(2)] == [(6, 2), (3, 1)]
    assert describe_head_split(config, 2) == "rank 0 q 0-5 kv 0-1; rank 1 q 6-8 kv 2"
    hd, hidden = config.head_dim, config.hidden_size
    q, k = torch.randn(config.num_heads * hd, hidden), torch.randn(config.num_kv_heads * hd, hidden)
    o = torch.randn(hidden, config.num_heads * hd)
    qs = [shard_weight("layers.0.self_attn.q_proj.weight", q, config, _rank(r, 2)) for r in range(2)]
    ks = [shard_weight("layers.0.self_attn.k_proj.weight", k, config, _rank(r, 2)) for r in range(2)]
    os_ = [shard_weight("layers.0.self_attn.o_proj.weight", o, config, _rank(r, 2)) for r in range(2)]
    assert [t.shape[0] for t in qs] == [6 * hd, 3 * hd] and [t.shape[0] for t in ks] == [2 * hd, hd]
    assert (
        torch.equal(torch.cat(qs), q)
        and torch.equal(torch.cat(ks), k)
        and torch.equal(torch.cat(os_, dim=1), o)
    )
    quantized = Int4Weight.quantize(o)  # 384 and 192 columns: whole groups of 32
    shards = [
        shard_weight("layers.0.self_attn.o_proj.weight", quantized, config, _rank(r, 2)) for r in range(2)
    ]
    assert torch.equal(torch.cat([s.dequantize() for s in shards], dim=1), quantized.dequantize())


def test_smollm2_replicated_kv_heads_split_their_groups_query_heads_unevenly(
    smollm2_config: ModelConfig,
) -> None:
    """6 ranks over 3 KV heads: each KV head on 2 ranks, its 3 query heads split 2 + 1; 4
    ranks cannot share 3 KV heads equally and are refused naming the counts."""
    assert [head_ranges(smollm2_config, r, 6) for r in range(2)] == [
        (range(2), range(1)),
        (range(2, 3), range(1)),
    ]
    assert head_ranges(smollm2_config, 5, 6) == (range(8, 9), range(2, 3))
    with pytest.raises(
        ValueError, match="9 attention heads and 3 KV heads do not split over tensor_parallel_size 4"
    ):
        local_heads(smollm2_config, _rank(0, 4))


def test_data_parallel_engines_take_devices_of_their_own_on_cuda() -> None:
    """Engine d of tensor_parallel_size 2 takes cuda:2d and cuda:2d+1 (after the configured
    cuda:N); with Ray only rank 0 is local; too few devices is an error naming them; the CPU
    is every engine's. Computed without a GPU (the device index only names a device)."""
    cuda, cuda2 = torch.device("cuda"), torch.device("cuda:2")
    assert data_parallel_devices(cuda, 0, 2, device_count=4) == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert data_parallel_devices(cuda, 1, 2, device_count=4) == [
        torch.device("cuda", 2),
        torch.device("cuda", 3),
    ]
    assert data_parallel_devices(cuda2, 1, 1, device_count=4) == [torch.device("cuda", 3)]
    with pytest.raises(
        ValueError, match=r"engine 1 with 2 local .* needs cuda:4..cuda:5, but 4 CUDA devices"
    ):
        data_parallel_devices(cuda2, 1, 2, device_count=4)
    assert data_parallel_devices(torch.device("cpu"), 1, 2, device_count=0) == [torch.device("cpu")] * 2


def test_a_negative_execute_model_timeout_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="execute_model_timeout must be >= 0 seconds, got -1"):
        EngineConfig(execute_model_timeout=-1)


# ------------------------------------------------------------------ two gloo ranks


def _tp2_against_tp1(
    model: Path, prompts: list[list[int]], quantization: str
) -> tuple[list[list[int]], list[list[int]]]:
    """(TP=1 tokens, TP=2 tokens) under chunked prefill, prefix hits and preemption, each
    checked to have happened; the workers are gone afterwards."""
    max_tokens = [*MAX_TOKENS, 20, 16, 24]
    args = dict(
        model=str(model),
        dtype="float32",
        quantization=quantization,
        log_stats_interval=0,
        num_threads=1,
        **SMALL_POOL,
    )
    reference = _greedy(LLM(**args), prompts, max_tokens)
    llm = LLM(**args, tensor_parallel_size=2)
    try:
        sharded = _greedy(llm, prompts, max_tokens)
        stats = llm.engine.scheduler.stats()
        assert stats["num_preemptions_total"] > 0
        assert stats["prefix_cache_hits"] + stats["prefix_cache_preempted_hits"] > 0
    finally:
        group = llm.engine.tp_group
        pids = [] if group is None else group.pids
        llm.shutdown()
    assert pids and not [p for p in pids if _pid_alive(p)]
    return reference, sharded


def test_tp2_greedy_tokens_equal_tp1_with_chunking_prefix_hits_and_preemption(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    reference, sharded = _tp2_against_tp1(tiny_model_dir, prompts, "none")
    assert sharded == reference


def test_tp2_gemma3_greedy_tokens_equal_tp1_with_chunking_prefix_hits_and_preemption(
    gemma3_model_dir: Path, prompts: list[list[int]]
) -> None:
    """Gemma 3's extra norms and q/k norms are replicated, its sliding windows per head: exact."""
    reference, sharded = _tp2_against_tp1(gemma3_model_dir, prompts, "none")
    assert sharded == reference


def test_tp2_int4_greedy_tokens_agree_with_tp1_but_for_bf16_rounding_of_partial_sums(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """4-bit on CPU computes in bf16 (kernels/quant_matmul.py): each rank's partial product
    of a row-parallel layer is rounded to bf16 before the all-reduce adds them, where TP=1
    rounds the whole sum once (measured on the tiny model's MLP: 2^-7 apart at outputs of
    ~2.7, against 0.5 between 4-bit and dense), and the random tiny model's near-ties then
    flip some later tokens. The prefill's token must agree for every request, and most
    tokens overall (149 of 178 when written)."""
    reference, sharded = _tp2_against_tp1(tiny_model_dir, prompts, "int4")
    assert [r[0] for r in reference] == [s[0] for s in sharded]
    same = sum(a == b for r, s in zip(reference, sharded) for a, b in zip(r, s))
    assert same >= 0.8 * sum(map(len, reference)), (same, reference, sharded)


def test_a_killed_worker_fails_the_engine_and_shutdown_leaves_no_worker(tiny_model_dir: Path) -> None:
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        log_stats_interval=0,
        num_threads=1,
        tensor_parallel_size=2,
    )
    group = llm.engine.tp_group
    assert group is not None
    (pid,) = group.pids
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {pid}\\) exited with code -9"):
            llm.engine.check_workers()
    finally:
        llm.shutdown()
    assert not _pid_alive(pid)


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def _smollm2(quantization: str, tp: int) -> list:
    """Greedy outputs (with the prefill's top-3 logprobs) of the embedded SmolLM2 GGUF, under chunked prefill."""
    llm = LLM(
        quantization=quantization,
        tensor_parallel_size=tp,
        kv_cache_memory=64 * 2**20,
        max_model_len=512,
        log_stats_interval=0,
        num_threads=1,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        dtype="float32",
    )
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
        return [o.outputs[0] for o in llm.generate(SMOLLM2_PROMPTS, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def smollm2_unsharded() -> list:
    return _smollm2("none", 1)


@pytest.mark.parametrize("tp", [2, 3], ids=["tp2-uneven", "tp3"])
def test_smollm2_sharded_dequantized_gives_the_tokens_of_one_rank(smollm2_unsharded: list, tp: int) -> None:
    """9 query heads, 3 KV heads: over 2 ranks unevenly (6 + 3 query heads, 2 + 1 KV heads),
    over 3 evenly. Dequantized to fp32 the sharded model's greedy tokens equal the unsharded one's."""
    assert [o.token_ids for o in _smollm2("none", tp)] == [o.token_ids for o in smollm2_unsharded]


def test_smollm2_4bit_shards_of_uneven_width_load_and_agree_on_the_top_candidates(
    smollm2_unsharded: list,
) -> None:
    """Kept 4-bit (``gguf``, each rank's Int4Weight sliced before packing: o_proj in 384 and
    192 columns), the bf16 rounding of partial sums (see the int4 test above) flips near-ties,
    so what is checked is that the prefill's top-3 candidates are the same tokens."""
    quantized = _smollm2("gguf", 2)
    assert [set(o.logprobs[0]) for o in quantized] == [set(o.logprobs[0]) for o in smollm2_unsharded]
