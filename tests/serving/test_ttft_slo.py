"""The TTFT-SLO valve (``--ttft-slo``): ``max_num_queued_tokens`` set from the engines'
measured prefill throughput. The meter and the gate alone, then through real engines."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from fastsched.engine import protocol
from fastsched.engine.prefill_meter import PrefillThroughputMeter, prefill_tokens
from fastsched.frontend.admission import AdmissionController, TtftSloError
from fastsched.frontend.async_llm import AsyncLLM, StreamOutput
from fastsched.frontend.settings import FrontendSettings
from fastsched.frontend.stats import LatencyHistograms, stats_to_proto
from fastsched.gateway.metrics import render
from fastsched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_stack import Engines

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------ the meter


def test_meter_gives_no_estimate_before_enough_backlogged_time() -> None:
    meter = PrefillThroughputMeter(window_s=5.0, min_data_s=0.2, min_data_steps=4)
    for _ in range(3):
        meter.observe(100, 0.1, backlogged=True)
    assert meter.tokens_per_s is None  # 0.3 s but only 3 steps
    meter.observe(100, 0.1, backlogged=True)
    assert meter.tokens_per_s == pytest.approx(1000.0)


def test_meter_ignores_steps_after_which_nobody_waited() -> None:
    # Demand, not capacity: an engine with an empty queue must not look slow.
    meter = PrefillThroughputMeter(min_data_s=0.0, min_data_steps=1)
    meter.observe(10, 1.0, backlogged=False)
    assert meter.tokens_per_s is None
    meter.observe(500, 0.5, backlogged=True)
    meter.observe(0, 0.5, backlogged=True)  # a full active set: waiting, nothing prefilled
    assert meter.tokens_per_s == pytest.approx(500.0)


def test_meter_window_slides_over_busy_time() -> None:
    meter = PrefillThroughputMeter(window_s=1.0, min_data_s=0.0, min_data_steps=1)
    for _ in range(10):
        meter.observe(125, 0.125, backlogged=True)  # 1000 tokens/s
    for _ in range(10):
        meter.observe(375, 0.125, backlogged=True)  # the engine got faster: 3000 tokens/s
    assert meter.tokens_per_s == pytest.approx(3000.0)


def test_prefill_tokens_counts_prompt_only() -> None:
    # A chunk inside the prompt, a chunk crossing its end, a decode row, and a preempted
    # request recomputing its outputs after the prompt (not backlog: not counted).
    assert prefill_tokens([16, 16, 1, 8], [0, 24, 40, 30], [100, 30, 40, 30]) == (16 + 6, True)
    assert prefill_tokens([6, 1], [24, 40], [30, 40]) == (6, False)  # every prompt done: no backlog left


def test_engine_core_measures_prefill_throughput_when_requests_wait(tiny_model_dir) -> None:
    from fastsched.config import EngineConfig
    from fastsched.engine.core import EngineCore
    from fastsched.engine.protocol import EngineCoreRequest

    core = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=1,
            kv_cache_memory=8 * 1024 * 1024,
            log_stats_interval=0.0,
        )
    )
    core.prefill_meter = PrefillThroughputMeter(min_data_s=0.0, min_data_steps=1)
    for i in range(3):  # max_num_seqs=1: two of them wait behind the first
        core.add_request(
            EngineCoreRequest(f"r{i}", list(range(10, 40)), SamplingParams(max_tokens=2, **GREEDY))
        )
    first = core.step()
    assert [o.request_id for o in first] == ["r0"]
    rate = core.prefill_meter.tokens_per_s
    assert rate is not None and rate > 0  # 30 prompt tokens over that step's duration


# ------------------------------------------------------------------ the gate


def test_valve_is_off_without_ttft_slo() -> None:
    ac = AdmissionController()
    ac.update_prefill_throughput(10.0, floor_tokens=1)
    assert ac.queued_tokens_limit is None
    for i in range(5):
        ac.check_and_charge(f"r{i}", 1, 1000)


def test_valve_uses_the_floor_until_throughput_is_measured() -> None:
    ac = AdmissionController(FrontendSettings(ttft_slo=1.0))
    ac.update_prefill_throughput(None, floor_tokens=64)
    assert ac.queued_tokens_limit == 64
    for i in range(3):
        ac.check_and_charge(f"r{i}", 1, 20)  # backlog 0, 20, 40 -> 60
    with pytest.raises(TtftSloError) as info:
        ac.check_and_charge("r3", 1, 20)  # 60 + 20 > 64: its own prompt counts
    assert info.value.reason == "ttft_slo" and info.value.limit == 64 and info.value.current == 60
    assert "until prefill throughput is measured" in str(info.value)
    assert ac.rejections["ttft_slo"] == 1 and ac.num_queued_tokens == 60


def test_valve_limit_is_slo_times_measured_throughput_shared_by_frontends() -> None:
    ac = AdmissionController(FrontendSettings(ttft_slo=0.5, num_frontends=2))
    ac.update_prefill_throughput(1001.0, floor_tokens=64)
    assert ac.queued_tokens_limit == math.ceil(0.5 * 1001.0 / 2)  # 251
    ac.update_prefill_throughput(10.0, floor_tokens=64)
    assert ac.queued_tokens_limit == 3  # measured: the floor no longer applies


def test_valve_admits_a_request_alone_in_the_backlog_however_long() -> None:
    ac = AdmissionController(FrontendSettings(ttft_slo=1.0))
    ac.update_prefill_throughput(10.0, floor_tokens=8)
    ac.check_and_charge("long", 1, 5000)
    with pytest.raises(TtftSloError):
        ac.check_and_charge("next", 1, 1)
    ac.mark_first_token("long")  # its prompt left the backlog
    ac.check_and_charge("next", 1, 1)


def test_valve_counts_all_n_prompts_of_a_parent() -> None:
    ac = AdmissionController(FrontendSettings(ttft_slo=1.0))
    ac.update_prefill_throughput(100.0, floor_tokens=1)
    ac.check_and_charge("a", 1, 40)
    with pytest.raises(TtftSloError):
        ac.check_and_charge("b", 2, 40)  # 40 + 2 x 40 > 100
    ac.check_and_charge("c", 1, 40)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "1"])
def test_valve_rejects_a_bad_ttft_slo_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="ttft_slo"):
        AdmissionController(FrontendSettings(ttft_slo=bad))


def test_serve_config_rejects_a_bad_ttft_slo() -> None:
    from fastsched.launcher.serve_config import ServeConfig

    with pytest.raises(ValueError, match="ttft_slo"):
        ServeConfig(frontend=FrontendSettings(ttft_slo=0.0))


def test_ttft_slo_flag_reaches_the_serve_config() -> None:
    from fastsched.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--ttft-slo", "0.75"])
    assert args.ttft_slo == 0.75


# ------------------------------------------------------------------ wire and metrics


def test_protocol_carries_prefill_throughput_and_the_floor() -> None:
    stats = protocol.EngineStats(prefill_tokens_per_s=1234.5)
    assert protocol.decode(protocol.encode(protocol.Heartbeat(0, stats))).stats.prefill_tokens_per_s == 1234.5
    info = protocol.ModelInfo("/m", "m", 64, 1000, max_num_batched_tokens=512)
    assert protocol.decode(protocol.encode(protocol.Ready(0, info))).model_info.max_num_batched_tokens == 512
    import msgpack

    with pytest.raises(protocol.ProtocolError, match="prefill_tokens_per_s"):
        protocol.decode(msgpack.packb(["heartbeat", 0, {"prefill_tokens_per_s": "fast"}]))


def test_metrics_show_the_limit_and_throughput_only_when_known() -> None:
    engine = {"index": 0, "prefill_tokens_per_s": 2000.0, "scan_stops_total": {"active_seqs": 3}}
    on = [
        stats_to_proto({"engines": [engine], "admission_queued_tokens_limit": 700}, LatencyHistograms()),
        stats_to_proto({"engines": [engine], "admission_queued_tokens_limit": 300}, LatencyHistograms()),
    ]
    text = render(on, "m").decode()
    assert (
        'fastsched:admission_queued_tokens_limit{model_name="m"} 1000.0' in text
    )  # the frontends' shares summed
    assert 'fastsched:prefill_throughput_tokens_per_second{engine="0",model_name="m"} 2000.0' in text
    assert 'fastsched:admission_rejections_total{model_name="m",reason="ttft_slo"} 0.0' in text
    off = render([stats_to_proto({"engines": [{"index": 0}]}, LatencyHistograms())], "m").decode()
    assert "admission_queued_tokens_limit" not in off
    assert "fastsched:prefill_throughput_tokens_per_second{" not in off


# ------------------------------------------------------------------ through engine processes


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _collect(llm: AsyncLLM, request_id: str, prompt: Any, params: SamplingParams) -> StreamOutput:
    return [out async for out in llm.generate(request_id, prompt, params)][-1]


def test_valve_through_engines_floor_first_then_the_measured_limit(launch_engines) -> None:
    engines: Engines = launch_engines(
        num_engines=1, num_frontends=1, max_num_batched_tokens=64, max_num_seqs=2
    )
    prompt = list(range(10, 30))  # 20 tokens

    async def body() -> None:
        llm = await AsyncLLM.start(
            engines.input_addrs,
            engines.output_addrs[0],
            settings=FrontendSettings(ready_timeout=60, ttft_slo=0.5),
        )
        try:
            assert llm.stats()["admission_queued_tokens_limit"] == 128  # the floor: two steps of one engine
            params = SamplingParams(max_tokens=3, **GREEDY)
            results = await asyncio.gather(
                *(_collect(llm, f"b{i}", prompt, params) for i in range(12)), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            assert len(errors) == 6  # admitted at backlog 0, 20, ..., 100; 120 + 20 > 128
            assert all(isinstance(e, TtftSloError) and e.reason == "ttft_slo" for e in errors)
            assert llm.stats()["admission_rejections_total"]["ttft_slo"] == 6
            # Keep requests waiting (max_num_seqs=2) until the engine has measured its drain rate.
            for round_ in range(40):
                if llm.admission.prefill_tokens_per_s is not None:
                    break
                batch = [
                    _collect(llm, f"m{round_}.{i}", prompt, SamplingParams(max_tokens=8, **GREEDY))
                    for i in range(3)
                ]
                await asyncio.gather(*batch, return_exceptions=True)
            rate = llm.admission.prefill_tokens_per_s
            assert rate is not None and rate > 0
            assert llm.stats()["engines"][0]["prefill_tokens_per_s"] is not None
            assert llm.admission.queued_tokens_limit == math.ceil(0.5 * rate)
        finally:
            await llm.shutdown()

    run(body())
