"""``fastsched simulate`` as specifications: the replay of a trace through the real
scheduler on a virtual clock gives the times one can compute by hand, counts
admission rejections and preemptions, and reads traces strictly.

Step cost in every hand-computed case: a = 10 ms per step, b = 1 ms per batched
token, c = 2 ms per running request, so a lone request with a 10-token prompt has
its first token after 10 + 10 + 2 = 22 ms and each further token 10 + 1 + 2 = 13 ms later.
Nothing here runs a model or asserts on wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from fastsched import SchedulerConfig
from fastsched.engine.step_trace import StepTracer
from fastsched.entrypoints.cli import build_parser, main
from fastsched.tools.bench_report import summarize
from fastsched.tools.simulator import (
    Simulator,
    StepCost,
    TraceRequest,
    bench_trace,
    fit_step_cost,
    load_trace,
)
from fastsched.tools.simulator.cost import read_step_trace
from fastsched.tools.workload import arrival_times, make_requests

COST = StepCost(a=0.010, b=0.001, c=0.002)
PREFILL_10 = 0.010 + 10 * 0.001 + 0.002  # one 10-token prompt alone
DECODE_1 = 0.010 + 0.001 + 0.002  # one request decoding alone
SCHEDULER: dict[str, Any] = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=4,
    num_gpu_blocks=257,
)


def simulator(cost: StepCost = COST, **overrides: Any) -> Simulator:
    """A simulator over :data:`SCHEDULER`; admission and latency keywords go to the Simulator."""
    sim_keys = {
        "max_num_queued_reqs",
        "max_num_queued_tokens",
        "ttft_slo",
        "tpot_slo",
        "frontend_latency",
        "step_tracer",
    }
    sim_kwargs = {k: v for k, v in overrides.items() if k in sim_keys}
    sched_kwargs = {k: v for k, v in overrides.items() if k not in sim_keys}
    return Simulator(SchedulerConfig(**{**SCHEDULER, **sched_kwargs}), cost, **sim_kwargs)


def req(
    arrival: float, prompt_len: int = 10, output_len: int = 5, priority: int = 0, start: int = 0
) -> TraceRequest:
    """Distinct prompts unless ``start`` is shared (no accidental prefix-cache hits)."""
    first = 10 + start if start else 10 + int(arrival * 1000) % 200
    return TraceRequest(arrival, tuple(range(first, first + prompt_len)), output_len, priority)


# ----------------------------------------------------------------- hand-computable timing


def test_a_lone_request_has_ttft_of_one_prefill_step_then_one_decode_step_per_token() -> None:
    run = simulator().run([req(0.5)])
    [r] = run.results
    assert r.status == 200 and r.output_tokens == 5
    assert r.ttft == pytest.approx(PREFILL_10)
    assert r.e2e == pytest.approx(PREFILL_10 + 4 * DECODE_1)
    assert r.itl == pytest.approx([DECODE_1] * 4)
    assert run.duration_s == pytest.approx(0.5 + PREFILL_10 + 4 * DECODE_1)  # from the rate's start
    assert run.num_steps == 5
    summary = summarize(1.0, run.results, run.duration_s)
    assert summary["median_tpot_ms"] == pytest.approx(DECODE_1 * 1000)
    assert summary["output_throughput"] == pytest.approx(5 / run.duration_s)


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks() -> None:
    [r] = simulator().run([req(0.0, prompt_len=100, output_len=1)]).results
    chunks = (0.010 + 64 * 0.001 + 0.002) + (0.010 + 36 * 0.001 + 0.002)  # budget 64, then the rest
    assert r.ttft == pytest.approx(chunks)
    assert r.e2e == pytest.approx(chunks)


def test_simultaneous_arrivals_share_one_prefill_step() -> None:
    run = simulator().run([req(0.0, start=1), req(0.0, start=100)])
    both = 0.010 + 20 * 0.001 + 2 * 0.002
    assert [r.ttft for r in run.results] == pytest.approx([both, both])


def test_a_request_arriving_during_a_step_waits_for_its_end() -> None:
    first, second = req(0.0, start=1), req(0.011, start=100)  # halfway through the first's prefill
    run = simulator().run([first, second])
    mixed = 0.010 + (1 + 10) * 0.001 + 2 * 0.002  # first's decode beside second's prefill
    assert run.results[1].ttft == pytest.approx(PREFILL_10 - 0.011 + mixed)


def test_an_idle_engine_jumps_to_the_next_arrival() -> None:
    run = simulator().run([req(0.0, start=1), req(10.0, start=100)])
    assert [r.ttft for r in run.results] == pytest.approx([PREFILL_10, PREFILL_10])
    assert run.results[1].send_time == 10.0
    assert run.duration_s == pytest.approx(10.0 + PREFILL_10 + 4 * DECODE_1)


def test_frontend_latency_is_added_to_ttft_and_e2e_but_not_to_token_gaps() -> None:
    [r] = simulator(frontend_latency=0.005).run([req(0.0)]).results
    assert r.ttft == pytest.approx(PREFILL_10 + 0.005)
    assert r.e2e == pytest.approx(PREFILL_10 + 4 * DECODE_1 + 0.005)
    assert r.itl == pytest.approx([DECODE_1] * 4)


def test_each_trace_on_one_simulator_is_timed_from_its_own_start() -> None:
    sim = simulator()
    first = sim.run([req(1.0, start=1)], label="a")
    second = sim.run([req(1.0, start=100)], label="b")
    assert second.results[0].ttft == pytest.approx(first.results[0].ttft)
    assert second.duration_s == pytest.approx(first.duration_s)


def test_the_priority_policy_serves_the_more_urgent_request_first() -> None:
    lazy, urgent = req(0.0, priority=5, start=1), req(0.0, priority=0, start=100)
    run = simulator(policy="priority", max_num_seqs=1, max_num_batched_tokens=64).run([lazy, urgent])
    assert run.results[1].ttft == pytest.approx(PREFILL_10)
    assert run.results[0].ttft > run.results[1].e2e


def test_a_simulation_is_deterministic() -> None:
    trace = bench_trace(50, qps=40.0, prompt_len=40, output_len=16, seed=3)
    runs = [simulator(num_gpu_blocks=64).run(trace) for _ in range(2)]
    assert runs[0].results == runs[1].results
    assert runs[0].num_steps == runs[1].num_steps


# ----------------------------------------------------------------- admission, preemption, refusals


def test_max_num_queued_reqs_rejects_simultaneous_arrivals_past_the_limit() -> None:
    run = simulator(max_num_queued_reqs=1).run([req(0.0, start=s) for s in (1, 50, 100)])
    assert [r.status for r in run.results] == [200, 503, 503]
    summary = summarize(1.0, run.results, run.duration_s)
    assert summary["rejected"] == {"max_num_queued_reqs": 2}
    assert summary["completed"] == 1


def test_max_num_queued_tokens_rejects_until_the_backlog_has_its_first_token() -> None:
    trace = [req(0.0, start=1), req(0.0, start=50), req(PREFILL_10 + 0.001, start=100)]
    run = simulator(max_num_queued_tokens=10).run(trace)
    assert [(r.status, r.reason) for r in run.results] == [
        (200, None),
        (503, "max_num_queued_tokens"),
        (200, None),
    ]


def test_a_request_admitted_during_a_step_is_checked_before_that_step_releases_anything() -> None:
    # The second arrives while the first's last step runs: its slot is still taken.
    first = req(0.0, output_len=1, start=1)
    run = simulator(max_num_queued_reqs=1).run([first, req(PREFILL_10 / 2, start=100)])
    assert [r.status for r in run.results] == [200, 503]


def test_ttft_slo_admits_only_the_floor_of_two_steps_before_the_engine_has_measured() -> None:
    # Budget 64 tokens a step: the floor is 2 x 64 = 128 queued prompt tokens, 8 prompts of 16.
    sim = simulator(ttft_slo=1.0)
    assert sim.admission.queued_tokens_limit == 128
    run = sim.run([req(0.0, prompt_len=16, start=1 + 20 * k) for k in range(10)])
    assert [r.status for r in run.results] == [200] * 8 + [503] * 2
    assert summarize(1.0, run.results, run.duration_s)["rejected"] == {"ttft_slo": 2}


def test_after_measurement_the_ttft_slo_limit_is_slo_times_the_measured_prefill_throughput() -> None:
    # Budget 16: a lone 200-token prompt is prefilled in 12 full chunks left partial (backlogged,
    # measured) and a last 8-token chunk that leaves nothing over (not measured).
    sim = simulator(ttft_slo=1.0, max_num_batched_tokens=16)
    assert sim.admission.queued_tokens_limit == 32  # the floor; a request alone is admitted anyway
    run = sim.run([req(0.0, prompt_len=200, output_len=1, start=1)], label="measure")
    assert run.results[0].status == 200
    chunk = 0.010 + 16 * 0.001 + 0.002
    assert run.prefill_tokens_per_s == pytest.approx(16 / chunk)  # 571.4 tokens/s
    assert (
        run.queued_tokens_limit
        == sim.admission.queued_tokens_limit
        == math.ceil(1.0 * run.prefill_tokens_per_s)
    )
    assert run.queued_tokens_limit == 572
    # The next burst meets the measured limit: 11 prompts of 50 = 550 <= 572, a 12th would make 600.
    burst = sim.run([req(0.0, prompt_len=50, start=1000 + 60 * k) for k in range(13)], label="burst")
    assert [r.status for r in burst.results] == [200] * 11 + [503] * 2
    assert {r.reason for r in burst.results if r.status == 503} == {"ttft_slo"}


def _goodput(results: list[Any], ttft: float, tpot: float) -> int:
    """Requests answered within both targets (bench serve's TPOT: mean gap after the first token)."""
    return sum(
        1
        for r in results
        if r.status == 200
        and r.ttft <= ttft
        and (r.output_tokens < 2 or (r.e2e - r.ttft) / (r.output_tokens - 1) <= tpot)
    )


def test_a7_the_simulator_runs_the_goodput_valve_and_it_raises_goodput_at_overload() -> None:
    # 60 prompts of 60 tokens in 3 s against a 64-token budget: prompt alone takes ~1.3x the engine.
    trace = [req(k * 0.05, prompt_len=60, output_len=20, start=1 + 70 * k) for k in range(60)]
    ttft, tpot = 1.0, 0.05
    off = simulator(ttft_slo=ttft).run(trace)
    on_sim = simulator(ttft_slo=ttft, tpot_slo=tpot)
    on = on_sim.run(trace)
    assert {r.reason for r in on.results if r.status == 503} >= {"slo"}
    assert on_sim.admission.step_time is not None  # fitted on the modelled steps
    assert _goodput(on.results, ttft, tpot) > _goodput(off.results, ttft, tpot)
    # Measured for every request admitted once the step time was fitted (not the first few).
    assert 0 < on_sim.admission.prediction_errors["ttft"].count < sum(r.status == 200 for r in on.results)


def test_a_small_kv_pool_preempts_and_every_request_still_gets_all_its_tokens() -> None:
    # 8 usable blocks of 4 tokens; each request grows to 28 tokens = 7 blocks.
    trace = [req(0.0, prompt_len=8, output_len=20, start=s) for s in (1, 100)]
    run = simulator(num_gpu_blocks=9).run(trace)
    assert run.num_preemptions >= 1 and run.num_preempted_requests >= 1
    assert [(r.status, r.output_tokens) for r in run.results] == [(200, 20), (200, 20)]


def test_a_request_longer_than_max_model_len_is_refused_like_the_server_does() -> None:
    run = simulator().run([req(0.0, prompt_len=200, output_len=100)])
    [r] = run.results
    assert (r.status, r.reason) == (400, "invalid_request")
    assert "max_model_len (256)" in (r.error or "")
    assert run.num_steps == 0


def test_a_prompt_larger_than_the_whole_pool_is_refused_as_ignored() -> None:
    [r] = simulator(num_gpu_blocks=4).run([req(0.0, prompt_len=40, output_len=1)]).results
    assert (r.status, r.reason) == (400, "invalid_request")


# ----------------------------------------------------------------- traces


def test_the_generated_trace_is_what_bench_serve_sends_at_that_rate() -> None:
    trace = bench_trace(20, qps=5.0, prompt_len=64, output_len=16, seed=7, rate_index=1)
    sent = make_requests(20, 64, 16, 7, (10, 250))
    times = arrival_times(20, 5.0, 7 + 1 + 1)  # run_bench's seed for its second rate
    assert [r.prompt_token_ids for r in trace] == [tuple(b.prompt_token_ids) for b in sent]
    assert [r.output_len for r in trace] == [b.max_tokens for b in sent]
    assert [r.arrival_time for r in trace] == times
    # --random-range-ratio, shared with bench serve: 0 makes every length exact in both.
    exact = bench_trace(5, qps=5.0, prompt_len=64, output_len=16, seed=7, range_ratio=0.0)
    assert [r.prompt_token_ids for r in exact] == [
        tuple(b.prompt_token_ids) for b in make_requests(5, 64, 16, 7, (10, 250), 0.0)
    ]
    assert {(r.prompt_len, r.output_len) for r in exact} == {(64, 16)}


def test_load_trace_reads_lengths_and_priorities_and_sorts_by_arrival(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"arrival_time": 1.5, "prompt_len": 3, "output_len": 2}\n\n'
        '{"arrival_time": 0.5, "prompt_len": 4, "output_len": 1, "priority": -1}\n'
    )
    trace = load_trace(path, seed=0)
    assert [(r.arrival_time, r.prompt_len, r.output_len, r.priority) for r in trace] == [
        (0.5, 4, 1, -1),
        (1.5, 3, 2, 0),
    ]
    assert load_trace(path, seed=0) == trace  # prompt ids are seeded


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt_len": 3, "output_len": 2}', "missing field 'arrival_time'"),
        ('{"arrival_time": -1, "prompt_len": 3, "output_len": 2}', "field 'arrival_time'"),
        ('{"arrival_time": 0, "prompt_len": 0, "output_len": 2}', "field 'prompt_len'"),
        ('{"arrival_time": 0, "prompt_len": 3, "output_len": 2.5}', "field 'output_len'"),
        ('{"arrival_time": 0, "prompt_len": 3, "output_len": 2, "priority": "high"}', "field 'priority'"),
        ("[1, 2, 3]", "expected a JSON object"),
        ("{", "not JSON"),
    ],
)
def test_load_trace_names_the_bad_field_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_time": 0, "prompt_len": 3, "output_len": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"trace.jsonl:2: {message}"):
        load_trace(path)


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(path)


