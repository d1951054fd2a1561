"""LoRA end to end through ``fastsched.LLM`` and ``EngineCore``: greedy tokens equal
``transformers`` + ``peft`` for every row of a mixed batch, the S7 LoRA-slot skip, and
prefix caching kept apart per adapter (S8)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.lora import LoRARequest

# reference(prompt, max_tokens, adapter name or None) -> greedy token ids (conftest.py)
PeftReference = Callable[[Sequence[int], int, "str | None"], list[int]]
MAX_RANK = 8  # the larger of the two adapters' ranks (conftest.py)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def make_llm(base_dir: Path, **kwargs: object) -> LLM:
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, num_gpu_blocks=256, max_model_len=512)
    args.update(kwargs)
    return LLM(str(base_dir), **args)


@pytest.mark.parametrize("budget", [2048, 48], ids=["whole-prompts", "chunked-prefill"])
def test_a_batch_mixing_the_base_model_and_two_adapters_gives_the_tokens_of_peft(
    base_dir: Path, adapters: dict[str, LoRARequest], peft_reference: PeftReference, budget: int
) -> None:
    # Prompts past DENSE_MAX_TOKENS make the first step take the segmented (sgmv) path;
    # the decode steps after it take the dense one (bgmv_dense).
    prompts = [prompt(n, seed) for seed, n in enumerate([9, 40, 150, 17, 70, 5])]
    names = ["full", None, "qv", "qv", "full", None]
    llm = make_llm(base_dir, max_num_batched_tokens=budget, max_num_seqs=8)
    outputs = llm.generate(
        prompts, GREEDY, lora_request=[adapters[n] if n else None for n in names], use_tqdm=False
    )
    for p, name, out in zip(prompts, names, outputs, strict=True):
        assert out.outputs[0].token_ids == peft_reference(p, GREEDY.max_tokens, name), name


def test_gemma3_batch_mixing_the_base_model_and_two_adapters_gives_the_tokens_of_peft(
    gemma3_base_dir: Path, gemma3_adapters: dict[str, LoRARequest], gemma3_peft_reference: PeftReference
) -> None:
    """Gemma 3's layers (sliding windows, q/k norms, post-norms) take the adapters' deltas where
    peft adds them; chunked so prefill chunks reach past the window."""
    prompts = [prompt(n, seed) for seed, n in enumerate([9, 40, 70, 17])]
    names = ["full", None, "qv", "full"]
    llm = make_llm(gemma3_base_dir, max_num_batched_tokens=48, max_num_seqs=8)
    requests = [gemma3_adapters[n] if n else None for n in names]
    outputs = llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)
    for p, name, out in zip(prompts, names, outputs, strict=True):
        assert out.outputs[0].token_ids == gemma3_peft_reference(p, GREEDY.max_tokens, name), name
    # Guards the parity: the adapters change what the base model says.
    assert any(
        gemma3_peft_reference(p, 12, None) != gemma3_peft_reference(p, 12, n)
        for p in prompts
        for n in ("full", "qv")
    )


def test_adapters_change_the_outputs_of_the_base_model(
    base_dir: Path, adapters: dict[str, LoRARequest], peft_reference: PeftReference
) -> None:
    """Guards the parity test above: equal outputs would also follow from adapters that do nothing."""
    p = prompt(12, 99)
    outs = {name: tuple(peft_reference(p, 12, name)) for name in (None, "full", "qv")}
    assert len(set(outs.values())) == 3


def test_s7_with_one_lora_slot_the_second_adapters_request_waits_then_runs(
    base_dir: Path, adapters: dict[str, LoRARequest], peft_reference: PeftReference
) -> None:
    config = EngineConfig(
        model=str(base_dir),
        enable_lora=True,
        max_loras=1,
        max_lora_rank=MAX_RANK,
        num_gpu_blocks=64,
        max_model_len=256,
        async_scheduling=False,
    )
    engine = EngineCore(config)
    prompts = {"a": prompt(10, 1), "b": prompt(10, 2)}
    engine.add_request(EngineCoreRequest("a", prompts["a"], GREEDY, lora_request=adapters["full"]))
    engine.add_request(EngineCoreRequest("b", prompts["b"], GREEDY, lora_request=adapters["qv"]))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    first_step_of: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.new_token_ids:
                first_step_of.setdefault(out.request_id, steps)
        steps += 1
    assert first_step_of["b"] > first_step_of["a"] + GREEDY.max_tokens - 2, "b ran only after a finished"
    assert engine.scheduler.stats()["skips_total"]["lora_slots"] >= GREEDY.max_tokens - 1
    assert tokens["a"] == peft_reference(prompts["a"], GREEDY.max_tokens, "full")
    assert tokens["b"] == peft_reference(prompts["b"], GREEDY.max_tokens, "qv")


def test_s8_prefix_cache_blocks_are_shared_within_an_adapter_never_across(
    base_dir: Path, adapters: dict[str, LoRARequest], peft_reference: PeftReference
) -> None:
    llm = make_llm(base_dir)
    p = prompt(64, 7)
    first = llm.generate([p], GREEDY, lora_request=adapters["full"], use_tqdm=False)[0]
    same = llm.generate([p], GREEDY, lora_request=adapters["full"], use_tqdm=False)[0]
    other = llm.generate([p], GREEDY, lora_request=adapters["qv"], use_tqdm=False)[0]
    base = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert same.num_cached_tokens == 48, "the full blocks of the prompt but the last token's"
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert first.outputs[0].token_ids == same.outputs[0].token_ids == peft_reference(p, 12, "full")
    assert other.outputs[0].token_ids == peft_reference(p, 12, "qv")
    assert base.outputs[0].token_ids == peft_reference(p, 12, None)


def test_more_adapters_than_slots_and_cpu_copies_are_loaded_again_and_stay_exact(
    base_dir: Path, adapters: dict[str, LoRARequest], peft_reference: PeftReference
) -> None:
    """One slot, one CPU copy: every switch evicts the other adapter from both."""
    llm = make_llm(base_dir, max_loras=1, max_cpu_loras=1)
    prompts = [prompt(20, seed) for seed in range(4)]
    names = ["full", "qv", "full", "qv"]
    outputs = llm.generate(prompts, GREEDY, lora_request=[adapters[n] for n in names], use_tqdm=False)
    for p, name, out in zip(prompts, names, outputs, strict=True):
        assert out.outputs[0].token_ids == peft_reference(p, GREEDY.max_tokens, name)


def test_an_adapter_without_enable_lora_is_refused_naming_it(
    base_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    llm = LLM(str(base_dir), num_gpu_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="'full'.*enable_lora"):
        llm.generate([prompt(5, 0)], GREEDY, lora_request=adapters["full"], use_tqdm=False)


def test_an_adapter_of_too_high_a_rank_is_refused_with_the_request(
    base_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    llm = make_llm(base_dir, max_lora_rank=4)
    with pytest.raises(ValueError, match="r is 8, more than max_lora_rank \\(4\\)"):
        llm.generate([prompt(5, 0)], GREEDY, lora_request=adapters["full"], use_tqdm=False)
    assert llm.generate([prompt(5, 0)], GREEDY, lora_request=adapters["qv"], use_tqdm=False)[0].finished


def test_after_a_failed_step_adapters_are_copied_into_their_slots_again(
    base_dir: Path,
    adapters: dict[str, LoRARequest],
    peft_reference: PeftReference,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step that would have copied adapter "qv" into its slot fails before the copy;
    the manager must not believe the slot holds it."""
    llm = make_llm(base_dir, max_loras=1)
    lora = llm.engine.lora
    assert lora is not None
    real_activate = lora.activate

    def fail_once(mapping):
        monkeypatch.setattr(lora, "activate", real_activate)
        raise RuntimeError("injected failure before the copy")

    monkeypatch.setattr(lora, "activate", fail_once)
    p = prompt(10, 5)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([p], GREEDY, lora_request=adapters["qv"], use_tqdm=False)
    out = llm.generate([p], GREEDY, lora_request=adapters["qv"], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_reference(p, GREEDY.max_tokens, "qv")
