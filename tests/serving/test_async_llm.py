"""AsyncLLM + engine processes (docs/design.md §1, §6, §8), and the admission gates A1–A6 alone.

Model output is checked against ``fastsched.LLM`` on the same checkpoint (the offline
engine, itself checked against transformers): serving must not change a token.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from fastsched import _core  # noqa: E402
from fastsched.engine import protocol  # noqa: E402
from fastsched.engine.protocol import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from fastsched.frontend.admission import (  # noqa: E402
    AdmissionController,
    AdmissionError,
    EngineFaultedError,
    MaxQueuedTokensError,
    QueueOverflowError,
)
from fastsched.frontend.async_llm import AsyncLLM, EngineDeadError, StreamOutput  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.limits import LimitError  # noqa: E402
from fastsched.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from engine_stack import Engines

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = ["def main():\n    return", "The quick brown fox", "import os\nimport sys\n", "class Queue:"]


# ------------------------------------------------------------------ helpers


class FakeSharedAdmissionStats:
    """The A6 API of ``fastsched._core.SharedAdmissionStats`` over a Python list:
    one slot per frontend, a process writes its own slot, readers sum them all."""

    _segments: dict[str, list[int]] = {}

    def __init__(self, slots: list[int], slot: int | None) -> None:
        self._slots, self._slot = slots, slot
        self.before_total: Callable[[], None] | None = None  # lets a test interleave another frontend

    @classmethod
    def create(cls, name: str, num_slots: int) -> FakeSharedAdmissionStats:
        cls._segments[name] = [0] * num_slots
        return cls(cls._segments[name], None)

    @classmethod
    def open(cls, name: str, slot: int) -> FakeSharedAdmissionStats:
        return cls(cls._segments[name], slot)

    def add(self, delta: int) -> None:
        assert self._slot is not None
        self._slots[self._slot] += delta

    def set(self, value: int) -> None:
        assert self._slot is not None
        self._slots[self._slot] = value

    def own(self) -> int:
        assert self._slot is not None
        return self._slots[self._slot]

    def total(self) -> int:
        if self.before_total is not None:
            hook, self.before_total = self.before_total, None
            hook()
        return sum(self._slots)

    def unlink(self) -> None:
        self._segments.pop(next(k for k, v in self._segments.items() if v is self._slots), None)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@asynccontextmanager
async def connect(engines: Engines, frontend: int = 0, **kwargs: Any) -> AsyncIterator[AsyncLLM]:
    others = {k: kwargs.pop(k) for k in ("shared_stats", "engine_procs") if k in kwargs}
    llm = await AsyncLLM.start(
        engines.input_addrs,
        engines.output_addrs[frontend],
        frontend_index=frontend,
        settings=FrontendSettings(ready_timeout=60, **kwargs),
        **others,
    )
    try:
        yield llm
    finally:
        await llm.shutdown()


async def collect(llm: AsyncLLM, request_id: str, prompt: Any, params: SamplingParams) -> list[StreamOutput]:
    return [out async for out in llm.generate(request_id, prompt, params)]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def engines_idle(llm: AsyncLLM) -> bool:
    s = llm.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0


def texts(outputs: list) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outputs]


# ------------------------------------------------------------------ admission, no processes


def test_a1_unhealthy_engine_rejected_only_with_fault_tolerance() -> None:
    AdmissionController(FrontendSettings(fault_tolerance=False)).check_and_charge(
        "r", 1, 5, engine_healthy=False
    )
    ac = AdmissionController(FrontendSettings(fault_tolerance=True))
    with pytest.raises(EngineFaultedError) as e:
        ac.check_and_charge("r", 1, 5, engine_healthy=False)
    assert e.value.reason == "engine_faulted" and isinstance(e.value, AdmissionError)
    assert ac.rejections["engine_faulted"] == 1 and ac.num_in_flight == 0
    ac.check_and_charge("r", 1, 5, engine_healthy=True)


def test_a2_rejects_when_in_flight_plus_n_exceeds_max_num_queued_reqs() -> None:
    ac = AdmissionController(FrontendSettings(max_num_queued_reqs=2))
    ac.check_and_charge("a", 1, 10)
    ac.check_and_charge("b", 1, 10)
    with pytest.raises(QueueOverflowError) as e:
        ac.check_and_charge("c", 1, 10)
    assert e.value.reason == "max_num_queued_reqs"
    assert "max_num_queued_reqs (2)" in str(e.value) and "2 requests in flight" in str(e.value)
    assert (e.value.limit, e.value.current) == (2, 2)
    ac.release("a")
    ac.check_and_charge("c", 1, 10)
    assert ac.num_in_flight == 2


def test_a3_rejects_when_prefill_backlog_reaches_max_num_queued_tokens() -> None:
    ac = AdmissionController(FrontendSettings(max_num_queued_tokens=50))
    ac.check_and_charge("a", 1, 30)
    ac.check_and_charge("b", 1, 30)  # 30 < 50: admitted, backlog now 60
    with pytest.raises(MaxQueuedTokensError) as e:
        ac.check_and_charge("c", 1, 1)
    assert e.value.reason == "max_num_queued_tokens" and "60" in str(e.value) and "(50)" in str(e.value)
    ac.mark_first_token("a")  # decoding requests leave the backlog
    assert ac.num_queued_tokens == 30
    ac.check_and_charge("c", 1, 40)  # its own prompt is not counted: 30 + 40 > 50 is admitted
    with pytest.raises(
        LimitError, match="max_num_queued_tokens"
    ):  # A4: longer than the limit, never admitted
        ac.check_and_charge("d", 1, 51)
    ac.release("b")
    ac.release("c")
    assert ac.num_queued_tokens == 0 and ac.num_in_flight == 1


def test_a3_release_before_first_token_removes_its_prompt() -> None:
    ac = AdmissionController(FrontendSettings(max_num_queued_tokens=10))
    ac.check_and_charge("a", 1, 10)
    ac.release("a")
    assert ac.num_queued_tokens == 0
    ac.check_and_charge("b", 1, 10)


def test_a4_parent_of_n_is_checked_once_for_n_slots() -> None:
    ac = AdmissionController(FrontendSettings(max_num_queued_reqs=3))
    with pytest.raises(
        LimitError, match=r"n is 4, more than max_num_queued_reqs \(3\)"
    ):  # can never fit: a 400
        ac.check_and_charge("too-big", 4, 5)
    ac.check_and_charge("p", 3, 5)
    assert ac.num_in_flight == 3 and ac.num_requests == 1 and ac.num_queued_tokens == 15
    with pytest.raises(QueueOverflowError):
        ac.check_and_charge("q", 1, 5)
    for _ in range(5):  # one per sequence; extra calls change nothing
        ac.mark_first_token("p")
    assert ac.num_queued_tokens == 0
    ac.release("p")
    assert ac.num_in_flight == 0
    ac.check_and_charge("q", 3, 5)


def test_a5_rejection_leaves_no_trace_but_the_counter() -> None:
    ac = AdmissionController(FrontendSettings(max_num_queued_reqs=1, max_num_queued_tokens=1000))
    ac.check_and_charge("a", 1, 7)
    before = (ac.num_in_flight, ac.num_queued_tokens, ac.num_requests)
    for i in range(3):
        with pytest.raises(QueueOverflowError):
            ac.check_and_charge(f"x{i}", 1, 7)
    assert (ac.num_in_flight, ac.num_queued_tokens, ac.num_requests) == before
    assert ac.rejections == {
        "engine_faulted": 0,
        "max_num_queued_reqs": 3,
        "max_num_queued_tokens": 0,
        "ttft_slo": 0,
        "slo": 0,
        "max_sessions": 0,
    }
    ac.release("x0")  # never admitted: nothing to give back
    assert ac.num_in_flight == 1
    ac.release("a")
    ac.check_and_charge("x0", 1, 7)  # the rejected id is free to use


def test_a6_two_frontends_sharing_counters_respect_one_global_limit() -> None:
    FakeSharedAdmissionStats.create("a6-test", 2)
    fe0 = AdmissionController(
        FrontendSettings(max_num_queued_reqs=3), shared_stats=FakeSharedAdmissionStats.open("a6-test", 0)
    )
    fe1 = AdmissionController(
        FrontendSettings(max_num_queued_reqs=3), shared_stats=FakeSharedAdmissionStats.open("a6-test", 1)
    )
    fe0.check_and_charge("a", 2, 5)
    fe1.check_and_charge("b", 1, 5)
    with pytest.raises(QueueOverflowError):
        fe0.check_and_charge("c", 1, 5)
    with pytest.raises(QueueOverflowError):
        fe1.check_and_charge("c", 1, 5)
    assert (fe0.num_in_flight, fe1.num_in_flight, fe0.num_in_flight_total) == (2, 1, 3)
    fe0.release("a")
    fe1.check_and_charge("c", 2, 5)
    assert fe0.num_in_flight_total == fe1.num_in_flight_total == 3


def test_a6_racing_frontends_never_overshoot_the_global_limit() -> None:
    """Frontend 1 admits in the instant between frontend 0's increment and its read."""
    FakeSharedAdmissionStats.create("a6-race", 2)
    slot0 = FakeSharedAdmissionStats.open("a6-race", 0)
    fe0 = AdmissionController(FrontendSettings(max_num_queued_reqs=1), shared_stats=slot0)
    fe1 = AdmissionController(
        FrontendSettings(max_num_queued_reqs=1), shared_stats=FakeSharedAdmissionStats.open("a6-race", 1)
    )
    outcome = {}

    def fe1_races() -> None:
        try:
            fe1.check_and_charge("b", 1, 5)
            outcome["fe1"] = "admitted"
        except QueueOverflowError:
            outcome["fe1"] = "rejected"

    slot0.before_total = fe1_races
    fe0.check_and_charge("a", 1, 5)
    assert outcome == {"fe1": "rejected"} and fe0.num_in_flight_total == 1  # never 2 > 1
    assert fe1.num_in_flight == 0 and fe1.rejections["max_num_queued_reqs"] == 1


