"""``fastsched plan`` (docs/design.md §6 sizing guidance) as specifications.

The numbers come from the seed article's §8: the worked example (λ = 20/s, 512 output
tokens, 20 ms steps, 2000-token prompts, 20k tok/s prefill → ≈ 207 requests in the
system) and its 32-layer / 8-KV-head / head-dim-128 model (128 KiB of fp16 KV per
token, 512 MiB per 4K request, 120 of them in 60 GiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from fastsched.tools.plan import add_plan_parser, run_plan
from fastsched.tools.planner import (
    STATUS_NOT_SERVABLE,
    STATUS_OK,
    STATUS_TIGHT,
    PlanInputs,
    plan,
)
from fastsched.tools.tiny_model import make_tiny_model
from fastsched.units import parse_bytes

GiB = 2**30
MiB = 2**20

# The seed's worked example: the load.
WORKED_LOAD = dict(
    arrival_rate=20.0,
    prompt_len=2000,
    output_len=512,
    decode_step_time=0.02,
    prefill_throughput=20_000.0,
    ttft_slo=2.0,
)
# The seed's §8.2 model: 32 layers, 8 KV heads, head dim 128, fp16 KV.
SEED_MODEL = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")


def inputs(**overrides: object) -> PlanInputs:
    """The worked example on the seed's model with a roomy 200 GiB pool, unless overridden."""
    return PlanInputs(**{**WORKED_LOAD, **SEED_MODEL, "kv_memory": 200 * GiB, **overrides})  # type: ignore[arg-type]


# ----------------------------------------------------------------- Little's law


def test_worked_example_needs_about_207_requests_in_system() -> None:
    p = plan(inputs())
    assert p.decode_concurrency == pytest.approx(20 * 512 * 0.02)  # 204.8
    assert p.prefill_concurrency == pytest.approx(20 * 2000 / 20_000)  # 2.0
    assert p.concurrency_lower_bound == pytest.approx(206.8)
    assert p.service_time == pytest.approx(10.34)
    assert p.required_seqs == 207


def test_data_parallel_replicas_each_get_a_share_of_the_arrival_rate() -> None:
    p = plan(inputs(data_parallel_size=4))
    assert p.arrival_rate_per_replica == pytest.approx(5.0)
    assert p.concurrency_lower_bound == pytest.approx(206.8 / 4)
    assert p.required_seqs == 52


def test_an_integer_lower_bound_is_not_rounded_past_itself() -> None:
    # 10/s × 100 × 0.01 s + 10/s × 1000 / 10000 = 10 + 1 = 11 exactly, despite float error.
    p = plan(
        inputs(
            arrival_rate=10.0,
            output_len=100,
            decode_step_time=0.01,
            prompt_len=1000,
            prefill_throughput=10_000.0,
        )
    )
    assert p.required_seqs == 11


# ----------------------------------------------------------------- KV upper bound


def test_seed_model_holds_120_requests_of_4k_tokens_in_60_gib() -> None:
    p = plan(inputs(prompt_len=4000, output_len=96, kv_memory=60 * GiB))
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert p.kv_bytes_per_request == 512 * MiB
    assert p.kv_upper_bound == 120


def test_kv_upper_bound_of_a_small_config_by_hand() -> None:
    # 2 × 2 layers × 2 KV heads × 16 head dim × 4 B (float32) = 512 B per token, 8 KiB per block
    # of 16; 100 + 20 = 120 tokens round up to 8 blocks = 64 KiB; 1 MiB + 8191 B = 128 whole
    # blocks (the partial one does not count) → 128 // 8 = 16 requests.
    p = plan(
        inputs(
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            dtype="float32",
            prompt_len=100,
            output_len=20,
            kv_memory=MiB + 8191,
            block_size=16,
        )
    )
    assert p.kv_bytes_per_token == 512
    assert p.kv_bytes_per_block == 8192
    assert (p.tokens_per_request, p.blocks_per_request) == (120, 8)
    assert p.kv_bytes_per_request == 65536
    assert p.num_kv_blocks == 128
    assert p.kv_upper_bound == 16


def test_a_partial_last_block_is_charged_whole() -> None:
    exact = plan(inputs(prompt_len=4000, output_len=96, kv_memory=60 * GiB))  # 4096 tokens: 256 blocks
    one_more = plan(inputs(prompt_len=4000, output_len=97, kv_memory=60 * GiB))  # 4097: 257 blocks
    assert exact.blocks_per_request == 256
    assert one_more.blocks_per_request == 257
    assert one_more.kv_upper_bound == 60 * GiB // (2 * MiB) // 257


def test_mean_lengths_that_are_not_integers_round_up() -> None:
    p = plan(inputs(prompt_len=10.5, output_len=5.2, block_size=16))
    assert (p.tokens_per_request, p.blocks_per_request) == (16, 1)


# ----------------------------------------------------------------- verdicts and recommendations


