"""Async scheduling (the default): step N+1 is scheduled and prepared while step N's
forward pass runs, N's sampled tokens standing in as placeholders. Whatever it
overlaps, a request's tokens are those of the synchronous loop and of transformers,
and a request that ends in step N (EOS, a stop token, max_tokens, an abort) gets
nothing from step N+1, which was already scheduled with it.

Engine-level tests drive ``EngineCore.step()`` and look at every delta it returns;
``num_steps_in_flight`` shows that a step is in flight between two calls.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreOutput, EngineCoreRequest

PROMPT_LENGTHS = (3, 11, 26, 41, 63, 80)
MAX_TOKENS = (16, 24, 20, 17, 23, 18)
# 8 usable blocks for requests of up to 104 tokens: running requests must be preempted.
SMALL_POOL = dict(num_gpu_blocks=9, max_model_len=128)


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    return [random_prompt(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]


def make_core(model_dir: Path, async_scheduling: bool, **engine_args: object) -> EngineCore:
    return EngineCore(
        EngineConfig.from_kwargs(
            model=str(model_dir), log_stats_interval=0, async_scheduling=async_scheduling, **engine_args
        )
    )


class Run:
    """Drives an engine to the end, keeping every delta of every request."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.deltas: dict[str, list[EngineCoreOutput]] = defaultdict(list)

    def add(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        self.core.add_request(EngineCoreRequest(request_id, list(prompt), params))

    def step(self) -> None:
        for out in self.core.step():
            assert not self.finished(out.request_id), f"{out.request_id} got a delta after it finished"
            self.deltas[out.request_id].append(out)

    def to_end(self) -> None:
        while self.core.has_unfinished_requests():
            self.step()

    def finished(self, request_id: str) -> bool:
        return any(o.finish_reason is not None for o in self.deltas[request_id])

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.deltas[request_id] for t in o.new_token_ids]

    def finish_reason(self, request_id: str) -> str | None:
        return self.deltas[request_id][-1].finish_reason


def generate(core: EngineCore, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> Run:
    run = Run(core)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        run.add(str(i), prompt, p)
    run.to_end()
    return run


# --- the same tokens as the synchronous loop and transformers ---------------------------------


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        dict(max_num_batched_tokens=16, max_num_seqs=16),  # chunked prefills beside decodes
        SMALL_POOL,  # preemptions
        dict(SMALL_POOL, policy="priority"),
    ],
    ids=["default", "chunked", "preempting", "priority-preempting"],
)
def test_greedy_tokens_are_those_of_the_sync_loop_and_of_transformers(
    tiny_model_dir, prompts, greedy_reference, engine_args: dict
) -> None:
    params = [greedy(n) for n in MAX_TOKENS]
    expected = greedy_reference(prompts, MAX_TOKENS)
    runs = {}
    for async_scheduling in (True, False):
        core = make_core(tiny_model_dir, async_scheduling, **engine_args)
        run = generate(core, prompts, params)
        runs[async_scheduling] = [run.tokens(str(i)) for i in range(len(prompts))]
        assert all(run.finish_reason(str(i)) == "length" for i in range(len(prompts)))
        assert not core.has_unfinished_requests() and core.num_steps_in_flight == 0
        if engine_args.get("num_gpu_blocks"):
            assert core.scheduler.stats()["num_preemptions_total"] > 0
            assert core.scheduler.num_free_blocks == engine_args["num_gpu_blocks"] - 1
    assert runs[True] == runs[False] == expected


def test_a_step_is_in_flight_between_calls_only_with_async_scheduling(tiny_model_dir, prompts) -> None:
    for async_scheduling, in_flight in ((True, 1), (False, 0)):
        run = Run(make_core(tiny_model_dir, async_scheduling))
        run.add("a", prompts[0], greedy(8))
        run.step()
        assert run.core.num_steps_in_flight == in_flight
        assert len(run.tokens("a")) == 1  # the first call returns the first step's token either way
        run.to_end()
        assert len(run.tokens("a")) == 8