def test_a6_a_new_frontend_resets_its_stale_slot() -> None:
    FakeSharedAdmissionStats.create("a6-stale", 2)
    FakeSharedAdmissionStats.open("a6-stale", 1).set(7)  # left by a crashed predecessor
    ac = AdmissionController(
        FrontendSettings(max_num_queued_reqs=1), shared_stats=FakeSharedAdmissionStats.open("a6-stale", 1)
    )
    ac.check_and_charge("a", 1, 5)


@pytest.mark.skipif(
    not hasattr(_core, "SharedAdmissionStats"),
    reason="fastsched._core.SharedAdmissionStats is not built yet (A6 binding in progress)",
)
def test_a6_real_shared_admission_stats_across_two_controllers() -> None:
    name = f"fastsched-test-{os.getpid()}"
    segment = _core.SharedAdmissionStats.create(name, 2)
    try:
        fe0 = AdmissionController(
            FrontendSettings(max_num_queued_reqs=2), shared_stats=_core.SharedAdmissionStats.open(name, 0)
        )
        fe1 = AdmissionController(
            FrontendSettings(max_num_queued_reqs=2), shared_stats=_core.SharedAdmissionStats.open(name, 1)
        )
        fe0.check_and_charge("a", 1, 5)
        fe1.check_and_charge("b", 1, 5)
        with pytest.raises(QueueOverflowError):
            fe0.check_and_charge("c", 1, 5)
        fe1.release("b")
        fe0.check_and_charge("c", 1, 5)
        assert fe0.num_in_flight_total == 2
    finally:
        segment.unlink()


