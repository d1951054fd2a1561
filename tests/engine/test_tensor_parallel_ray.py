"""``--distributed-executor-backend ray`` (issue 24): the rank beside the engine is a Ray
actor of a running cluster, placed by a placement group, and the greedy tokens are those
of the unsharded model, with LoRA adapters too (the actor reads its slices from the
adapter's path). The cluster is a local one on 127.0.0.1 that this test starts
and stops (ray.init / ray.shutdown: its own processes only); skipped without ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams
from fastsched.lora import LoRARequest
from fastsched.tools.tiny_lora import make_tiny_lora

ray = pytest.importorskip("ray", reason="ray is not installed (the ray extra)")


@pytest.fixture(scope="module")
def local_ray_cluster() -> Iterator[None]:
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_tp2_on_ray_actors_gives_the_tokens_of_tp1(
    local_ray_cluster: None, tiny_model_dir: Path, random_prompt: Callable[[int, int], list[int]]
) -> None:
    prompts = [random_prompt(n, seed=i) for i, n in enumerate((3, 11, 26, 41, 63, 80))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    args = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        log_stats_interval=0,
        num_threads=1,
        num_gpu_blocks=9,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    reference = [o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**args, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        group = llm.engine.tp_group
        assert group is not None and "ray" in group.layout() and "1 Ray actors" in group.layout()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
        assert llm.engine.scheduler.stats()["num_preemptions_total"] > 0
    finally:
        llm.shutdown()
    assert not ray.util.list_named_actors() and group.failure is None


def test_tp2_on_ray_actors_applies_lora_adapters_as_one_rank_does(
    local_ray_cluster: None,
    tiny_model_dir: Path,
    tmp_path: Path,
    random_prompt: Callable[[int, int], list[int]],
) -> None:
    adapter = LoRARequest("a", 1, str(make_tiny_lora(tiny_model_dir, tmp_path / "lora", rank=8, seed=4)))
    prompts = [random_prompt(n, seed=i) for i, n in enumerate((9, 30, 17))]
    loras = [adapter, None, adapter]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    args = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        log_stats_interval=0,
        num_threads=1,
        max_model_len=128,
        enable_lora=True,
        max_lora_rank=8,
    )

    def generate(llm: LLM) -> list[list[int]]:
        return [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        ]

    reference = generate(LLM(**args))
    llm = LLM(**args, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert generate(llm) == reference
    finally:
        llm.shutdown()
