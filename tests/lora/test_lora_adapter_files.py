"""A bad adapter file fails the request (or the load) that names it, never the engine
(issue 22): the frontend's check opens ``adapter_model.safetensors`` and reads its header,
the engine checks the header against the model before reading the tensors and refuses
non-finite weights, every problem is a ``ValueError`` naming the file, and a step never
reads an adapter file (the adapters of live requests keep their CPU copies)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastsched import LLM, SamplingParams
from fastsched.frontend.lora_registry import LoRARegistry
from fastsched.lora import LoRARequest, read_adapter_config

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [(5 * i) % 200 + 3 for i in range(12)]
WEIGHTS = "adapter_model.safetensors"


def copy_adapter(adapter: LoRARequest, to: Path) -> Path:
    return Path(shutil.copytree(adapter.path, to))


def header(data: dict) -> bytes:
    text = json.dumps(data).encode()
    return struct.pack("<Q", len(text)) + text


BAD_FILES: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda good: b"",
    "truncated": lambda good: good[: len(good) // 2],
    "not safetensors": lambda good: b"PK\x03\x04 a zip file, say" * 10,
    "header longer than the file": lambda good: struct.pack("<Q", 1 << 40) + good[8:],
    "padded": lambda good: good + b"\0" * 64,
    "tensor bytes out of the file": lambda good: header(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
                "dtype": "F32",
                "shape": [8, 64],
                "data_offsets": [0, 8 * 64 * 4],
            }
        }
    ),
    "not a LoRA tensor": lambda good: (
        header({"lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}) + b"\0" * 4
    ),
}


@pytest.mark.parametrize("damage", list(BAD_FILES))
def test_the_frontends_check_refuses_a_bad_weights_file(
    adapters: dict[str, LoRARequest], tmp_path: Path, damage: str
) -> None:
    """``/v1/load_lora_adapter`` and ``--lora-modules`` (a 400): the file is opened and its
    header checked, not only found."""
    path = copy_adapter(adapters["full"], tmp_path / "a")
    (path / WEIGHTS).write_bytes(BAD_FILES[damage]((path / WEIGHTS).read_bytes()))
    registry = LoRARegistry(max_lora_rank=8)
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        registry.load("bad", str(path))
    assert registry.adapters() == []


def test_the_frontends_check_refuses_tensors_of_another_rank(
    adapters: dict[str, LoRARequest], tmp_path: Path
) -> None:
    path = copy_adapter(adapters["full"], tmp_path / "a")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "r": 4, "lora_alpha": 4}))
    with pytest.raises(ValueError, match="not that of a lora_A of rank r=4"):
        read_adapter_config(path, max_lora_rank=8)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (b"[1, 2]", "adapter_config.json is not a JSON object"),
        (b"\xff\xfe{", "adapter_config.json is not JSON"),
    ],
)
def test_a_bad_config_file_is_a_value_error(
    adapters: dict[str, LoRARequest], tmp_path: Path, config: bytes, message: str
) -> None:
    path = copy_adapter(adapters["full"], tmp_path / "a")
    (path / "adapter_config.json").write_bytes(config)
    with pytest.raises(ValueError, match=message):
        read_adapter_config(path, max_lora_rank=8)


def make_llm(base_dir: Path, **kwargs: object) -> LLM:
    return LLM(
        str(base_dir),
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        num_gpu_blocks=64,
        max_model_len=256,
        log_stats_interval=0.0,
        **kwargs,
    )


def test_a_zero_byte_weights_file_fails_its_request_not_the_engine(
    base_dir: Path, adapters: dict[str, LoRARequest], tmp_path: Path
) -> None:
    path = copy_adapter(adapters["full"], tmp_path / "a")
    (path / WEIGHTS).write_bytes(b"")
    llm = make_llm(base_dir)
    with pytest.raises(ValueError, match="adapter_model.safetensors.*not a safetensors file: 0 bytes"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("bad", 7, str(path)), use_tqdm=False)
    assert llm.generate([PROMPT], GREEDY, lora_request=adapters["qv"], use_tqdm=False)[0].finished


def test_non_finite_weights_are_refused(
    base_dir: Path, adapters: dict[str, LoRARequest], tmp_path: Path
) -> None:
    path = copy_adapter(adapters["full"], tmp_path / "a")
    tensors = load_file(str(path / WEIGHTS))
    name = next(iter(tensors))
    tensors[name][0, 0] = torch.nan
    save_file(tensors, str(path / WEIGHTS))
    llm = make_llm(base_dir)
    with pytest.raises(ValueError, match="holds NaN or infinite values"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("nan", 7, str(path)), use_tqdm=False)


def test_an_adapter_broken_after_its_first_use_fails_its_next_request_not_a_step(
    base_dir: Path, adapters: dict[str, LoRARequest], tmp_path: Path
) -> None:
    """One CPU copy: the second adapter's request drops the first one's idle copy; the first
    adapter's file is then damaged. Its next request is refused when added (where the file
    is read again), and the engine goes on serving."""
    path = copy_adapter(adapters["full"], tmp_path / "a")
    first = LoRARequest("a", 7, str(path))
    llm = make_llm(base_dir, max_cpu_loras=1)
    assert llm.generate([PROMPT], GREEDY, lora_request=first, use_tqdm=False)[0].finished
    assert llm.generate([PROMPT], GREEDY, lora_request=adapters["qv"], use_tqdm=False)[0].finished
    assert llm.engine.lora is not None and llm.engine.lora.cpu_cached == [adapters["qv"].id]
    (path / WEIGHTS).write_bytes(b"")
    with pytest.raises(ValueError, match="not a safetensors file"):
        llm.generate([PROMPT], GREEDY, lora_request=first, use_tqdm=False)
    assert llm.generate([PROMPT], GREEDY, lora_request=adapters["qv"], use_tqdm=False)[0].finished


def test_a_weights_file_that_is_not_safetensors_is_refused_without_quoting_its_bytes(tmp_path: Path) -> None:
    """Issue 37: the message once gave the file's size and its first 8 bytes as a number."""
    from fastsched.lora.request import read_safetensors_header

    path = tmp_path / "adapter_model.safetensors"
    data = b"password=hunter2;" * 10
    path.write_bytes(data)
    with pytest.raises(ValueError, match="not a safetensors file") as refused:
        read_safetensors_header(path)
    message = str(refused.value)
    assert str(len(data)) not in message and str(int.from_bytes(data[:8], "little")) not in message
    header = b'{"x": {"dtype": "F32", "shape": "hunter2", "data_offsets": [0, 4]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ValueError, match="malformed entry") as refused:
        read_safetensors_header(path)
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize("damage", ["nan", "inf in bfloat16", "a layer the model lacks", "no lora_B"])
def test_the_frontend_refuses_an_adapter_every_request_would_fail_on(
    base_dir: Path, adapters: dict[str, LoRARequest], tmp_path: Path, damage: str
) -> None:
    """Issue 37: such adapters loaded with 200 and were listed, then failed every request
    that named them. Registering checks them against the served model now (a 400)."""
    from fastsched.model_loader import load_model_config

    config = load_model_config(base_dir)
    path = copy_adapter(adapters["full"], tmp_path / "a")
    tensors = load_file(str(path / WEIGHTS))
    name = next(n for n in tensors if "lora_A" in n)
    if damage == "nan":
        tensors[name][0, 0] = torch.nan
    elif damage == "inf in bfloat16":
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        tensors[name][1, 2] = -torch.inf
    elif damage == "a layer the model lacks":
        for half in ("A", "B"):
            source = name.replace("lora_A", f"lora_{half}")
            tensors[source.replace("layers.0.", f"layers.{config.num_layers}.")] = tensors[source].clone()
    else:
        del tensors[name.replace("lora_A", "lora_B")]
    save_file(tensors, str(path / WEIGHTS))
    message = {
        "nan": "holds NaN or infinite values",
        "inf in bfloat16": "holds NaN or infinite values",
        "a layer the model lacks": f"has no place in .*{config.num_layers} layers",
        "no lora_B": "has no lora_B tensor",
    }[damage]
    registry = LoRARegistry(max_lora_rank=8, model_config=config)
    with pytest.raises(ValueError, match=message):
        registry.load("bad", str(path))
    assert registry.adapters() == []
    registry.load("good", adapters["full"].path)
    assert [a.name for a in registry.adapters()] == ["good"]
