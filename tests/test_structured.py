"""Structured outputs below the engine: constraints compile (or are refused with the grammar
engine's message), and a random walk that samples only what the step's bitmask allows
always ends in output that satisfies the constraint (JSON schema, regex, choice)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from fastsched.model_loader import load_tokenizer
from fastsched.structured.bitmask import apply_token_bitmask
from fastsched.structured.matchers import StructuredOutputManager
from fastsched.structured.params import StructuredOutputsParams, check_compiles
from fastsched.tools.tiny_model import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "size", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def walk(manager: StructuredOutputManager, tokenizer, params: StructuredOutputsParams, seed: int) -> str:
    """Sample random allowed tokens (argmax of masked random logits) until EOS or the grammar ends."""
    key = ("walk", seed)
    manager.add(key, params.grammar_text())
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    try:
        for _ in range(400):
            logits = torch.randn(1, manager.vocab_size, generator=generator)
            apply_token_bitmask(logits, manager.fill_bitmask([key]), np.array([0]))
            token = int(logits.argmax())
            if token in tokenizer.eos_token_ids:
                break
            manager.accept(key, [token])
            tokens.append(token)
            if manager.is_finished(key):
                break
        else:
            pytest.fail("the walk did not end in 400 tokens")
    finally:
        manager.remove(key)
    return tokenizer.decode(tokens)


@pytest.mark.parametrize("seed", range(5))
def test_a_masked_walk_yields_json_that_validates(manager, tokenizer, seed: int):
    text = walk(manager, tokenizer, StructuredOutputsParams(json=SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_a_masked_walk_matches_the_regex_and_the_choices(manager, tokenizer, seed: int):
    assert re.fullmatch(
        r"[0-9]{3}-[a-c]{2}",
        walk(manager, tokenizer, StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}"), seed),
    )
    assert walk(manager, tokenizer, StructuredOutputsParams(choice=["yes", "no", "maybe"]), seed) in {
        "yes",
        "no",
        "maybe",
    }


def test_json_object_allows_only_an_object_to_start(manager, tokenizer):
    """Any JSON object is unbounded, so no walk is sure to end: check its first step instead."""
    manager.add("object", StructuredOutputsParams(json_object=True).grammar_text())
    try:
        bits = np.unpackbits(manager.fill_bitmask(["object"])[0].view(np.uint8), bitorder="little")
    finally:
        manager.remove("object")
    allowed = np.flatnonzero(bits[: manager.vocab_size])
    assert len(allowed) > 0
    assert all(tokenizer.decode([int(t)]).lstrip().startswith("{") for t in allowed)


def test_the_bitmask_blocks_exactly_the_forbidden_tokens():
    logits = torch.zeros(3, 70)
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 2] = 1 << 5  # token 69
    apply_token_bitmask(logits, bitmask, np.array([0, 2]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()  # an unconstrained row is left alone
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [69]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty strings"),
    ],
)
def test_a_constraint_names_exactly_one_kind(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": "(["}, "invalid regex"),
        ({"grammar": "start: undefined_rule"}, "unknown name"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "frobnicate"}}, "frobnicate"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_with_the_reason(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        check_compiles(StructuredOutputsParams(**kwargs))


def test_params_from_a_request_map_reject_unknown_fields():
    assert StructuredOutputsParams.from_value({"regex": "a+"}) == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsParams.from_value({"regexp": "a+"})


def test_a_step_of_tokens_is_accepted_in_parallel_and_a_forbidden_one_raises(manager, tokenizer) -> None:
    grammar = StructuredOutputsParams(choice=["yes", "no"]).grammar_text()
    manager.add("a", grammar)
    manager.add("b", grammar)
    try:
        yes, no = (
            tokenizer.encode("yes", add_special_tokens=False),
            tokenizer.encode("no", add_special_tokens=False),
        )
        manager.accept_each(["a", "b"], [yes[0], no[0]])
        with pytest.raises(RuntimeError, match="'b' took a token its grammar forbids"):
            manager.accept_each(["a", "b"], [yes[1], yes[1]])
    finally:
        manager.remove("a")
        manager.remove("b")