def test_lower_bound_above_kv_bound_is_not_servable() -> None:
    # 2512 tokens → 157 blocks of 2 MiB; 60 GiB = 30720 blocks → 195 requests < 207.
    p = plan(inputs(kv_memory=60 * GiB))
    assert p.kv_upper_bound == 195
    assert not p.servable
    assert p.status == STATUS_NOT_SERVABLE
    assert "not servable" in p.verdict
    assert "no setting can serve this load" in p.verdict
    assert p.min_data_parallel_size == 2  # ceil(206.8 / 195)
    assert "--data-parallel-size 2" in p.verdict
    assert p.max_context_tokens == 30720 // 207 * 16  # 2368
    assert "2368 tokens" in p.verdict


def test_the_suggested_fixes_of_an_unservable_plan_make_it_servable() -> None:
    broken = plan(inputs(kv_memory=60 * GiB))
    assert plan(inputs(kv_memory=60 * GiB, data_parallel_size=broken.min_data_parallel_size)).servable
    assert not plan(inputs(kv_memory=60 * GiB, data_parallel_size=broken.min_data_parallel_size - 1)).servable
    shorter = broken.max_context_tokens
    assert plan(inputs(kv_memory=60 * GiB, prompt_len=shorter - 512)).servable


def test_unservable_plan_recommends_running_at_kv_capacity() -> None:
    p = plan(inputs(kv_memory=60 * GiB))
    assert p.max_num_seqs == p.max_num_active_seqs == p.kv_upper_bound


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"data_parallel_size": 2, "kv_memory": 60 * GiB},
        {"arrival_rate": 0.3, "output_len": 64},
        {"kv_memory": 78 * GiB},  # 254 fit: the slot rounding (256) is clipped, the headroom (249) is not
        {"arrival_rate": 200.0, "data_parallel_size": 16, "kv_memory": 40 * GiB},
    ],
)
def test_recommended_max_num_seqs_lies_between_the_bounds(overrides: dict[str, object]) -> None:
    p = plan(inputs(**overrides))
    assert p.servable
    assert p.max_num_seqs is not None and p.max_num_active_seqs is not None
    assert p.concurrency_lower_bound <= p.max_num_seqs <= p.kv_upper_bound
    assert p.concurrency_lower_bound <= p.max_num_active_seqs <= p.max_num_seqs


def test_max_num_seqs_adds_headroom_in_slots_of_8() -> None:
    p = plan(inputs())  # 1.2 × 206.8 = 248.16 → 249 → 256
    assert p.status == STATUS_OK
    assert p.max_num_seqs == 256
    assert p.max_num_active_seqs == 256


def test_kv_bound_may_clip_the_rounding_to_8_and_still_be_ok() -> None:
    p = plan(inputs(kv_memory=78 * GiB))  # 39 936 blocks // 157 = 254: below 256, above 249
    assert p.kv_upper_bound == 254
    assert p.status == STATUS_OK
    assert p.max_num_seqs == 254


def test_kv_bound_clips_the_headroom_but_not_the_lower_bound() -> None:
    p = plan(inputs(kv_memory=69 * GiB))  # 35 328 blocks // 157 = 225 requests: ≥ 207, < 249
    assert p.kv_upper_bound == 225
    assert p.status == STATUS_TIGHT
    assert p.servable
    assert p.max_num_seqs == p.max_num_active_seqs == 225
    assert "tight" in p.verdict


def test_queued_tokens_follow_ttft_times_prefill_throughput() -> None:
    assert plan(inputs()).max_num_queued_tokens == 2 * 20_000
    # D replicas prefill D times as fast; K frontends each count their own backlog (A3).
    assert plan(inputs(data_parallel_size=2, api_server_count=4)).max_num_queued_tokens == 2 * 2 * 20_000 // 4


def test_queued_reqs_are_running_slots_plus_arrivals_within_ttft() -> None:
    p = plan(inputs())
    assert p.queue_headroom == 40  # 20/s × 2 s
    assert p.max_num_queued_reqs == 1 * 256 + 40
    q = plan(inputs(data_parallel_size=2))  # 1.2 × 103.4 → 125 → 128 per replica
    assert q.max_num_queued_reqs == 2 * 128 + 40


def test_a_pool_that_cannot_hold_one_request_recommends_nothing() -> None:
    p = plan(inputs(kv_memory=100 * MiB))  # one 2512-token request needs 314 MiB
    assert p.kv_upper_bound == 0
    assert p.status == STATUS_NOT_SERVABLE
    assert p.max_num_seqs is None and p.max_num_active_seqs is None and p.max_num_queued_reqs is None
    assert p.min_data_parallel_size is None  # more replicas of the same pool do not help


def test_a_ttft_target_shorter_than_one_prefill_is_noted() -> None:
    p = plan(inputs(ttft_slo=0.05))
    assert any("even an idle replica misses it" in note for note in p.notes)


