"""Property checks of the format-2 replay on generated traces (``tracegen.py``):
other seeds of the same kinds as the vendored ones, without vLLM references.
Every line must keep what ``vllm/v2/README.md`` promises of vLLM's decisions
(draft counts, padding, LoRA slots, pause states, budgets), and a replay must be
deterministic. The ``interval_preempt`` traces also check two rules read from vLLM
0.33's code: the S3 scan position after a priority victim ahead of the scan, and
the S12 interval restarted by a prefill chunk whose row was taken back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from replay import replay
from tracegen import INTERVAL_PREEMPT, KINDS, generate

SEEDS = range(1, 4)


def check_lines(trace: dict, lines: list[str]) -> None:
    cfg = trace["config"]
    k, max_loras = cfg["num_speculative_tokens"], cfg["max_loras"]
    lora = {r["request_id"]: r["lora_id"] for e in trace["events"] for r in e["add"]}
    running: set[str] = set()
    header = json.loads(lines[0])["header"]
    assert header["format"] == "vllm-diff-decisions/2" and header["drop_pause"] is False
    for raw in lines[1:]:
        line = json.loads(raw)
        step, sched = line["step"], line["scheduled"]
        spec, accepted, padded = line["spec_tokens"], line["accepted"], line["spec_padded"]
        admitted = set(line["new"]) | set(line["resumed"])
        assert set(spec) == set(accepted) and set(spec) <= set(sched), step
        for rid, s in spec.items():
            assert s >= 1 and sched[rid] == s + 1 and 0 <= accepted[rid] <= s, (step, rid)
            if rid in admitted:  # admissions carry drafts only as padding
                assert rid in padded and s == k and accepted[rid] == 0, (step, rid)
        assert set(padded) <= admitted, step
        if k == 0:
            assert not spec, step
        assert line["total_tokens"] == sum(sched.values()) <= cfg["max_num_batched_tokens"], step
        assert len(sched) <= cfg["max_num_seqs"] and line["running"] <= cfg["max_num_seqs"], step
        if line["pause"] == "all":
            assert not sched, f"step {step}: PAUSED_ALL scheduled {sched}"
        if line["pause"] == "new":
            assert not admitted, f"step {step}: PAUSED_NEW admitted {sorted(admitted)}"
        if line["idle"]:
            assert not sched and not spec and not line["lora_skipped"], step
        assert all(lora[rid] is not None and rid not in sched for rid in line["lora_skipped"]), step
        if max_loras == 0:
            assert not line["lora_skipped"], step
        running = (running | admitted) - set(line["preempted"]) - set(line["finished"]) - set(line["aborted"])
        assert len(running) == line["running"], step
        adapters = {lora[rid] for rid in running if lora[rid] is not None}
        assert len(adapters) <= max(max_loras, 0) or max_loras == 0, f"step {step}: adapters {adapters}"
        assert 0 <= line["kv_free_blocks"] <= cfg["num_blocks"] - 1, step


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_v2_traces_keep_the_readme_promises_and_replay_deterministically(
    kind: str, seed: int, tmp_path: Path
):
    trace = generate(kind, seed)
    path = tmp_path / f"{kind}-s{seed}.trace.json"
    path.write_text(json.dumps(trace))
    lines = replay(path)
    assert len(lines) == trace["num_steps"] + 1
    check_lines(trace, lines)
    assert replay(path) == lines


def test_generated_traces_exercise_drafts_padding_lora_skips_and_pauses(tmp_path: Path):
    seen = {"accepted": 0, "padded": 0, "lora_skipped": 0, "paused_all": 0, "paused_new": 0, "preempted": 0}
    for kind in KINDS:
        for seed in SEEDS:
            path = tmp_path / f"{kind}-{seed}.json"
            path.write_text(json.dumps(generate(kind, seed)))
            for raw in replay(path)[1:]:
                line = json.loads(raw)
                seen["accepted"] += sum(line["accepted"].values())
                seen["padded"] += len(line["spec_padded"])
                seen["lora_skipped"] += len(line["lora_skipped"])
                seen["paused_all"] += line["pause"] == "all"
                seen["paused_new"] += line["pause"] == "new"
                seen["preempted"] += len(line["preempted"])
    assert all(seen.values()), seen


INTERVAL_PREEMPT_SEEDS = range(40)


@dataclass
class StepStart:
    """What a step that calls ``schedule()`` starts from."""

    running: list[str]  # in order
    info: dict[str, dict]  # ``request_info`` of every running and waiting request
    free_blocks: int
    num_waiting: int

    def is_chunk(self, rid: str) -> bool:
        return self.info[rid]["is_prefill_chunk"]


def replay_with_starts(trace: dict, path: Path) -> tuple[list[str], dict[int, StepStart]]:
    """The replay's lines, and the state each non-idle step started from."""
    path.write_text(json.dumps(trace))
    starts: dict[int, StepStart] = {}

    def probe(step: int, sched) -> None:
        handles = [*sched.running_handles(), *sched.waiting_handles()]
        starts[step] = StepStart(
            running=[sched.request_id(h) for h in sched.running_handles()],
            info={sched.request_id(h): sched.request_info(h) for h in handles},
            free_blocks=sched.num_free_blocks,
            num_waiting=sched.num_waiting,
        )

    return replay(path, probe), starts


