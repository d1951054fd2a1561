"""Engine tests run offline, on one tiny checkpoint built once per session.

The reference for greedy decoding is ``transformers``' own ``generate`` on the same
checkpoint, computed once per (prompt, max_tokens) and shared by every test module
of this folder.
"""

from __future__ import annotations

import os

# Before transformers is imported anywhere: the tests must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from fastsched.tools.tiny_model import make_tiny_model

# The tiny model's token ids below this are <|endoftext|>, <|im_start|>, <|im_end|>.
FIRST_ORDINARY_TOKEN = 3
# Small ops on 2 cores: one thread avoids the cost of waking a second for each of them.
NUM_THREADS = 1

GreedyReference = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[int]]]


@pytest.fixture(scope="module", autouse=True)
def few_threads() -> Iterator[None]:
    """Per module, so the thread count of other test folders is left as it was."""
    previous = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine-tiny") / "model")


@pytest.fixture(scope="session")
def vocab_size(tiny_model_dir: Path) -> int:
    from fastsched.model_loader import load_model_config

    return load_model_config(tiny_model_dir).vocab_size


@pytest.fixture(scope="session")
def random_prompt(vocab_size: int) -> Callable[[int, int], list[int]]:
    """``random_prompt(length, seed)``: ordinary token ids, the same for the same arguments."""

    def make(length: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]

    return make


@pytest.fixture(scope="session")
def greedy_reference(tiny_model_dir: Path) -> GreedyReference:
    """``reference(prompts, max_tokens)``: transformers' greedy tokens for each prompt of the tiny model."""
    return make_greedy_reference(tiny_model_dir)


@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 (the tiny model's tokenizer): five sliding-window layers of 16 tokens, one global."""
    return make_tiny_model(tmp_path_factory.mktemp("engine-gemma3") / "model", architecture="gemma3")


@pytest.fixture(scope="session")
def gemma3_greedy_reference(gemma3_model_dir: Path) -> GreedyReference:
    return make_greedy_reference(gemma3_model_dir)


def make_greedy_reference(model_dir: Path) -> GreedyReference:
    """``reference(prompts, max_tokens)``: transformers' greedy tokens for each prompt.

    EOS is switched off on transformers' side (compare with ``ignore_eos=True``) so
    both always produce exactly ``max_tokens`` tokens. Each prompt is generated alone,
    without padding, so the reference is the model's own arithmetic and nothing else.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.no_grad()
    def reference(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        for prompt, n in zip(prompts, max_tokens, strict=True):
            key = (tuple(prompt), n)
            if key not in cache:
                out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False)
                cache[key] = out[0, len(prompt) :].tolist()
                assert len(cache[key]) == n, "transformers stopped early: EOS must be off"
        return [cache[(tuple(p), n)] for p, n in zip(prompts, max_tokens)]

    return reference