# ------------------------------------------------------------------ protocol


def test_protocol_round_trips_every_message() -> None:
    params = SamplingParams(n=2, temperature=0.5, stop="x", seed=3, logprobs=2)
    messages = [
        protocol.Hello(1),
        protocol.AddRequest(EngineCoreRequest("r", [1, 2], params, 12.5, -1), 1),
        protocol.AddRequest(EngineCoreRequest("s", [3], params, 1.0, cache_salt="tenant"), 0),
        protocol.Abort(["r", "s"]),
        protocol.Ready(0, protocol.ModelInfo("/m", "m", 64, 1000, 16, 9, 4)),
        protocol.Heartbeat(1, protocol.EngineStats(1, 2, 0.25, 3, 4, 5, 6, 7)),
        protocol.Outputs(
            0,
            [EngineCoreOutput("r", [5], "stop", 7, [{5: (-0.5, 1), 9: (-1.5, 2)}], 3)],
            protocol.EngineStats(),
            [protocol.RequestTiming("r", 0.1, 0.2, None)],
        ),
        protocol.Failed(0, "boom"),
    ]
    for msg in messages:
        assert protocol.decode(protocol.encode(msg)) == msg


@pytest.mark.parametrize(
    "wire",
    [
        b"\xc1",  # not msgpack
        msgpack.packb(["nope", 1]),
        msgpack.packb(["abort", "r"]),  # ids must be an array
        msgpack.packb(
            ["add", ["r", [1], {"n": "two"}, 0.0, 0, False, None, False], 0]
        ),  # wrong-typed sampling value
        msgpack.packb(["add", ["r", [1], {"evil": 1}, 0.0, 0, False, None, False], 0]),  # unknown field
        msgpack.packb(["add", ["r", [1], {}, 0.0, 0, False, None, False], -1]),  # negative frontend index
        msgpack.packb(["add", ["r", [1], {}, 0.0, 0, False, None, False], 0, 7]),  # a field too many
        msgpack.packb(["add", ["r", ["x"], {}, 0.0, 0, False, None, False], 0]),  # a token that is no int
        msgpack.packb(["pause", "paused_some", 1, 0]),  # not a pause state
        msgpack.packb(
            ["add", ["r", [1], {}, 0.0, 0, False, None, 7, False], 0]
        ),  # cache_salt must be a string
        msgpack.packb(["outputs", 0, [["r", [1], "weird", None, None, None, None]], {}, []]),
        msgpack.packb(["heartbeat", -1, {}]),
    ],
)
def test_protocol_rejects_malformed_messages(wire: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(wire)


def test_the_engine_trusts_the_sampling_params_a_frontend_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding an ADD checks the parameters' types, not their rules again: the frontend ran
    them (the grammar check included) when it built them."""
    params = SamplingParams(max_tokens=5, stop=["x"], structured_outputs={"choice": ["yes", "no"]})
    data = protocol.encode(protocol.AddRequest(EngineCoreRequest("r", [1, 2], params, 1.0), 0))

    def no_second_check(self: SamplingParams) -> None:
        raise AssertionError("SamplingParams validated again")

    monkeypatch.setattr(SamplingParams, "_validate", no_second_check)
    msg = protocol.decode(data)
    assert isinstance(msg, protocol.AddRequest) and type(msg.request.params) is SamplingParams
    assert msg.request.params == params and msg.request.params.structured_outputs.choice == ["yes", "no"]


def test_every_child_answers_the_launcher_on_the_same_wire() -> None:
    for msg in (protocol.FrontendReady(1, "127.0.0.1:5000"), protocol.Failed(1, "no port")):
        assert protocol.decode(protocol.encode(msg)) == msg


# ------------------------------------------------------------------ generation through engine processes


def test_generate_text_and_token_prompts_match_offline_llm(engines: Engines, oracle) -> None:
    params = SamplingParams(max_tokens=12, **GREEDY)
    token_prompt = oracle.tokenizer.encode(PROMPTS[1])
    expected = oracle.generate([PROMPTS[0], token_prompt], params, use_tqdm=False)

    async def body() -> None:
        async with connect(engines) as llm:
            text_run = await collect(llm, "text", PROMPTS[0], params)
            token_run = await collect(llm, "tokens", token_prompt, params)
            for run_, want in ((text_run, expected[0]), (token_run, expected[1])):
                final = run_[-1]
                assert final.finished and final.outputs[0].finish_reason == "length"
                assert final.outputs[0].token_ids == want.outputs[0].token_ids
                assert final.outputs[0].text == want.outputs[0].text
                # The deltas add up to the final output; snapshots are cumulative.
                assert "".join(d.text for o in run_ for d in o.deltas) == final.outputs[0].text
                assert sum((d.token_ids for o in run_ for d in o.deltas), []) == final.outputs[0].token_ids
                assert [len(o.outputs[0].token_ids) for o in run_] == sorted(
                    len(o.outputs[0].token_ids) for o in run_
                )
                assert final.metrics is not None and final.metrics.ttft is not None
                assert final.metrics.queue_time is not None and final.metrics.num_generation_tokens == 12
            assert text_run[-1].prompt == PROMPTS[0] and token_run[-1].prompt is None
            assert llm.model_info().vocab_size == oracle.engine.vocab_size

    run(body())


def test_n2_fans_out_in_the_frontend(engines: Engines, oracle) -> None:
    params = SamplingParams(n=2, max_tokens=8, **GREEDY)
    expected = oracle.generate(PROMPTS[2], params, use_tqdm=False)[0]

    async def body() -> None:
        async with connect(engines) as llm:
            final = (await collect(llm, "n2", PROMPTS[2], params))[-1]
            assert [c.index for c in final.outputs] == [0, 1]
            assert [c.token_ids for c in final.outputs] == [c.token_ids for c in expected.outputs]
            assert llm.stats()["num_sequences_in_flight"] == 0

    run(body())


def test_stop_string_ends_the_output_and_aborts_it_in_the_engine(engines: Engines, oracle) -> None:
    free = (
        oracle.generate(PROMPTS[3], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    stop = free[6:9]
    assert stop and free.index(stop) == 6, f"pick another stop string in {free!r}"
    params = SamplingParams(max_tokens=400, stop=stop, **GREEDY)
    expected = oracle.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0]

    async def body() -> None:
        async with connect(engines) as llm:
            final = (await collect(llm, "stop", PROMPTS[3], params))[-1].outputs[0]
            assert (final.text, final.finish_reason, final.stop_reason) == (expected.text, "stop", stop)
            assert final.text == free[:6]
            await wait_until(lambda: engines_idle(llm))  # not 400 tokens later
            # Issue 13: counted as vLLM counts it, a stop, its tokens and phases known.
            requests = llm.stats()["requests_by_engine"][0]
            assert requests.success == {"stop": 1, "length": 0, "abort": 0}
            assert requests.histograms["request_generation_tokens"].sum == len(final.token_ids)
            assert requests.histograms["request_decode_time_seconds"].count == 1
            assert requests.histograms["request_params_max_tokens"].sum == 400

    run(body())


def test_logprobs_cross_the_wire(engines: Engines, oracle) -> None:
    params = SamplingParams(max_tokens=5, logprobs=3, **GREEDY)
    expected = oracle.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].logprobs

    async def body() -> None:
        async with connect(engines) as llm:
            run_ = await collect(llm, "lp", PROMPTS[0], params)
            got = run_[-1].outputs[0].logprobs
            assert [set(step) for step in got] == [set(step) for step in expected]
            for g, e in zip(got, expected):
                for t in e:
                    assert g[t].rank == e[t].rank and g[t].decoded_token == e[t].decoded_token
                    assert g[t].logprob == pytest.approx(e[t].logprob, abs=1e-4)
            assert sum(len(d.logprobs) for o in run_ for d in o.deltas) == 5

    run(body())


def test_concurrent_requests_all_complete_on_both_engines(engines: Engines, oracle) -> None:
    params = SamplingParams(max_tokens=10, **GREEDY)
    prompts = PROMPTS * 3
    expected = oracle.generate(prompts, params, use_tqdm=False)

    async def body() -> None:
        async with connect(engines) as llm:
            streams = [llm.generate(f"c{i}", p, params) for i, p in enumerate(prompts)]
            assert {s.engine_index for s in streams} == {0, 1}  # least-loaded routing spreads them

            async def last(stream: Any) -> StreamOutput:
                return [o async for o in stream][-1]

            finals = await asyncio.gather(*(last(s) for s in streams))
            assert texts(finals) == texts(expected)
            s = llm.stats()
            assert s["num_requests_in_flight"] == 0 and all(e["num_in_flight"] == 0 for e in s["engines"])
            assert s["generation_tokens_total"] >= 10 * len(prompts)

    run(body())


def test_prompt_plus_max_tokens_over_max_model_len_names_both_numbers(engines: Engines) -> None:
    async def body() -> None:
        async with connect(engines) as llm:
            limit = llm.model_info().max_model_len
            with pytest.raises(ValueError, match=rf"plus max_tokens \({limit}\).*max_model_len \({limit}\)"):
                llm.generate("long", [5, 6], SamplingParams(max_tokens=limit))
            with pytest.raises(ValueError, match="out of range"):
                llm.generate("bad", [10**6], SamplingParams())
            assert llm.stats()["num_requests_in_flight"] == 0

    run(body())


def test_engine_process_speaks_the_protocol(engines: Engines) -> None:
    """The engine alone, driven over raw sockets as frontend 1: HELLO -> READY, an ADD it
    cannot take is answered as ignored (never left unanswered), ADD -> OUTPUTS with stats
    and timings, ABORT stops a request."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(engines.output_addrs[1])
    push.connect(engines.input_addrs[0])

    def receive(kind: type, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pull.poll(100):
                msg = protocol.decode(pull.recv())
                if isinstance(msg, kind) and msg.engine_index == 0:
                    return msg
        raise AssertionError(f"no {kind.__name__} from engine 0")

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        push.send(protocol.encode(protocol.AddRequest(EngineCoreRequest(request_id, prompt, params), 1)))

    try:
        push.send(protocol.encode(protocol.Hello(1)))
        assert receive(protocol.Ready, timeout=60).model_info.max_model_len == 4096  # engines may still load
        add("raw-bad", [10**6], 2)
        out = receive(protocol.Outputs).outputs[0]
        assert (out.request_id, out.finish_reason) == ("raw-bad", "ignored") and "out of range" in out.error
        add("raw-ok", [5, 6, 7], 3)
        tokens, timings = [], []
        while True:
            msg = receive(protocol.Outputs)
            tokens += [t for o in msg.outputs for t in o.new_token_ids]
            timings += msg.timings
            if any(o.finish_reason for o in msg.outputs):
                break
        assert len(tokens) == 3 and msg.outputs[-1].finish_reason == "length"
        assert (
            timings[-1].request_id == "raw-ok"
            and timings[-1].e2e >= timings[-1].ttft >= timings[-1].queue_time >= 0
        )
        add("raw-long", [5, 6, 7], 1000)
        receive(protocol.Outputs)
        push.send(protocol.encode(protocol.Abort(["raw-long"])))
        deadline = time.monotonic() + 5
        while (hb := receive(protocol.Heartbeat)).stats.num_running or hb.stats.kv_cache_usage:
            assert time.monotonic() < deadline, "the aborted request still holds the engine"
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------ admission through AsyncLLM


async def burst(llm: AsyncLLM, count: int, prompt: Any, params: SamplingParams) -> tuple[list, list]:
    async def one(i: int) -> StreamOutput:
        return (await collect(llm, f"b{i}", prompt, params))[-1]

    results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    return [r for r in results if isinstance(r, StreamOutput)], [
        r for r in results if isinstance(r, BaseException)
    ]


def test_a2_a5_burst_over_max_num_queued_reqs_is_rejected_and_counted(engines: Engines) -> None:
    async def body() -> None:
        async with connect(engines, max_num_queued_reqs=4) as llm:
            done, errors = await burst(llm, 40, PROMPTS[0], SamplingParams(max_tokens=4, **GREEDY))
            assert len(done) == 4 and len(errors) == 36  # a burst never overshoots on one frontend
            assert all(
                isinstance(e, QueueOverflowError) and e.reason == "max_num_queued_reqs" for e in errors
            )
            assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in done)
            s = llm.stats()
            assert s["admission_rejections_total"]["max_num_queued_reqs"] == len(errors)
            assert s["num_sequences_in_flight"] == 0 and s["num_queued_tokens"] == 0
            await collect(llm, "after", PROMPTS[0], SamplingParams(max_tokens=2))  # capacity is back

    run(body())


def test_a3_burst_over_max_num_queued_tokens_is_rejected(engines: Engines) -> None:
    prompt = list(range(10, 30))  # 20 tokens: admitted at backlog 0, 20, 40; refused at 60

    async def body() -> None:
        async with connect(engines, max_num_queued_tokens=50) as llm:
            done, errors = await burst(llm, 10, prompt, SamplingParams(max_tokens=3, **GREEDY))
            assert len(done) == 3 and len(errors) == 7
            assert all(
                isinstance(e, MaxQueuedTokensError) and e.reason == "max_num_queued_tokens" for e in errors
            )
            assert llm.stats()["admission_rejections_total"]["max_num_queued_tokens"] == 7
            assert llm.stats()["num_queued_tokens"] == 0

    run(body())


def test_a4_n3_is_admitted_once_for_three_slots(engines: Engines) -> None:
    async def body() -> None:
        async with connect(engines, max_num_queued_reqs=3) as llm:
            stream = llm.generate("parent", PROMPTS[0], SamplingParams(n=3, max_tokens=30, **GREEDY))
            assert llm.stats()["num_sequences_in_flight"] == 3
            with pytest.raises(QueueOverflowError):
                llm.generate("other", PROMPTS[1], SamplingParams(max_tokens=2))
            final = [o async for o in stream][-1]
            assert len(final.outputs) == 3 and all(len(c.token_ids) == 30 for c in final.outputs)
            assert llm.stats()["admission_rejections_total"]["max_num_queued_reqs"] == 1
            await collect(llm, "other", PROMPTS[1], SamplingParams(max_tokens=2))

    run(body())


def test_a6_two_frontends_on_the_same_engines_share_one_limit(engines: Engines) -> None:
    FakeSharedAdmissionStats.create("a6-serving", 2)

    def slot(i: int) -> FakeSharedAdmissionStats:
        return FakeSharedAdmissionStats.open("a6-serving", i)

    async def body() -> None:
        async with (
            connect(engines, 0, max_num_queued_reqs=4, shared_stats=slot(0)) as fe0,
            connect(engines, 1, max_num_queued_reqs=4, shared_stats=slot(1)) as fe1,
        ):
            params = SamplingParams(max_tokens=4, **GREEDY)
            (done0, errors0), (done1, errors1) = await asyncio.gather(
                burst(fe0, 10, PROMPTS[0], params), burst(fe1, 10, PROMPTS[1], params)
            )
            assert len(done0) + len(done1) == 4 and len(errors0) + len(errors1) == 16
            assert fe0.stats()["num_sequences_in_flight_total"] == 0

    run(body())


# ------------------------------------------------------------------ cancellation and aborts


def test_cancelled_consumer_aborts_the_request_in_the_engine(engines: Engines) -> None:
    async def body() -> None:
        async with connect(engines) as llm:
            params = SamplingParams(max_tokens=1000, **GREEDY)

            async def consume() -> None:
                async for _ in llm.generate("cancel-me", PROMPTS[0], params):
                    pass

            task = asyncio.create_task(consume())
            await wait_until(lambda: llm.stats()["num_running"] > 0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert llm.stats()["num_requests_in_flight"] == 0
            await wait_until(lambda: engines_idle(llm))

            stream = llm.generate("break-me", PROMPTS[1], params)  # a consumer that breaks out
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            await stream.aclose()
            await wait_until(lambda: engines_idle(llm))

    run(body())


def test_abort_ends_the_stream_with_finish_reason_abort(engines: Engines) -> None:
    async def body() -> None:
        async with connect(engines) as llm:
            stream = llm.generate("abort-me", PROMPTS[0], SamplingParams(max_tokens=1000, **GREEDY))
            outs = []
            async for out in stream:
                outs.append(out)
                if len(outs) == 2:
                    assert await llm.abort("abort-me")
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            assert not await llm.abort("abort-me")
            await wait_until(lambda: engines_idle(llm))
            requests = llm.stats()["requests_by_engine"][0]
            assert requests.success == {"stop": 0, "length": 0, "abort": 1}
            assert requests.histograms["request_prefill_time_seconds"].count == 1  # it had its first token
            assert requests.histograms["request_params_n"].count == 1

    run(body())


def test_shutdown_aborts_what_is_in_flight(engines: Engines) -> None:
    async def body() -> None:
        async with connect(engines) as llm:
            stream = llm.generate("left", PROMPTS[0], SamplingParams(max_tokens=4000, **GREEDY))
            await stream.__anext__()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await stream.__anext__()
        async with connect(engines, 1) as llm:  # not frontend 0: no orphan abort could do it
            await asyncio.sleep(0.6)  # current stats
            await wait_until(lambda: engines_idle(llm))

    run(body())


def test_outputs_of_unknown_requests_are_aborted(engines: Engines) -> None:
    """Outputs for a request this frontend does not know (left running by a crashed
    predecessor on the same address) make it abort that request."""
    import zmq

    async def body() -> None:
        async with connect(engines) as llm:

            def generated() -> int:
                return llm.stats()["engines"][1]["generation_tokens_total"]

            await asyncio.sleep(0.6)  # a heartbeat from each engine: stats are current
            before = generated()
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(engines.input_addrs[1])
            params = SamplingParams(max_tokens=4000, **GREEDY)
            push.send(
                protocol.encode(protocol.AddRequest(EngineCoreRequest("left-over", [5, 6, 7], params), 0))
            )
            push.close(linger=1000)
            ctx.term()
            await wait_until(lambda: generated() > before)
            await wait_until(lambda: engines_idle(llm))
            assert generated() - before < 4000

    run(body())


# ------------------------------------------------------------------ engine death


def test_a1_killed_engine_is_noticed_and_new_requests_fail_fast(launch_engines) -> None:
    lone_engine: Engines = launch_engines()

    async def body() -> None:
        # Frontend 0 knows the process (instant); frontend 1 only sees the silence.
        async with (
            connect(lone_engine, 0, fault_tolerance=True, engine_procs=lone_engine.procs) as ft,
            connect(lone_engine, 1, engine_timeout=1.5) as plain,
        ):
            params = SamplingParams(max_tokens=1000, **GREEDY)
            in_flight = [
                ft.generate("long-ft", PROMPTS[0], params),
                plain.generate("long", PROMPTS[0], params),
            ]
            first = [await s.__anext__() for s in in_flight]
            assert all(not o.finished for o in first)
            os.kill(lone_engine.procs[0].pid, signal.SIGKILL)
            await wait_until(lambda: not ft.is_healthy() and not plain.is_healthy(), timeout=5)
            for stream in in_flight:
                with pytest.raises(EngineDeadError):
                    async for _ in stream:
                        pass
            start = time.monotonic()
            with pytest.raises(EngineFaultedError):  # A1
                ft.generate("new", PROMPTS[1], SamplingParams())
            with pytest.raises(EngineDeadError):  # no fault tolerance: fails fast all the same
                plain.generate("new", PROMPTS[1], SamplingParams())
            assert time.monotonic() - start < 0.5
            assert ft.stats()["admission_rejections_total"]["engine_faulted"] == 1
            assert ft.stats()["num_sequences_in_flight"] == plain.stats()["num_sequences_in_flight"] == 0

    run(body())


def test_engine_that_fails_to_start_is_reported_at_once(launch_engines) -> None:
    bad = launch_engines(num_frontends=1, model="/nonexistent/model")

    async def body() -> None:
        with pytest.raises(RuntimeError, match="engine 0 failed to start.*does not exist"):
            await AsyncLLM.start(
                bad.input_addrs, bad.output_addrs[0], settings=FrontendSettings(ready_timeout=60)
            )

    run(body())
    bad.procs[0].join(10)
    assert bad.procs[0].exitcode == 1


def test_engine_exits_when_its_parent_dies(engine_config: dict, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import multiprocessing, sys, time
        from fastsched.engine import protocol
        from fastsched.engine.engine_proc import start_engine_process

        if __name__ == "__main__":
            receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
            proc = start_engine_process({engine_config!r}, 0, "ipc://{tmp_path}/in", ["ipc://{tmp_path}/out"],
                                        ready_pipe=send, torch_num_threads=1)
            assert isinstance(protocol.decode(receive.recv_bytes()), protocol.Ready)
            print(proc.pid, flush=True)
            time.sleep(120)
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _process_alive(engine_pid):
            assert time.monotonic() < deadline, f"engine {engine_pid} outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def _process_alive(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits on whoever reaps for pid 1)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_start_fails_clearly_when_an_engine_never_answers(tmp_path) -> None:
    addr = f"ipc://{tmp_path}/nobody.in"

    async def body() -> None:
        with pytest.raises(TimeoutError, match=r"engine\(s\) \[0\] did not report ready"):
            await AsyncLLM.start(
                [addr], f"ipc://{tmp_path}/fe.out", settings=FrontendSettings(ready_timeout=0.5)
            )

    run(body())
