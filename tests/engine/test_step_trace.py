"""``--step-trace`` as specifications: one JSON line per step with rows, its shape as the
scheduler decided it, and a duration timed as the step call (offline) or from step
start to step start (the engine loop's cycle timing). No test asserts on how long a
step took, only on which interval was measured (with made-up clock values)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fastsched import Scheduler, SchedulerConfig
from fastsched.engine.step_trace import StepShape, StepTracer
from fastsched.entrypoints.llm import LLM
from fastsched.sampling_params import SamplingParams

DECODE = StepShape(batched_tokens=3, running_reqs=3, prefill_tokens=0, prefill_reqs=0)
PREFILL = StepShape(batched_tokens=40, running_reqs=1, prefill_tokens=40, prefill_reqs=1)
EMPTY = StepShape(batched_tokens=0, running_reqs=0, prefill_tokens=0, prefill_reqs=0)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_offline_a_step_lasts_its_call(tmp_path: Path) -> None:
    tracer = StepTracer(tmp_path / "steps.jsonl")
    tracer.on_step(PREFILL, 100.0, 100.25)
    tracer.on_step(DECODE, 101.0, 101.5)
    tracer.close()
    assert lines(tmp_path / "steps.jsonl") == [
        {
            "time": 100.0,
            "batched_tokens": 40,
            "running_reqs": 1,
            "prefill_tokens": 40,
            "prefill_reqs": 1,
            "duration_s": 0.25,
        },
        {
            "time": 101.0,
            "batched_tokens": 3,
            "running_reqs": 3,
            "prefill_tokens": 0,
            "prefill_reqs": 0,
            "duration_s": 0.5,
        },
    ]


def test_in_the_engine_loop_a_step_lasts_until_the_next_one_starts(tmp_path: Path) -> None:
    tracer = StepTracer(tmp_path / "steps.jsonl")
    tracer.use_cycle_timing()
    tracer.on_step(PREFILL, 100.0, 100.25)
    tracer.on_step(DECODE, 100.5, 100.625)  # sending and draining took the first step to 100.5
    tracer.close()  # the last step, never followed, is timed as its call
    assert [line["duration_s"] for line in lines(tmp_path / "steps.jsonl")] == [0.5, 0.125]


def test_in_the_engine_loop_idle_time_is_not_counted(tmp_path: Path) -> None:
    tracer = StepTracer(tmp_path / "steps.jsonl")
    tracer.use_cycle_timing()
    tracer.on_step(DECODE, 0.0, 0.001)  # made-up times far in the past: on_idle ends it "now"
    tracer.on_idle()
    tracer.on_step(DECODE, 5.0, 5.25)  # after the idle wait: starts a new step, ends nothing
    tracer.close()
    durations = [line["duration_s"] for line in lines(tmp_path / "steps.jsonl")]
    assert len(durations) == 2 and durations[1] == 0.25


def test_a_step_without_rows_ends_the_previous_one_and_is_not_recorded(tmp_path: Path) -> None:
    tracer = StepTracer(tmp_path / "steps.jsonl")
    tracer.use_cycle_timing()
    tracer.on_step(DECODE, 1.0, 1.125)
    tracer.on_step(EMPTY, 1.5, 1.5)
    tracer.close()
    assert [line["duration_s"] for line in lines(tmp_path / "steps.jsonl")] == [0.5]


def test_step_shape_tells_prefill_chunks_from_decodes() -> None:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_gpu_blocks=64
        )
    )
    sched.add_request("decoding", list(range(10, 14)), 8)
    out = sched.schedule()  # its 4-token prompt
    sched.update_from_tokens(np.array([7], dtype=np.int64))
    sched.add_request("long", list(range(20, 50)), 8)
    out = sched.schedule()  # a decode beside a 15-token chunk of the 30-token prompt
    lens = np.array([4 if sched.request_id(int(h)) == "decoding" else 30 for h in out.req_handles])
    assert StepShape.of(out, lens) == StepShape(
        batched_tokens=16, running_reqs=2, prefill_tokens=15, prefill_reqs=1
    )


def test_an_engine_with_step_trace_writes_one_line_per_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    llm = LLM(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        log_stats_interval=0,
        step_trace=str(path),
        num_gpu_blocks=64,
        max_model_len=128,
    )
    prompts = [[5] * 12, [6] * 20]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.engine.step_tracer is not None
    llm.engine.step_tracer.close()
    steps = lines(path)
    assert [
        (s["batched_tokens"], s["running_reqs"], s["prefill_tokens"], s["prefill_reqs"]) for s in steps
    ] == [
        (32, 2, 32, 2),
        (2, 2, 0, 0),
        (2, 2, 0, 0),
        (2, 2, 0, 0),
    ]
    assert all(s["duration_s"] >= 0 for s in steps)