@pytest.mark.parametrize("kind", ["seeded", "penalties", "min_tokens", "logprobs"])
def test_sampling_that_reads_the_previous_token_is_the_same_as_in_the_sync_loop(
    tiny_model_dir, prompts, kind: str
) -> None:
    """Penalties count the placeholder token once it lands; a seeded request draws from
    its own generator once per token; min_tokens counts the placeholder as an output."""
    if kind == "seeded":
        params = [
            SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(MAX_TOKENS)
        ]
    elif kind == "penalties":
        params = [
            greedy(n, repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=0.5) for n in MAX_TOKENS
        ]
    elif kind == "min_tokens":
        params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n - 2) for n in MAX_TOKENS]
    else:
        params = [greedy(n, logprobs=3) for n in MAX_TOKENS]
    outputs, logprobs = {}, {}
    for async_scheduling in (True, False):
        run = generate(make_core(tiny_model_dir, async_scheduling), prompts, params)
        outputs[async_scheduling] = [
            (run.tokens(str(i)), run.finish_reason(str(i))) for i in range(len(prompts))
        ]
        logprobs[async_scheduling] = [o.new_logprobs for i in range(len(prompts)) for o in run.deltas[str(i)]]
    assert outputs[True] == outputs[False]
    # Same tokens and ranks; the values only as close as the batches' arithmetic (a step's
    # batch differs when a finished request still fills a row of the step after it).
    for with_async, without in zip(logprobs[True], logprobs[False], strict=True):
        if with_async is None or without is None:
            assert with_async is without is None
            continue
        for a, b in zip(with_async, without, strict=True):
            assert {t: rank for t, (_, rank) in a.items()} == {t: rank for t, (_, rank) in b.items()}
            assert all(a[t][0] == pytest.approx(b[t][0], abs=1e-5) for t in a)
    if kind == "penalties":  # the penalties changed something, or this compares nothing
        plain = generate(make_core(tiny_model_dir, True), prompts, [greedy(n) for n in MAX_TOKENS])
        assert [plain.tokens(str(i)) for i in range(len(prompts))] != [o[0] for o in outputs[True]]


# --- ends that land while the next step is already scheduled ---------------------------------


def test_an_abort_while_the_next_step_is_scheduled_drops_that_steps_token(tiny_model_dir, prompts) -> None:
    run = Run(make_core(tiny_model_dir, True))
    run.add("a", prompts[0], greedy(10))
    run.add("b", prompts[1], greedy(10))
    for _ in range(3):
        run.step()
    assert run.core.num_steps_in_flight == 1  # step 4, with both requests, is in flight
    before = run.tokens("a")
    run.core.abort_requests(["a"])
    run.to_end()
    assert run.tokens("a") == before and len(before) == 3  # nothing more for "a"
    assert not run.finished("a")  # an abort is not reported as a finish by the model
    assert len(run.tokens("b")) == 10 and run.finish_reason("b") == "length"
    assert run.core.scheduler.num_free_blocks == run.core.scheduler.config.num_gpu_blocks - 1


def test_a_stop_token_landing_in_step_n_gets_nothing_from_step_n_plus_1(tiny_model_dir, prompts) -> None:
    reference = generate(make_core(tiny_model_dir, False), prompts[:2], [greedy(12), greedy(12)])
    base = reference.tokens("0")
    k = next(j for j in range(2, len(base)) if base[j] not in base[:j])
    stop_id = base[k]
    for async_scheduling in (True, False):
        run = Run(make_core(tiny_model_dir, async_scheduling))
        run.add("stops", prompts[0], greedy(12, stop_token_ids=[stop_id]))
        run.add("goes-on", prompts[1], greedy(12))
        run.to_end()
        assert run.tokens("stops") == base[: k + 1]
        last = run.deltas["stops"][-1]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop_id)
        assert run.tokens("goes-on") == reference.tokens("1")