def test_s3_interval_preempt_traces_pass_over_no_running_decode_while_budget_is_left(tmp_path: Path):
    """S3 (vLLM 0.33: ``if victim_index < req_index: req_index -= 1``): a priority
    victim ahead of the scan, a prefill chunk that a held step (S12) passed over
    included, moves the scan back, so the request behind the one that preempted
    it is still visited. While the token budget is not used up, every running
    request of the step's start is then scheduled, preempted, or a prefill chunk
    (which S12 may hold). The generated ``interval_preempt`` traces put such
    victims ahead of growing decodes."""
    passed_over_chunk_victims = 0
    for seed in INTERVAL_PREEMPT_SEEDS:
        trace = generate(INTERVAL_PREEMPT, seed)
        lines, starts = replay_with_starts(trace, tmp_path / f"ip-{seed}.trace.json")
        check_lines(trace, lines)
        budget = trace["config"]["max_num_batched_tokens"]
        for raw in lines[1:]:
            line = json.loads(raw)
            if line["idle"]:
                continue
            start = starts[line["step"]]
            chunks = {rid for rid in start.running if start.is_chunk(rid)}
            preempted = set(line["preempted"])
            if line["total_tokens"] < budget:
                missed = [
                    r for r in start.running if r not in line["scheduled"] and r not in preempted | chunks
                ]
                assert not missed, (
                    f"seed {seed} step {line['step']}: {missed} passed over; running was {start.running}"
                )
            passed_over_chunk_victims += len((preempted & chunks) - set(line["scheduled"]))
    assert passed_over_chunk_victims >= 20, passed_over_chunk_victims


def check_prefill_interval(
    trace: dict, lines: list[str], starts: dict[int, StepStart]
) -> tuple[int, int, bool]:
    """Replays S12's state machine (Difference 10) beside the decisions and checks
    that no step it holds schedules a running prefill chunk or admits prefill
    work. Prefill work restarts the interval when a running chunk is scheduled,
    including one whose row a preemption took back (vLLM 0.33 never clears
    ``prefill_scheduled``), or when an admission has more than its last token to
    compute. A take-back is not in the decisions; it is inferred where certain:
    on a step that is not held, a preempted prefill chunk that was first in
    ``running`` and whose chunk fitted the free blocks was scheduled, then taken
    back. Any other preempted chunk on such a step is undecidable here, and the
    check stops. Returns (held steps checked, take-backs, whole trace checked)."""
    cfg = trace["config"]
    bs, budget, cap_t = cfg["block_size"], cfg["max_num_batched_tokens"], cfg["long_prefill_token_threshold"]
    k = cfg["prefill_schedule_interval"]
    executed, last_prefill, capacity_bound = 0, -k, False
    held = takebacks = 0
    for raw in lines[1:]:
        line = json.loads(raw)
        if line["idle"]:
            continue
        start = starts[line["step"]]
        chunks = [r for r in start.running if start.is_chunk(r)]
        defer = (
            not capacity_bound
            and (executed + 1) - last_prefill < k
            and any(not start.is_chunk(r) for r in start.running)
        )
        admitted = line["new"] + line["resumed"]
        prefill_admitted = [
            r for r in admitted if line["num_cached_tokens"][r] + 1 < start.info[r]["num_tokens"]
        ]
        prefill_scheduled = any(r in line["scheduled"] for r in chunks)
        if defer:
            held += 1
            bad = [r for r in chunks if r in line["scheduled"]] + prefill_admitted
            assert not bad, f"step {line['step']} is held (S12) but schedules prefill of {bad}"
        else:
            for v in set(line["preempted"]) & set(chunks) - set(line["scheduled"]):
                if v != start.running[0]:
                    return held, takebacks, False
                info = start.info[v]
                cap = cap_t if cap_t and len(start.running) + start.num_waiting > 1 else budget
                n = min(info["num_tokens"] - info["num_computed_tokens"], cap, budget)
                if -(-(info["num_computed_tokens"] + n) // bs) - len(info["blocks"]) <= start.free_blocks:
                    prefill_scheduled = True
                    takebacks += 1
        if line["total_tokens"] > 0:
            executed += 1
        if prefill_scheduled or prefill_admitted:
            last_prefill = executed
        if not line["preempted"] and not defer:
            capacity_bound = line["waiting"] > 0
    return held, takebacks, True


def test_s12_interval_preempt_traces_restart_the_interval_at_a_chunk_taken_back(tmp_path: Path):
    """S12 / Difference 10 (vLLM 0.33): a step whose running phase scheduled a
    prefill chunk restarts the interval even if a preemption later in the step
    took that chunk's row back, so the next two steps hold prefill."""
    held = takebacks = whole = 0
    for seed in INTERVAL_PREEMPT_SEEDS:
        trace = generate(INTERVAL_PREEMPT, seed)
        lines, starts = replay_with_starts(trace, tmp_path / f"ip-{seed}.trace.json")
        h, t, complete = check_prefill_interval(trace, lines, starts)
        held, takebacks, whole = held + h, takebacks + t, whole + complete
    assert whole >= 20 and held >= 200 and takebacks >= 3, (whole, held, takebacks)
