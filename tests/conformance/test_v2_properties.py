"""Property checks of the format-2 replay on generated traces (``tracegen.py``):
other seeds of the same kinds as the vendored ones, without vLLM references.
Every line must keep what ``vllm/v2/README.md`` promises of vLLM's decisions
(draft counts, padding, LoRA slots, pause states, budgets), and a replay must be
deterministic. The ``interval_preempt`` traces also check the S3 scan position
that vLLM 0.33's code gives a priority victim ahead of the scan.
"""

from __future__ import annotations

import json
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
def test_generated_v2_traces_keep_the_readme_promises_and_replay_deterministically(kind: str, seed: int, tmp_path: Path):
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


def replay_with_running_state(trace: dict, path: Path) -> tuple[list[str], dict[int, list[tuple[str, bool]]]]:
    """The replay's lines, and for every step that called ``schedule()`` the
    ``running`` list it started from: (id, is_prefill_chunk) in order."""
    path.write_text(json.dumps(trace))
    running: dict[int, list[tuple[str, bool]]] = {}

    def probe(step: int, sched) -> None:
        running[step] = [(sched.request_id(h), sched.request_info(h)["is_prefill_chunk"]) for h in sched.running_handles()]

    return replay(path, probe), running


def test_interval_preempt_traces_pass_over_no_running_decode_while_budget_is_left(tmp_path: Path):
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
        lines, running = replay_with_running_state(trace, tmp_path / f"ip-{seed}.trace.json")
        check_lines(trace, lines)
        budget = trace["config"]["max_num_batched_tokens"]
        for raw in lines[1:]:
            line = json.loads(raw)
            if line["idle"]:
                continue
            start = running[line["step"]]
            chunks = {rid for rid, chunk in start if chunk}
            preempted = set(line["preempted"])
            if line["total_tokens"] < budget:
                missed = [rid for rid, _ in start if rid not in line["scheduled"] and rid not in preempted | chunks]
                assert not missed, f"seed {seed} step {line['step']}: {missed} passed over; running was {start}"
            passed_over_chunk_victims += len((preempted & chunks) - set(line["scheduled"]))
    assert passed_over_chunk_victims >= 20, passed_over_chunk_victims
