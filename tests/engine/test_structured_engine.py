"""Structured outputs in the engine: one matcher per request, one bitmask per step applied
before sampling. The tiny random model emits garbage, so only the grammar can make its
output valid: every output here is checked against its constraint, in the synchronous loop
and with async scheduling (where step N+1's bitmask waits for step N's tokens), with n > 1,
with preemption (a preempted request's matcher agrees with its recomputed tokens), with
stop strings and with a grammar that fails to compile."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from fastsched import LLM, SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import AddRequest, EngineCoreRequest, decode, encode
from fastsched.model_loader import load_tokenizer

# Nested objects, enums, arrays, required fields; every string and array bounded, so that
# the grammar ends well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"admin": {"type": "boolean"}},
            "required": ["admin"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "size", "tags", "owner"],
    "additionalProperties": False,
}
MAX_TOKENS = 100
# 8 usable blocks of 16 for requests of up to 128 tokens: running requests are preempted.
SMALL_POOL = dict(num_gpu_blocks=9, max_model_len=128)


def constrained(temperature: float = 0.0, **kwargs: object) -> SamplingParams:
    kwargs.setdefault("structured_outputs", {"json": SCHEMA})
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=temperature, **kwargs)


def make_llm(model_dir: Path, async_scheduling: bool, **engine_args: object) -> LLM:
    return LLM(model=str(model_dir), log_stats_interval=0, async_scheduling=async_scheduling, **engine_args)


def outputs(
    llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]
) -> list[tuple[str, str]]:
    return [
        (c.text, c.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs
    ]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, request.param)


@pytest.fixture(scope="module")
def sync_llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, False)


def test_json_schema_outputs_validate_greedy_and_sampled_with_n_3(llm: LLM) -> None:
    prompts = ["Describe a box:", "JSON please", "x"]
    results = outputs(
        llm, prompts, [constrained(), constrained(1.0, n=3, seed=7), constrained(0.8, top_p=0.9)]
    )
    assert len(results) == 5
    for text, finish_reason in results:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_gemma3_json_schema_outputs_validate_greedy_and_sampled(gemma3_model_dir: Path) -> None:
    """The tiny Gemma 3 (tied logits, sliding windows) under a schema: every output validates."""
    llm = make_llm(gemma3_model_dir, True)
    results = outputs(llm, ["Describe a box:", "x"], [constrained(), constrained(1.0, n=2, seed=7)])
    assert len(results) == 3
    for text, finish_reason in results:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_async_scheduling_gives_the_constrained_outputs_of_the_sync_loop(llm: LLM, sync_llm: LLM) -> None:
    prompts = ["one", "two two", "three three three"]
    params = [
        constrained(),
        constrained(1.0, n=2, seed=3),
        constrained(structured_outputs={"regex": r"[a-f]{4,9}"}),
    ]
    assert outputs(llm, prompts, params) == outputs(sync_llm, prompts, params)


def test_regex_choice_json_object_and_grammar_outputs_match(llm: LLM) -> None:
    prompts = ["a", "b", "c", "d"]
    params = [
        constrained(1.0, seed=1, structured_outputs={"regex": r"\d{3}-[a-c]{2}"}),
        constrained(1.0, seed=2, n=3, structured_outputs={"choice": ["yes", "no", "maybe"]}),
        constrained(structured_outputs={"json_object": True}, max_tokens=200),
        constrained(
            1.0, seed=4, structured_outputs={"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'}
        ),
    ]
    (regex, _), *choices, (obj, obj_finish), (expr, _) = outputs(llm, prompts, params)
    assert re.fullmatch(r"\d{3}-[a-c]{2}", regex)
    assert all(text in {"yes", "no", "maybe"} and reason == "stop" for text, reason in choices)
    if obj_finish == "stop":  # any object may go on past max_tokens; cut there it is a valid prefix only
        assert isinstance(json.loads(obj), dict)
    else:
        assert obj.startswith("{")
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", expr)


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm: LLM) -> None:
    [(text, finish_reason)] = outputs(
        llm, ["q"], constrained(ignore_eos=True, structured_outputs={"choice": ["alpha", "beta"]})
    )
    assert text in {"alpha", "beta"} and finish_reason == "stop"


def test_a_stop_string_cuts_a_constrained_output(llm: LLM) -> None:
    [(text, finish_reason)] = outputs(llm, ["q"], constrained(stop=['"size"']))
    assert finish_reason == "stop"
    assert text.startswith('{"name":"') and '"size"' not in text


def test_preempted_constrained_requests_get_the_tokens_of_an_unpreempted_run(
    tiny_model_dir: Path, random_prompt: Callable[[int, int], list[int]]
) -> None:
    prompts = [random_prompt(n, seed=i) for i, n in enumerate((20, 30, 12, 25))]
    params = [
        SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": SCHEMA}),
        SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs={"json": SCHEMA}),
        SamplingParams(temperature=0, max_tokens=80, structured_outputs={"regex": "[a-z]{60}"}),
        SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
    ]
    results = {}
    for async_scheduling in (True, False):
        for pool in (SMALL_POOL, {}):
            core = EngineCore(
                EngineConfig.from_kwargs(
                    model=str(tiny_model_dir), log_stats_interval=0, async_scheduling=async_scheduling, **pool
                )
            )
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                core.add_request(EngineCoreRequest(str(i), prompt, p))
            tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
            while core.has_unfinished_requests():
                for out in core.step():
                    tokens[out.request_id] += out.new_token_ids
            assert (core.scheduler.stats()["num_preemptions_total"] > 0) == bool(pool)
            assert core.structured.num_constrained == 0
            results[async_scheduling, bool(pool)] = tokens
    assert len({json.dumps(r, sort_keys=True) for r in results.values()}) == 1
    text = load_tokenizer(tiny_model_dir).decode
    for key in ("0", "1"):
        jsonschema.validate(json.loads(text(results[True, True][key])), SCHEMA)
    assert re.fullmatch("[a-z]{60}", text(results[True, True]["2"]))


def test_a_grammar_that_does_not_compile_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(
            structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
        )
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ValueError, match="structured_outputs needs exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"choice": ["a"]})


def test_a_streaming_input_session_cannot_be_constrained(tiny_model_dir: Path) -> None:
    core = EngineCore(EngineConfig.from_kwargs(model=str(tiny_model_dir), log_stats_interval=0))
    with pytest.raises(ValueError, match="streaming-input session"):
        core.add_request(EngineCoreRequest("s", [5, 6, 7], constrained(), streaming=True))
    assert not core.has_unfinished_requests() and core.structured.num_constrained == 0


def test_structured_outputs_cross_the_engine_wire() -> None:
    params = SamplingParams(max_tokens=9, structured_outputs={"json": SCHEMA})
    message = decode(encode(AddRequest(EngineCoreRequest("r", [1, 2], params), 0)))
    assert message.request.params.structured_outputs == params.structured_outputs


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_failing_step_releases_the_forward_thread_waiting_for_a_bitmask(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=str(tiny_model_dir), log_stats_interval=0, async_scheduling=async_scheduling
        )
    )
    real = core.structured.manager.accept_each
    calls = {"n": 0}

    def fails_on_the_third_call(*args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        real(*args)

    monkeypatch.setattr(core.structured.manager, "accept_each", fails_on_the_third_call)
    core.add_request(EngineCoreRequest("a", [5, 6, 7], constrained()))
    failed = threading.Event()

    def run() -> None:
        try:
            while core.has_unfinished_requests():
                core.step()
        except RuntimeError:
            failed.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert failed.is_set() and not worker.is_alive()


def test_a_grammar_past_the_engines_limits_ends_its_request_and_nothing_else(llm: LLM) -> None:
    """The regex compiles, but advancing it exceeds llguidance's lexer limits (the matcher
    errs for good): that request ends with EOS at its next step, after at most the one token
    it had; its neighbours in the batch and the engine's next requests are unaffected."""
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = outputs(llm, ["neighbour"], plain)
    hostile = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"regex": "((a{1000}){1000})"})
    (hostile_text, hostile_finish), neighbour = outputs(llm, ["hostile", "neighbour"], [hostile, plain])
    assert hostile_finish == "stop" and re.fullmatch("a?", hostile_text), hostile_text
    assert [neighbour] == expected
    assert outputs(llm, ["neighbour"], plain) == expected