# ----------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("arrival_rate", -1.0, "--arrival-rate"),
        ("arrival_rate", 0.0, "--arrival-rate"),
        ("arrival_rate", math.nan, "--arrival-rate"),
        ("prompt_len", -5, "--prompt-len"),
        ("output_len", 0, "--output-len"),
        ("decode_step_time", -0.02, "--decode-step-time"),
        ("prefill_throughput", -20_000.0, "--prefill-throughput"),
        ("ttft_slo", 0.0, "--ttft-slo"),
        ("kv_memory", -1, "--kv-memory"),
        ("data_parallel_size", 0, "--data-parallel-size"),
        ("block_size", 0, "--block-size"),
        ("api_server_count", 0, "--api-server-count"),
        ("dtype", "int8", "--dtype"),
        ("headroom", 0.5, "--headroom"),
    ],
)
def test_bad_input_is_an_error_naming_the_flag(field: str, value: object, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        inputs(**{field: value})


def test_mean_context_longer_than_the_model_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"--prompt-len \+ --output-len .* context length \(2048\)"):
        inputs(max_model_len=2048)


# ----------------------------------------------------------------- JSON


def test_plan_json_round_trips_with_every_field() -> None:
    p = plan(inputs())
    data = json.loads(json.dumps(p.to_dict()))
    for name in (
        "concurrency_lower_bound",
        "kv_upper_bound",
        "max_num_seqs",
        "max_num_active_seqs",
        "max_num_queued_tokens",
        "max_num_queued_reqs",
        "verdict",
        "status",
        "servable",
    ):
        assert name in data
    assert {f.name for f in dataclasses.fields(p)} <= set(data)
    assert data["inputs"]["arrival_rate"] == 20.0
    assert data["inputs"]["dtype_bytes"] == 2


# ----------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2 layers, 2 KV heads, head dim 16, 4096 positions.
    return make_tiny_model(tmp_path_factory.mktemp("plan-tiny") / "model")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastsched")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    return parser.parse_args(["plan", *argv])


def worked_argv(model: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--arrival-rate",
        "20",
        "--prompt-len",
        "2000",
        "--output-len",
        "512",
        "--decode-step-time",
        "0.02",
        "--prefill-throughput",
        "20000",
        "--ttft-slo",
        "2",
        *extra,
    ]


def test_cli_prints_table_and_verdict_and_exits_0_when_servable(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(*worked_argv(tiny_model, "--kv-memory", "1GiB"))
    assert args.func is run_plan
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "206.80 → 207" in out
    # bfloat16 by default: 2 × 2 layers × 2 KV heads × 16 head dim × 2 B = 256 B per token.
    assert "2 × 2 layers × 2 KV heads × 16 head dim × 2 B" in out
    for flag in (
        "--max-num-seqs",
        "--max-num-active-seqs",
        "--max-num-queued-tokens",
        "--max-num-queued-reqs",
    ):
        assert flag in out
    assert "verdict: servable" in out


def test_cli_json_output_parses_and_reproduces_the_worked_example(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_plan(parse(*worked_argv(tiny_model, "--kv-memory", "1GiB", "--json"))) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["concurrency_lower_bound"] == pytest.approx(206.8)
    assert data["required_seqs"] == 207
    # 256 B/token × 16 = 4 KiB per block; 2512 tokens → 157 blocks; 1 GiB = 262144 blocks → 1669.
    assert data["kv_bytes_per_token"] == 256
    assert data["kv_upper_bound"] == 262144 // 157
    assert data["inputs"]["num_layers"] == 2
    assert data["inputs"]["max_model_len"] == 4096
    assert data["max_num_seqs"] == 256


def test_cli_exits_1_with_verdict_when_not_servable(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 157 blocks of 4 KiB per request; 100 MiB = 25600 blocks → 163 requests < 207.
    assert run_plan(parse(*worked_argv(tiny_model, "--kv-memory", "100MiB"))) == 1
    out = capsys.readouterr().out
    assert "verdict: not servable" in out
    assert "--data-parallel-size 2" in out


def test_cli_bad_rate_is_an_error_naming_the_flag(tiny_model: Path) -> None:
    argv = worked_argv(tiny_model, "--kv-memory", "1GiB")
    argv[argv.index("--arrival-rate") + 1] = "-5"
    with pytest.raises(ValueError, match="--arrival-rate"):
        run_plan(parse(*argv))


def test_cli_rejects_an_unreadable_kv_memory(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*worked_argv(tiny_model, "--kv-memory", "12 bananas"))
    assert "--kv-memory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("40GiB", 40 * GiB),
        ("40gib", 40 * GiB),
        ("40G", 40 * GiB),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("2 TiB", 2 * 2**40),
        ("64KB", 64_000),
        ("1e9", 10**9),
    ],
)
def test_kv_memory_accepts_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_every_plan_flag_has_help() -> None:
    parser = argparse.ArgumentParser(prog="fastsched")
    plan_parser = add_plan_parser(parser.add_subparsers())
    for action in plan_parser._actions:
        assert action.help, action.dest