def test_the_simulated_step_trace_fits_back_to_the_cost_model(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    tracer = StepTracer(path)
    run = simulator(step_tracer=tracer).run(bench_trace(30, qps=50.0, prompt_len=40, output_len=8, seed=1))
    tracer.close()
    steps = read_step_trace([path])
    assert len(steps) == run.num_steps
    fit = fit_step_cost(steps)
    assert (fit.cost.a, fit.cost.b, fit.cost.c) == pytest.approx((COST.a, COST.b, COST.c))


# ----------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastsched.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sim-tiny") / "model")


def simulate_args(tiny_model: Path, *extra: str) -> list[str]:
    return [
        "simulate",
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-progress",
        "--step-cost",
        "0.002",
        "0.00002",
        "0.0001",
        *extra,
    ]


def test_simulate_command_reports_rejections_and_writes_json(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "sim.json"
    argv = simulate_args(
        tiny_model,
        "--num-gpu-blocks",
        "300",
        "--qps",
        "inf",
        "--num-requests",
        "6",
        "--prompt-len",
        "32",
        "--output-len",
        "8",
        "--max-num-queued-reqs",
        "2",
        "--out",
        str(out),
    )
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "max_num_queued_reqs: 4" in printed and "preemptions" in printed
    report = json.loads(out.read_text())
    assert report["config"]["num_gpu_blocks"] == 300
    [result] = report["results"]
    assert (result["qps"], result["completed"], result["rejected"]) == ("inf", 2, {"max_num_queued_reqs": 4})
    assert result["num_steps"] > 0 and result["num_preemptions"] == 0
    assert result["failed"] == 4 and result["num_errors"] == 0  # vLLM's `failed`: every request not completed


def test_simulate_command_applies_ttft_slo_and_reports_its_rejections(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "sim.json"
    argv = simulate_args(
        tiny_model,
        "--num-gpu-blocks",
        "300",
        "--qps",
        "inf",
        "--num-requests",
        "6",
        "--prompt-len",
        "32",
        "--output-len",
        "8",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--ttft-slo",
        "1",
        "--out",
        str(out),
    )
    assert main(argv) == 0
    assert "ttft_slo limit" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["ttft_slo"] == 1.0
    [result] = report["results"]
    assert set(result["rejected"]) == {"ttft_slo"}  # a burst over the floor of 2 x 32 tokens
    assert result["completed"] + result["rejected"]["ttft_slo"] == 6


def test_simulate_sizes_the_kv_pool_like_the_engine(tiny_model: Path, tmp_path: Path) -> None:
    import torch

    from fastsched.config import EngineConfig
    from fastsched.model_loader import load_model_config
    from fastsched.tools.simulator.sizing import simulated_engine
    from fastsched.worker.model_runner import kv_cache_bytes_per_block

    config = EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", kv_cache_memory=8 * 2**20)
    engine = simulated_engine(config)
    per_block = kv_cache_bytes_per_block(load_model_config(str(tiny_model)), 16, torch.float32)
    assert engine.num_gpu_blocks == 8 * 2**20 // per_block + 1
    assert engine.scheduler_config.num_gpu_blocks == engine.num_gpu_blocks
    assert engine.max_model_len == load_model_config(str(tiny_model)).max_position_embeddings


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((), "--cost-model FILE or --step-cost"),
        (("--trace", "t.jsonl", "--qps", "2"), "exclude each other"),
        (("--qps", "0"), "must be positive"),
    ],
)
def test_simulate_command_refuses_contradictory_flags(
    tiny_model: Path, extra: tuple[str, ...], message: str, capsys: pytest.CaptureFixture
) -> None:
    argv = simulate_args(tiny_model, *extra)
    if not extra:
        argv = argv[: argv.index("--step-cost")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_simulate_help_explains_every_flag() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    simulate = sub.choices["simulate"]
    for action in simulate._actions:
        assert action.help and action.help != argparse.SUPPRESS, f"{action.option_strings} has no help"
    flags = {s for a in simulate._actions for s in a.option_strings}
    assert {
        "--trace",
        "--qps",
        "--seed",
        "--cost-model",
        "--step-cost",
        "--max-num-queued-reqs",
        "--max-num-queued-tokens",
        "--ttft-slo",
        "--frontend-latency",
        "--out",
        "--num-gpu-blocks",
    } <= flags
