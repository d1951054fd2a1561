"""LoRA tests: the tiny checkpoint, random adapters for it, and ``transformers`` + ``peft``
as the greedy reference for every adapter (or none)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach a model hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from fastsched.lora import LoRARequest
from fastsched.tools.tiny_lora import make_tiny_lora
from fastsched.tools.tiny_model import make_tiny_model

PeftReference = Callable[[Sequence[int], int, "str | None"], list[int]]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora-tiny") / "model")


@pytest.fixture(scope="session")
def adapters(base_dir: Path) -> dict[str, LoRARequest]:
    return make_adapters(base_dir)


@pytest.fixture(scope="session")
def peft_reference(base_dir: Path, adapters: dict[str, LoRARequest]) -> PeftReference:
    return make_peft_reference(base_dir, adapters)


@pytest.fixture(scope="session")
def gemma3_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3: five sliding-window layers of 16 tokens, one global."""
    return make_tiny_model(tmp_path_factory.mktemp("lora-gemma3") / "model", architecture="gemma3")


@pytest.fixture(scope="session")
def gemma3_adapters(gemma3_base_dir: Path) -> dict[str, LoRARequest]:
    return make_adapters(gemma3_base_dir)


@pytest.fixture(scope="session")
def gemma3_peft_reference(gemma3_base_dir: Path, gemma3_adapters: dict[str, LoRARequest]) -> PeftReference:
    return make_peft_reference(gemma3_base_dir, gemma3_adapters)


def make_adapters(base_dir: Path) -> dict[str, LoRARequest]:
    """Two adapters unlike each other: every projection at rank 8 (the largest rank, which
    the tests' max_lora_rank allows), and q/v only at rank 4 with alpha 8 (scaling 2)."""
    root = base_dir.parent
    full = make_tiny_lora(base_dir, root / "full", rank=8, seed=1)
    qv = make_tiny_lora(
        base_dir, root / "qv", rank=4, seed=2, target_modules=("q_proj", "v_proj"), lora_alpha=8
    )
    return {"full": LoRARequest("full", 1, str(full)), "qv": LoRARequest("qv", 2, str(qv))}


def make_peft_reference(base_dir: Path, adapters: dict[str, LoRARequest]) -> PeftReference:
    """``reference(prompt, max_tokens, adapter name or None)``: greedy token ids of
    transformers with the adapter applied by peft (EOS off: compare with ``ignore_eos``)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(model, adapters[names[0]].path, adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name].path, adapter_name=name)
    cache: dict[tuple[tuple[int, ...], int, str | None], list[int]] = {}

    @torch.no_grad()
    def generate(prompt: Sequence[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([list(prompt)])
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return out[0, len(prompt) :].tolist()

    def reference(prompt: Sequence[int], max_tokens: int, adapter: str | None) -> list[int]:
        key = (tuple(prompt), max_tokens, adapter)
        if key not in cache:
            if adapter is None:
                with model.disable_adapter():
                    cache[key] = generate(prompt, max_tokens)
            else:
                model.set_adapter(adapter)
                cache[key] = generate(prompt, max_tokens)
        return cache[key]

    return reference
