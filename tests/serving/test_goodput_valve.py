"""The goodput valve (``--tpot-slo``, docs/design.md §6 A7): the step-time meter, the
prediction on constructed states, the admit/refuse decisions, and through real engines."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from fastsched.engine import protocol
from fastsched.engine.step_time_meter import StepTimeFit, StepTimeMeter
from fastsched.frontend.admission import AdmissionController, SloError
from fastsched.frontend.async_llm import AsyncLLM
from fastsched.frontend.settings import FrontendSettings
from fastsched.frontend.slo_predictor import SloState, horizon, predict
from fastsched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_stack import Engines

STEP = StepTimeFit(base_s=0.010, per_token_s=0.001)  # 10 ms a step + 1 ms a token


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def controller(
    tpot_slo: float = 0.2, ttft_slo: float | None = None, budget: int = 100
) -> tuple[AdmissionController, Clock]:
    clock = Clock()
    ac = AdmissionController(FrontendSettings(tpot_slo=tpot_slo, ttft_slo=ttft_slo), clock=clock)
    ac.update_step_time(STEP, budget, 1)
    return ac, clock


# ------------------------------------------------------------------ the meter


def test_step_time_meter_fits_base_and_per_token_cost() -> None:
    meter = StepTimeMeter(min_data_steps=4)
    for tokens in (1, 10, 100, 500, 3, 50):
        meter.observe(tokens, STEP.step_time(tokens))
    fit = meter.fit
    assert fit is not None
    assert fit.base_s == pytest.approx(0.010) and fit.per_token_s == pytest.approx(0.001)


def test_step_time_meter_gives_no_fit_before_enough_steps() -> None:
    meter = StepTimeMeter(min_data_steps=4)
    for _ in range(3):
        meter.observe(10, 0.02)
    assert meter.fit is None
    meter.observe(10, 0.02)
    assert meter.fit == StepTimeFit(0.0, 0.002)  # one size only: no slope, the time spread over the tokens


def test_step_time_meter_window_forgets_old_steps() -> None:
    meter = StepTimeMeter(window_steps=4, min_data_steps=2)
    for tokens in (10, 20, 30, 40):
        meter.observe(tokens, 1.0)  # a slow engine
    for tokens in (10, 20, 30, 40):
        meter.observe(tokens, STEP.step_time(tokens))
    assert meter.fit is not None and meter.fit.per_token_s == pytest.approx(0.001)


def test_protocol_carries_the_step_time_fit() -> None:
    stats = protocol.EngineStats(step_time_base_s=0.01, step_time_per_token_s=0.002)
    decoded = protocol.decode(protocol.encode(protocol.Heartbeat(0, stats))).stats
    assert (decoded.step_time_base_s, decoded.step_time_per_token_s) == (0.01, 0.002)


# ------------------------------------------------------------------ the prediction (A7)


def test_a7_ttft_counts_the_steps_to_drain_the_backlog_beside_the_decodes() -> None:
    # 150 queued + 50 own over 100 - 20 = 80 tokens of room a step: 3 steps carrying 200 + 3 x 20 tokens.
    state = SloState(
        num_decoding=20, num_queued_tokens=150, prompt_tokens_per_s=0.0, token_budget=100, step=STEP
    )
    assert predict(state, 1, 50, horizon_s=2.0).ttft_s == pytest.approx(3 * 0.010 + 0.001 * (200 + 60))


def test_a7_tpot_is_the_decode_step_stretched_by_the_prompt_rate() -> None:
    # 100 tok/s admitted + the newcomer's 50 over 2 s = 125 tok/s: prompt takes 12.5 % of the engine.
    state = SloState(
        num_decoding=20, num_queued_tokens=0, prompt_tokens_per_s=100.0, token_budget=100, step=STEP
    )
    assert predict(state, 1, 50, horizon_s=2.0).tpot_s == pytest.approx((0.010 + 0.001 * 21) / (1 - 0.125))


def test_a7_predictions_are_unbounded_past_the_engines_capacity() -> None:
    full = SloState(
        num_decoding=100, num_queued_tokens=0, prompt_tokens_per_s=0.0, token_budget=100, step=STEP
    )
    assert predict(full, 1, 10, horizon_s=1.0).ttft_s == math.inf  # decodes fill the whole budget
    flooded = SloState(
        num_decoding=1, num_queued_tokens=0, prompt_tokens_per_s=990.0, token_budget=100, step=STEP
    )
    assert predict(flooded, 1, 10, horizon_s=1.0).tpot_s == math.inf  # 1000 prompt tok/s at 1 ms each


def test_a7_horizon_is_the_decode_life_at_the_target_clamped() -> None:
    assert horizon(16, 0.2) == pytest.approx(3.2)
    assert horizon(1, 0.2) == 1.0 and horizon(10_000, 0.2) == 30.0


# ------------------------------------------------------------------ the gate (A7)


def test_a7_is_off_until_the_engines_have_fitted_their_step_time() -> None:
    ac = AdmissionController(FrontendSettings(tpot_slo=1e-9))
    for i in range(3):
        ac.check_and_charge(f"r{i}", 1, 100, max_tokens=16)
    assert ac.rejections["slo"] == 0 and ac.prediction("r1") is None


def test_a7_admits_while_the_predicted_tpot_is_within_target_then_refuses() -> None:
    ac, clock = controller(tpot_slo=0.05)
    admitted = 0
    with pytest.raises(SloError) as info:
        for i in range(100):
            ac.check_and_charge(f"r{i}", 1, 100, max_tokens=20)  # horizon 20 x 0.05 = 1 s
            ac.mark_first_token(f"r{i}")
            admitted += 1
    # With k decoding, r_k predicts (10 ms + (k + 1) ms) / (1 - (k + 1) x 100 tokens/s x 1 ms):
    # 40 ms for k = 5, 56.7 ms for k = 6.
    assert admitted == 6
    error = info.value
    assert error.reason == "slo" and "tpot_slo" in str(error) and error.prediction.tpot_s > 0.05
    assert ac.rejections["slo"] == 1 and ac.num_in_flight == 6  # A5: no trace
    clock.now += 10.0  # the rate window has passed: room again
    ac.check_and_charge("later", 1, 100, max_tokens=20)


def test_a7_refuses_on_the_predicted_ttft_when_ttft_slo_is_set() -> None:
    ac, _ = controller(tpot_slo=10.0, ttft_slo=0.2)
    ac.check_and_charge("first", 1, 95)  # alone: admitted whatever the prediction
    with pytest.raises(SloError, match="TTFT") as info:
        ac.check_and_charge("second", 1, 95)  # 190 queued over 100 a step: 2 steps carrying 190 tokens
    assert info.value.prediction.ttft_s == pytest.approx(2 * 0.010 + 0.190)
    assert ac.rejections == {**ac.rejections, "slo": 1, "ttft_slo": 0}


def test_a7_admits_a_request_alone_whatever_it_predicts() -> None:
    ac, _ = controller(tpot_slo=1e-9)
    ac.check_and_charge("alone", 1, 100)
    prediction = ac.prediction("alone")
    assert prediction is not None and prediction.tpot_s > 1e-9


def test_a7_measures_its_prediction_errors_at_first_token_and_at_the_end() -> None:
    ac, clock = controller()
    ac.check_and_charge("r", 1, 50, max_tokens=5)
    prediction = ac.prediction("r")
    assert prediction is not None
    clock.now += 1.0
    ac.mark_first_token("r")
    clock.now += 0.4  # 4 more tokens: TPOT 0.1 s
    ac.release("r", num_output_tokens=5)
    ttft, tpot = ac.prediction_errors["ttft"], ac.prediction_errors["tpot"]
    assert ttft.count == 1 and ttft.sum == pytest.approx(abs(prediction.ttft_s - 1.0))
    assert tpot.count == 1 and tpot.sum == pytest.approx(abs(prediction.tpot_s - 0.1))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, True])
def test_a7_rejects_a_bad_tpot_slo_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="tpot_slo"):
        FrontendSettings(tpot_slo=bad)


def test_tpot_slo_flag_reaches_the_frontend_settings() -> None:
    from fastsched.entrypoints.cli import build_parser
    from fastsched.frontend.cli_args import frontend_settings

    args = build_parser().parse_args(["serve", "--tpot-slo", "0.2", "--ttft-slo", "2"])
    settings = frontend_settings(args)
    assert (settings.tpot_slo, settings.ttft_slo) == (0.2, 2.0)


# ------------------------------------------------------------------ through engine processes


def test_a7_through_engines_refuses_with_slo_once_the_step_time_is_fitted(launch_engines) -> None:
    engines: Engines = launch_engines(num_engines=1, num_frontends=1)
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def body() -> None:
        llm = await AsyncLLM.start(
            engines.input_addrs,
            engines.output_addrs[0],
            settings=FrontendSettings(ready_timeout=60, tpot_slo=1e-6),
        )
        try:
            async for _ in llm.generate("warm", prompt, params):  # 12 steps: enough for a fit
                pass
            for _ in range(200):  # the fit comes with the next engine message
                if llm.admission.step_time is not None:
                    break
                await asyncio.sleep(0.05)
            assert llm.admission.step_time is not None
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = llm.generate("running", prompt, long)
            await stream.__anext__()  # admitted alone; now in flight
            with pytest.raises(SloError):
                async for _ in llm.generate("refused", prompt, params):
                    pass
            status = await llm.request_status("refused")
            assert status is not None and status["reason"] == "slo"
            assert status["slo_prediction"]["tpot_s"] > 1e-6
            await stream.aclose()
            assert llm.admission.rejections["slo"] == 1
        finally:
            await llm.shutdown()

    asyncio.run(asyncio.wait_for(body(), 120))


# ------------------------------------------------------------------ metric and top


def _stats_with_errors(ttft_errors: list[float]) -> Any:
    from fastsched.frontend.admission import SLO_PREDICTION_ERROR_BUCKETS
    from fastsched.frontend.request_metrics import Histogram
    from fastsched.frontend.stats import LatencyHistograms, stats_to_proto

    h = Histogram(SLO_PREDICTION_ERROR_BUCKETS)
    for e in ttft_errors:
        h.observe(e)
    return stats_to_proto(
        {"engines": [{"index": 0}], "slo_prediction_error_seconds": {"ttft": h}}, LatencyHistograms()
    )


def test_a7_prediction_error_is_exported_with_its_sum_and_count() -> None:
    from fastsched.gateway.metrics import render

    text = render([_stats_with_errors([0.3, 0.1])], "m").decode()
    assert 'fastsched:slo_prediction_error_seconds_count{model_name="m",target="ttft"} 2.0' in text
    assert 'fastsched:slo_prediction_error_seconds_sum{model_name="m",target="ttft"} 0.4' in text
    off = render([stats_to_proto_without_valve()], "m").decode()
    assert "slo_prediction_error_seconds" not in off


def stats_to_proto_without_valve() -> Any:
    from fastsched.frontend.stats import LatencyHistograms, stats_to_proto

    return stats_to_proto({"engines": [{"index": 0}]}, LatencyHistograms())


def test_a7_top_shows_the_mean_prediction_error_over_the_window() -> None:
    from fastsched.gateway.metrics import render
    from fastsched.tools.metrics_snapshot import parse_metrics
    from fastsched.tools.top_view import top_view

    before = parse_metrics(render([_stats_with_errors([0.3])], "m", own_process=False).decode(), taken_at=0.0)
    after = parse_metrics(
        render([_stats_with_errors([0.3, 0.1, 0.2])], "m", own_process=False).decode(), taken_at=2.0
    )
    assert top_view(after, before).slo_prediction_error_s == {"ttft": pytest.approx(0.15)}
    assert top_view(after, None).slo_prediction_error_s == {}


def test_a7_prediction_of_a_rejected_request_reaches_the_request_status_message() -> None:
    from google.protobuf import json_format

    from fastsched.frontend.request_status import rejected_status
    from fastsched.frontend.slo_predictor import SloPrediction
    from fastsched.proto_gen import import_stubs

    pb, _ = import_stubs()
    error = SloError("SLO at risk", SloPrediction(ttft_s=1.5, tpot_s=math.inf))
    status = rejected_status("r", 0, error, 0.0, 10)
    assert status["reason"] == "slo" and status["slo_prediction"] == {"ttft_s": 1.5}  # unbounded: left out
    message = json_format.ParseDict(status, pb.RequestStatusResponse())
    assert message.slo_prediction.ttft_s == 1.5 and not message.slo_prediction.HasField("tpot_s")