def test_max_tokens_and_a_stop_end_exactly_while_others_keep_the_next_step_busy(
    tiny_model_dir, prompts
) -> None:
    reference = generate(make_core(tiny_model_dir, False), [prompts[2]], [greedy(24)]).tokens("0")
    k = next(j for j in range(4, len(reference)) if reference[j] not in reference[:j])
    run = Run(make_core(tiny_model_dir, True))
    run.add("one-token", prompts[0], greedy(1))  # ends in its prefill step
    run.add("three-tokens", prompts[1], greedy(3))
    run.add("stops", prompts[2], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reference[k]]))
    run.add("long", prompts[3], greedy(20))
    run.to_end()
    assert len(run.tokens("one-token")) == 1 and run.finish_reason("one-token") == "length"
    assert len(run.tokens("three-tokens")) == 3 and run.finish_reason("three-tokens") == "length"
    assert run.tokens("stops") == reference[: k + 1] and run.finish_reason("stops") == "stop"
    assert len(run.tokens("long")) == 20


def test_stop_strings_and_aborts_through_llm_give_the_text_of_the_sync_loop(tiny_model_dir) -> None:
    texts = {}
    for async_scheduling in (True, False):
        llm = LLM(model=str(tiny_model_dir), log_stats_interval=0, async_scheduling=async_scheduling)
        base = llm.generate(["def hello(world):", "import os\n"], greedy(20), use_tqdm=False)
        stops = [o.outputs[0].text[6:9] for o in base]
        outs = llm.generate(
            ["def hello(world):", "import os\n"], [greedy(20, stop=s) for s in stops], use_tqdm=False
        )
        texts[async_scheduling] = [
            (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in [*base, *outs]
        ]
        assert not llm.engine.has_unfinished_requests()
        assert all(reason == "stop" for _, _, reason in texts[async_scheduling][2:])
    assert texts[True] == texts[False]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("failing", ["prepare", "execute"])
def test_a_step_that_fails_aborts_the_steps_in_flight_and_the_engine_stays_usable(
    tiny_model_dir, prompts, monkeypatch, async_scheduling: bool, failing: str
) -> None:
    core = make_core(tiny_model_dir, async_scheduling, num_gpu_blocks=64, max_model_len=256)
    expected = generate(core, [prompts[0]], [greedy(6)]).tokens("0")
    real = getattr(core.runner, failing)
    calls = {"n": 0}

    def fails_on_the_third_call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(core.runner, failing, fails_on_the_third_call)
    run = Run(core)
    run.add("a", prompts[1], greedy(8))
    run.add("b", prompts[2], greedy(8))
    with pytest.raises(RuntimeError, match="boom"):
        run.to_end()
    assert core.num_steps_in_flight == 0
    monkeypatch.setattr(core.runner, failing, real)
    run.to_end()  # the aborts are reported; nothing else comes
    assert not run.finished("a") and not run.finished("b")
    assert generate(core, [prompts[0]], [greedy(6)]).tokens("0") == expected
    assert not core.has_unfinished_requests()
    assert core.scheduler.num_free_blocks == 63
    assert core.runner.batch.num_unwritten_steps == 0


def test_no_step_is_scheduled_ahead_for_requests_that_all_reach_max_tokens(tiny_model_dir, prompts) -> None:
    """The core says whether a request runs after the steps in flight (``runs_after_in_flight``):
    the async loop then schedules no forward pass of dead rows, and steps as often as the sync one."""
    steps = {}
    for async_scheduling in (True, False):
        run = Run(make_core(tiny_model_dir, async_scheduling))
        run.add("a", prompts[0], greedy(5))
        run.add("b", prompts[1], greedy(3))
        run.to_end()
        assert len(run.tokens("a")) == 5 and len(run.tokens("b")) == 3
        steps[async_scheduling] = run.core.scheduler.stats()["num_steps"]
    assert steps[True] == steps[False]
