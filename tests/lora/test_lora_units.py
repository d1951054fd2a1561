"""The LoRA pieces on their own: punica's two formulations, adapter checks, the slot and
CPU-cache bookkeeping, the flags and the wire format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fastsched.config import EngineConfig
from fastsched.engine.protocol import AddRequest, EngineCoreRequest, decode, encode
from fastsched.lora import LoRARequest
from fastsched.lora.adapter import load_adapter
from fastsched.lora.punica import bgmv_dense, sgmv
from fastsched.lora.slots import LoRAManager
from fastsched.model_loader import load_model_config
from fastsched.sampling_params import SamplingParams
from fastsched.tools.tiny_lora import make_tiny_lora


def test_bgmv_dense_and_sgmv_add_each_tokens_own_adapter_and_nothing_for_the_base_model() -> None:
    g = torch.Generator().manual_seed(0)
    num_slots, k = 3, 6
    a, b = torch.randn(10, num_slots * k, generator=g), torch.randn(num_slots * k, 12, generator=g)
    x, base = torch.randn(7, 10, generator=g), torch.randn(7, 12, generator=g)
    slots = [0, 2, 2, -1, 1, 0, -1]

    def own(s: int) -> slice:
        return slice(s * k, (s + 1) * k)

    expected = torch.stack(
        [base[t] + (x[t] @ a[:, own(s)] @ b[own(s)] if s >= 0 else 0) for t, s in enumerate(slots)]
    )
    mask = torch.zeros(7, num_slots * k)
    for t, s in enumerate(slots):
        if s >= 0:
            mask[t, own(s)] = 1
    out = base.clone()
    bgmv_dense(x, a, b, mask, out)
    torch.testing.assert_close(out, expected)
    groups = [(s, torch.tensor([t for t, u in enumerate(slots) if u == s])) for s in range(num_slots)]
    out = base.clone()
    sgmv(x, a, b, k, groups, out)
    torch.testing.assert_close(out, expected)


def test_an_adapter_is_read_with_its_scaling_folded_into_b(base_dir: Path, tmp_path: Path) -> None:
    config = load_model_config(base_dir)
    path = make_tiny_lora(base_dir, tmp_path / "a", rank=4, seed=3, target_modules=("o_proj",), lora_alpha=12)
    adapter = load_adapter(path, 5, config, max_lora_rank=4)
    assert adapter.target_modules == {"o_proj"} and adapter.rank == 4
    from safetensors.torch import load_file

    raw = load_file(str(path / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[1]["o_proj"][1], b * 3.0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(r=32), "r is 32, more than max_lora_rank"),
        (lambda c: c.update(target_modules=["lm_head"]), "target_modules names \\['lm_head'\\]"),
        (lambda c: c.update(use_dora=True), "use_dora is True"),
        (lambda c: c.update(target_modules="q_proj|v_proj"), "must be a list of module names"),
        (lambda c: c.update(peft_type="IA3"), "only LORA"),
    ],
)
def test_unsupported_adapter_configs_are_refused_naming_the_field(
    base_dir: Path, tmp_path: Path, edit, message: str
) -> None:
    path = make_tiny_lora(base_dir, tmp_path / "a", rank=4)
    config = json.loads((path / "adapter_config.json").read_text())
    edit(config)
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_adapter(path, 1, load_model_config(base_dir), max_lora_rank=16)


def test_an_adapter_for_another_model_is_refused_naming_the_tensor(base_dir: Path, tmp_path: Path) -> None:
    from fastsched.tools.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "wide", hidden_size=32, intermediate_size=64)
    path = make_tiny_lora(other, tmp_path / "a", rank=2)
    with pytest.raises(ValueError, match=r"lora_A.weight has shape \(2, (32|64)\), expected \(2, (64|128)\)"):
        load_adapter(path, 1, load_model_config(base_dir), max_lora_rank=16)


def test_a_directory_without_adapter_files_is_refused(tmp_path: Path, base_dir: Path) -> None:
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_adapter(tmp_path, 1, load_model_config(base_dir), max_lora_rank=16)


def make_manager(base_dir: Path, max_loras: int, max_cpu_loras: int) -> LoRAManager:
    return LoRAManager(
        load_model_config(base_dir),
        max_loras=max_loras,
        max_lora_rank=8,
        max_cpu_loras=max_cpu_loras,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


def test_slots_are_reused_least_recently_used_first_and_never_for_an_adapter_of_the_step(
    base_dir: Path, tmp_path: Path
) -> None:
    manager = make_manager(base_dir, max_loras=2, max_cpu_loras=2)
    requests = [
        LoRARequest(f"a{i}", i, str(make_tiny_lora(base_dir, tmp_path / f"a{i}", rank=2, seed=i)))
        for i in (1, 2, 3)
    ]
    for request in requests:
        manager.register(request)
    assert manager.cpu_cached == [2, 3], "at most max_cpu_loras idle copies, the oldest evicted"
    for request in requests:  # requests using them arrive, as EngineCore.add_request does it
        manager.register(request)
        manager.acquire(request.id)
    assert manager.cpu_cached == [1, 2, 3], "adapters of live requests keep their copies"
    one = np.ones(1, dtype=np.int64)
    first = manager.plan(np.array([1, 0, 2]), np.array([1, 1, 1]))
    assert first is not None and first.masks is not None
    token_slots = [
        int(np.flatnonzero(row.reshape(2, -1).any(1))[0]) if row.any() else -1 for row in first.masks[1]
    ]
    assert token_slots == [0, -1, 1]
    assert [s for s, _ in first.loads] == [0, 1]
    again = manager.plan(np.array([2]), one)
    assert again is not None and again.loads == [], "already in a slot: nothing to copy"
    third = manager.plan(np.array([3, 2]), np.array([1, 1]))
    assert third is not None and [s for s, _ in third.loads] == [0], "adapter 1 was the least recently used"
    assert manager.slot_of == {2: 1, 3: 0}
    assert manager.plan(np.zeros(2, dtype=np.int64), np.array([3, 1])) is None
    with pytest.raises(RuntimeError, match="more than max_loras"):
        manager.plan(np.array([1, 2, 3]), np.array([1, 1, 1]))


def test_one_id_may_not_name_two_adapters(base_dir: Path, tmp_path: Path) -> None:
    manager = make_manager(base_dir, max_loras=1, max_cpu_loras=1)
    path = make_tiny_lora(base_dir, tmp_path / "a", rank=2)
    shutil.copytree(path, tmp_path / "b")
    manager.register(LoRARequest("a", 1, str(path)))
    manager.register(LoRARequest("a", 1, str(path)))
    with pytest.raises(ValueError, match="LoRA id 1 is adapter 'a'"):
        manager.register(LoRARequest("b", 1, str(tmp_path / "b")))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_loras": 0}, "max_loras must be at least 1"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras \\(2\\) must be at least max_loras \\(4\\)"),
        ({"lora_modules": ["novalue"]}, "'novalue' must be NAME=PATH"),
        ({"lora_modules": ["a=/x", "a=/y"]}, "names adapter 'a' twice"),
        ({"lora_modules": ["a=/x"], "enable_lora": False}, "lora_modules needs enable_lora"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"enable_lora": True, **kwargs})


def test_lora_ids_reach_the_scheduler_only_with_enable_lora() -> None:
    assert EngineConfig(max_loras=3).scheduler_config(64, 16).max_loras == 0
    assert EngineConfig(enable_lora=True, max_loras=3).scheduler_config(64, 16).max_loras == 3


def test_the_adapter_travels_in_the_add_message() -> None:
    lora = LoRARequest("sql", 7, "/adapters/sql")
    for adapter in (lora, None):
        msg = AddRequest(
            EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=3), lora_request=adapter), 0
        )
        assert decode(encode(msg)).request.lora_request == adapter


def test_lora_request_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="name must not be empty"):
        LoRARequest("", 1, "/x")


def test_make_tiny_lora_writes_an_adapter_the_engine_and_peft_read(base_dir: Path, tmp_path: Path) -> None:
    from fastsched.entrypoints.cli import main

    out = tmp_path / "cli"
    assert (
        main(
            [
                "make-tiny-lora",
                str(base_dir),
                str(out),
                "--rank",
                "4",
                "--seed",
                "9",
                "--target-modules",
                "q_proj",
                "down_proj",
            ]
        )
        == 0
    )
    adapter = load_adapter(out, 1, load_model_config(base_dir), max_lora_rank=4)
    assert adapter.rank == 4 and adapter.target_modules == {"q_proj", "down_proj"}
    assert all(b.abs().sum() > 0 for layer in adapter.weights for _, b in layer.values()), "B is not zero"
    again = tmp_path / "again"
    main(
        [
            "make-tiny-lora",
            str(base_dir),
            str(again),
            "--rank",
            "4",
            "--seed",
            "9",
            "--target-modules",
            "q_proj",
            "down_proj",
        ]
    )
    assert (out / "adapter_model.safetensors").read_bytes() == (
        again / "adapter_model.safetensors"
    ).read_bytes()
