"""Sampling parameters through ``fastsched.LLM`` on the tiny model: what each one does
to the output, and which values and engine arguments are refused, and how.

The sampler's arithmetic is tested alone in tests/test_sampling.py; here every
parameter goes the whole way: SamplingParams -> EngineCore -> scheduler -> sampler ->
output processor -> RequestOutput.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams
from fastsched.engine.protocol import EngineCoreOutput
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.outputs import CompletionOutput, RequestOutput

NUM_GPU_BLOCKS = 64  # the null block included
MAX_MODEL_LEN = 256
PROMPT = "def hello(world):\n    return"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(
        model=str(tiny_model_dir),
        num_gpu_blocks=NUM_GPU_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        log_stats_interval=0,
    )


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def complete(llm: LLM, prompt: str | list[int], params: SamplingParams):
    """The single completion of a single prompt."""
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    (completion,) = output.outputs
    return completion


def assert_nothing_lingers(llm: LLM) -> None:
    """No request left in the engine and every usable KV block free (cached ones count as free)."""
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.num_free_blocks == NUM_GPU_BLOCKS - 1


# --- seeds and n -----------------------------------------------------------------------------


def test_seeded_request_draws_the_same_tokens_alone_and_in_a_batch_of_other_requests(
    llm, random_prompt
) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = complete(llm, PROMPT, seeded).token_ids
    others = [
        (random_prompt(40, seed=1), SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)),
        (random_prompt(7, seed=2), greedy(8)),
        (random_prompt(60, seed=3), SamplingParams(temperature=0.7, top_k=20, seed=99, max_tokens=20)),
        (random_prompt(20, seed=4), SamplingParams(temperature=1.3, repetition_penalty=1.2, max_tokens=12)),
    ]
    prompts = [p for p, _ in others[:2]] + [PROMPT] + [p for p, _ in others[2:]]
    params = [s for _, s in others[:2]] + [seeded] + [s for _, s in others[2:]]
    in_batch = llm.generate(prompts, params, use_tqdm=False)[2].outputs[0].token_ids
    assert in_batch == alone
    assert (
        complete(llm, PROMPT, SamplingParams(temperature=1.0, top_p=0.95, seed=1235, max_tokens=16)).token_ids
        != alone
    )
    assert_nothing_lingers(llm)


@pytest.mark.parametrize("seed", [7, None], ids=["seeded", "unseeded"])
def test_n_returns_n_distinct_completions(llm, seed: int | None) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in output.outputs)
    assert output.outputs[0].token_ids != output.outputs[1].token_ids
    if seed is not None:
        (again,) = llm.generate(PROMPT, params, use_tqdm=False)
        assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]
    assert_nothing_lingers(llm)


# --- stopping --------------------------------------------------------------------------------


def test_stop_string_across_a_token_boundary_ends_the_text_before_it(llm) -> None:
    base = complete(llm, PROMPT, greedy(24))
    decode = llm.tokenizer.decode
    # A token boundary with clean text on both sides: the stop string spans it.
    for j in range(2, len(base.token_ids) - 1):
        boundary = len(decode(base.token_ids[:j]))
        stop = base.text[boundary - 2 : boundary + 2]
        if base.text.startswith(decode(base.token_ids[:j])) and "\ufffd" not in stop and stop.strip():
            if base.text.find(stop) == boundary - 2:
                break
    else:
        pytest.fail(f"no usable stop string in {base.text!r}")

    out = complete(llm, PROMPT, greedy(24, stop=[stop]))
    assert (out.text, out.finish_reason, out.stop_reason) == (base.text[: boundary - 2], "stop", stop)
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    included = complete(llm, PROMPT, greedy(24, stop=stop, include_stop_str_in_output=True))
    assert included.text == base.text[: boundary + 2]
    assert_nothing_lingers(llm)


def test_stop_token_id_ends_the_output_with_that_token(llm) -> None:
    base = complete(llm, PROMPT, greedy(16))
    stop_id = base.token_ids[2]
    assert stop_id not in base.token_ids[:2]
    out = complete(llm, PROMPT, greedy(16, stop_token_ids=[stop_id]))
    assert out.token_ids == base.token_ids[:3]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert_nothing_lingers(llm)


def test_s17_max_tokens_ends_the_output_with_reason_length(llm) -> None:
    out = complete(llm, PROMPT, greedy(5))
    assert len(out.token_ids) == 5
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_s17_min_tokens_holds_back_a_stop_token_greedy_would_emit_first(llm) -> None:
    first = complete(llm, PROMPT, greedy(16)).token_ids[0]
    assert complete(llm, PROMPT, greedy(16, stop_token_ids=[first])).token_ids == [first]
    out = complete(llm, PROMPT, greedy(16, stop_token_ids=[first], min_tokens=2))
    assert len(out.token_ids) >= 2
    assert first not in out.token_ids[:2]
    if out.finish_reason == "stop":  # it may come later, and then it stops the request
        assert out.token_ids[-1] == first and out.stop_reason == first


# --- text ------------------------------------------------------------------------------------


def test_output_text_is_the_decode_of_its_tokens_even_with_partial_utf8_characters(
    llm, random_prompt
) -> None:
    """Text is detokenized incrementally, a few tokens a step; the pieces must add up to
    the decode of the whole output, also where random tokens split UTF-8 characters."""
    prompts = [random_prompt(n, seed=20 + n) for n in (4, 9, 33)]
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=64, ignore_eos=True) for s in range(3)]
    completions = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert any("\ufffd" in c.text for c in completions), "no partial character: the case is not covered"
    for c in completions:
        assert c.text == llm.tokenizer.decode(c.token_ids)


def test_a_character_split_over_tokens_is_released_whole_once_its_last_byte_arrives(llm) -> None:
    """Fed one byte-level token per step, the text never shows a replacement character
    and ends as the decode of all the tokens."""
    text = "café 日本"
    byte_to_symbol = dict(zip(range(256), _gpt2_byte_symbols()))
    token_ids = [llm.tokenizer.token_to_id(byte_to_symbol[b]) for b in text.encode()]
    assert None not in token_ids
    processor = OutputProcessor(llm.tokenizer)
    parent = RequestOutput("r", None, [5], [CompletionOutput(index=0)])
    processor.add_request("r", parent, 0, SamplingParams(max_tokens=len(token_ids)))
    released = []
    for i, token in enumerate(token_ids):
        processor.process([EngineCoreOutput("r", [token], "length" if i == len(token_ids) - 1 else None)])
        released.append(parent.outputs[0].text)
    assert all("\ufffd" not in t for t in released)
    assert released[-1] == text
    assert released[3] == "caf" and released[4] == "café"  # é is two bytes: held, then whole


def _gpt2_byte_symbols() -> list[str]:
    """The printable stand-in of each byte in byte-level BPE vocabularies (GPT-2's table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_give_the_top_k_and_a_greedy_token_ranks_first(llm) -> None:
    out = complete(llm, PROMPT, greedy(8, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
    for token, entries in zip(out.token_ids, out.logprobs):
        assert len(entries) >= 3
        assert entries[token].rank == 1
        assert entries[token].logprob == max(e.logprob for e in entries.values())
        assert sorted(e.rank for e in entries.values())[:3] == [1, 2, 3]
        assert all(e.logprob <= 0.0 for e in entries.values())
        assert entries[token].decoded_token == llm.tokenizer.decode([token], False)


# --- refused values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("max_tokens", -1),
        ("min_tokens", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("stop", ""),
    ],
)
def test_invalid_sampling_value_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_a_value_error_naming_both() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_prompt_plus_max_tokens_over_max_model_len_is_a_value_error_naming_the_numbers(
    llm, random_prompt
) -> None:
    prompt = random_prompt(250, seed=5)
    with pytest.raises(ValueError) as error:
        llm.generate(prompt, greedy(10), use_tqdm=False)
    numbers = re.findall(r"\d+", str(error.value))
    assert {"250", "10", str(MAX_MODEL_LEN)} <= set(numbers), str(error.value)
    assert_nothing_lingers(llm)


def test_a_rejected_prompt_in_a_batch_leaves_no_request_of_the_batch_behind(llm, random_prompt) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([random_prompt(10, seed=6), random_prompt(250, seed=5)], greedy(10), use_tqdm=False)
    assert_nothing_lingers(llm)
    assert complete(llm, PROMPT, greedy(4)).finish_reason == "length"  # and the engine still serves


def test_unknown_engine_argument_is_a_type_error_naming_it(tiny_model_dir: Path) -> None:
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(model=str(tiny_model_dir), max_num_seq=8)


# --- nothing lingers -------------------------------------------------------------------------


def test_s18_requests_ended_by_a_stop_string_leave_nothing_in_the_engine(llm, random_prompt) -> None:
    """A stop string is found by the output processor, which then aborts the request in the engine."""
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 30, 70)]
    texts = [o.outputs[0].text for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    stops = [t[len(t) // 2 : len(t) // 2 + 3] for t in texts]
    outputs = llm.generate(prompts, [greedy(12, stop=s) for s in stops], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 3
    assert_nothing_lingers(llm)


def test_s18_an_interrupted_step_aborts_its_requests_and_the_engine_stays_usable(llm, monkeypatch) -> None:
    """A failure inside a step (Ctrl-C, a runner error) must not wedge the engine."""
    expected = complete(llm, [5, 6, 7, 8], greedy(4)).token_ids
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[9, 10, 11], [12, 13]], greedy(8), use_tqdm=False)
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    assert complete(llm, [5, 6, 7, 8], greedy(4)).token_ids == expected
    assert_nothing_lingers(llm)
