"""The scheduler's behaviour (docs/design.md §3–§5) checked through the Python binding.

Each test is one behaviour, named after it with the rule id it checks. The
fake model is a pure function of (request id, output index), so whatever the
scheduler does (chunking, preemption, pauses) a request must end with exactly
the tokens ``[fake_token(rid, i) for i in range(n)]``.
"""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_helpers import (
    ABORT,
    IGNORED,
    KIND_CACHED,
    KIND_NEW,
    KIND_RESUMED,
    LENGTH,
    STOP,
    add,
    drive,
    emitting,
    fake_token,
    make_scheduler,
    prompt,
    step,
)

from fastsched import SchedulerConfig

EOS = 2


def expected_outputs(request_id: str, n: int) -> list[int]:
    return [fake_token(request_id, i) for i in range(n)]


def u32(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


# --------------------------------------------------------------------------- S17 lifecycles


def test_s17_request_finishes_by_max_tokens_with_reason_length():
    sched = make_scheduler()
    add(sched, "r", num_prompt_tokens=10, max_tokens=5)
    run = drive(sched)
    assert run.outputs["r"] == expected_outputs("r", 5)
    assert run.finish_reasons == {"r": LENGTH}
    assert not sched.has_requests()


def test_s17_eos_finishes_request_with_reason_stop():
    sched = make_scheduler()
    add(sched, "r", max_tokens=10, eos_token_id=EOS)
    run = drive(sched, emitting({"r": (2, EOS)}))
    assert run.outputs["r"] == expected_outputs("r", 2) + [EOS]
    assert run.finish_reasons == {"r": STOP}


def test_s17_stop_token_id_finishes_request_with_reason_stop():
    sched = make_scheduler()
    add(sched, "r", max_tokens=10, stop_token_ids=[7, 8])
    run = drive(sched, emitting({"r": (3, 8)}))
    assert run.outputs["r"] == expected_outputs("r", 3) + [8]
    assert run.finish_reasons == {"r": STOP}


def test_s17_eos_on_last_allowed_token_reports_stop():
    sched = make_scheduler()
    add(sched, "r", max_tokens=3, eos_token_id=EOS)
    run = drive(sched, emitting({"r": (2, EOS)}))
    assert run.finish_reasons == {"r": STOP}


def test_s17_ignore_eos_and_min_tokens_defer_the_stop():
    sched = make_scheduler()
    add(sched, "ignores", max_tokens=4, eos_token_id=EOS, ignore_eos=True)
    add(sched, "min3", max_tokens=10, eos_token_id=EOS, min_tokens=3)
    run = drive(sched, emitting({"ignores": (1, EOS), "min3": (1, EOS)}))
    assert len(run.outputs["ignores"]) == 4 and run.finish_reasons["ignores"] == LENGTH
    # EOS at index 1 is before min_tokens; the model then never emits EOS again.
    assert len(run.outputs["min3"]) == 10 and run.finish_reasons["min3"] == LENGTH


def test_s17_max_model_len_caps_generation_with_reason_length():
    sched = make_scheduler(max_model_len=14)
    add(sched, "r", num_prompt_tokens=10, max_tokens=100)
    run = drive(sched)
    assert run.outputs["r"] == expected_outputs("r", 4)
    assert run.finish_reasons == {"r": LENGTH}
    assert all(s.num_computed.get("r", 0) + s.scheduled.get("r", 0) <= 13 for s in run.steps)


def test_s17_finished_request_is_freed_at_once_and_reported_in_next_schedule_finished():
    sched = make_scheduler()
    usable = sched.config.num_gpu_blocks - 1
    handle = add(sched, "r", num_prompt_tokens=8, max_tokens=2)
    first = step(sched)
    assert first.finish_reasons == {} and sched.num_free_blocks < usable
    last = step(sched)
    assert last.finish_reasons == {"r": LENGTH}
    assert last.finished == []
    assert sched.num_free_blocks == usable, "blocks are freed by the update that finishes the request"
    assert sched.has_requests(), "the finish is still to be reported"
    out = sched.schedule()
    assert [int(h) for h in out.finished] == [handle] and out.num_reqs == 0
    sched.update_from_tokens(np.zeros(0, dtype=np.int64))
    assert not sched.has_requests()


def test_s17_update_from_output_takes_sampled_tokens_as_csr_arrays():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    add(sched, "short", num_prompt_tokens=4, max_tokens=3)
    add(sched, "long", num_prompt_tokens=40, max_tokens=3)
    out = sched.schedule()
    assert sched.request_ids(out.req_handles) == ["short", "long"]
    assert list(out.num_scheduled_tokens) == [4, 12]
    # "short" finished its prompt and samples; "long" is a partial prefill: an empty row.
    res = sched.update_from_output(u32([0, 1, 1]), u32([42]))
    assert sched.request_ids(res.handles) == ["short"]
    assert list(res.token_offsets) == [0, 1] and list(res.token_ids) == [42]
    assert list(res.finish_reasons) == [0] and len(res) == 1


@pytest.mark.parametrize(
    "offsets, token_ids",
    [
        pytest.param([0, 1], [42], id="too-few-offsets"),
        pytest.param([0, 1, 1, 1], [42], id="too-many-offsets"),
        pytest.param([0, 1, 2], [42], id="last-offset-past-tokens"),
        pytest.param([0, 1, 1], [42, 43], id="tokens-past-last-offset"),
        pytest.param([1, 1, 1], [42], id="not-starting-at-0"),
        pytest.param([0, 2, 1], [42, 43], id="decreasing"),
    ],
)
def test_s17_update_from_output_with_mismatched_lengths_is_value_error(offsets, token_ids):
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    add(sched, "short", num_prompt_tokens=4)
    add(sched, "long", num_prompt_tokens=40)
    sched.schedule()
    with pytest.raises(ValueError, match="sampled_offsets"):
        sched.update_from_output(u32(offsets), u32(token_ids))


def test_s17_rejected_update_leaves_the_step_in_flight():
    sched = make_scheduler()
    add(sched, "r", max_tokens=2)
    sched.schedule()
    with pytest.raises(ValueError):
        sched.update_from_output(u32([0]), u32([]))
    res = sched.update_from_output(u32([0, 1]), u32([42]))
    assert list(res.token_ids) == [42]


def test_s17_update_without_a_step_in_flight_is_value_error():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="no scheduled step in flight"):
        sched.update_from_output(u32([0]), u32([]))


def test_s17_update_from_tokens_of_wrong_length_is_value_error():
    sched = make_scheduler()
    add(sched, "r")
    sched.schedule()
    with pytest.raises(ValueError, match="sampled_offsets"):
        sched.update_from_tokens(np.array([42, 43], dtype=np.int64))


def test_s17_update_arrays_of_wrong_dtype_are_rejected():
    sched = make_scheduler()
    add(sched, "r")
    sched.schedule()
    with pytest.raises(TypeError):
        sched.update_from_output(np.array([0, 1], dtype=np.int64), u32([42]))


def test_s17_num_cached_tokens_is_reported_once_the_prefill_completes():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    add(sched, "r", num_prompt_tokens=40, max_tokens=2)
    run = drive(sched)
    # No output until the prompt is done; then the first output carries the hit (0).
    assert [s.scheduled["r"] for s in run.steps[:3]] == [16, 16, 8]
    assert [s.new_tokens for s in run.steps[:2]] == [{}, {}]
    assert run.steps[2].cached_reported == {"r": 0}


# --------------------------------------------------------------------------- S1 / S9 budgets


def test_s1_chunked_prefill_splits_a_long_prompt_across_steps_within_the_budget():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    add(sched, "r", num_prompt_tokens=50, max_tokens=2)
    run = drive(sched)
    assert [s.scheduled["r"] for s in run.steps if "r" in s.scheduled] == [16, 16, 16, 2, 1]
    assert [s.num_computed["r"] for s in run.steps if "r" in s.scheduled] == [0, 16, 32, 48, 50]
    assert run.outputs["r"] == expected_outputs("r", 2)
    assert all(s.total <= 16 for s in run.steps)


def test_s1_running_decodes_and_a_new_prefill_share_one_token_budget():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    add(sched, "decoder", num_prompt_tokens=4, max_tokens=6)
    add(sched, "prefill", num_prompt_tokens=40, max_tokens=2, prompt_token_ids=prompt(40, 300))
    run = drive(sched)
    first, second = run.steps[0], run.steps[1]
    assert first.scheduled == {"decoder": 4, "prefill": 12}
    assert second.scheduled == {"decoder": 1, "prefill": 15}, "S2: the running decode goes first"
    assert all(s.total <= 16 for s in run.steps)
    assert run.outputs["decoder"] == expected_outputs("decoder", 6)


def test_s9_long_prefill_threshold_caps_each_request_when_more_than_one():
    sched = make_scheduler(long_prefill_token_threshold=8)
    add(sched, "a", num_prompt_tokens=30)
    add(sched, "b", num_prompt_tokens=30, prompt_token_ids=prompt(30, 300))
    first = step(sched)
    assert first.scheduled == {"a": 8, "b": 8}


def test_s9_lone_request_is_never_capped():
    sched = make_scheduler(long_prefill_token_threshold=8)
    add(sched, "a", num_prompt_tokens=30)
    assert step(sched).scheduled == {"a": 30}


def test_s9_adaptive_threshold_rises_to_the_fair_share():
    sched = make_scheduler(long_prefill_token_threshold=4, long_prefill_token_threshold_adaptive=True)
    add(sched, "a", num_prompt_tokens=40)
    add(sched, "b", num_prompt_tokens=40, prompt_token_ids=prompt(40, 300))
    # T = max(4, 64 // 2) = 32.
    assert step(sched).scheduled == {"a": 32, "b": 32}


def test_s9_without_chunked_prefill_a_prompt_that_does_not_fit_waits_whole():
    sched = make_scheduler(enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64)
    add(sched, "a", num_prompt_tokens=40, max_tokens=3)
    add(sched, "b", num_prompt_tokens=40, max_tokens=3, prompt_token_ids=prompt(40, 300))
    run = drive(sched)
    assert run.steps[0].scheduled == {"a": 40}
    assert run.steps[1].scheduled == {"a": 1, "b": 40}
    assert run.outputs["b"] == expected_outputs("b", 3)


# --------------------------------------------------------------------------- S3 / S4 / S5 preemption


def two_growing_requests(num_gpu_blocks: int, policy: str = "fcfs", **kwargs):
    """Two 8-token prompts generating 12 tokens each (5 blocks of 4 at the end):
    with 8 usable blocks both are admitted, and decode growth preempts one."""
    sched = make_scheduler(num_gpu_blocks=num_gpu_blocks, policy=policy, **kwargs)
    handles = {
        rid: add(sched, rid, 8, 12, prompt_token_ids=prompt(8, 100 + 50 * i), arrival_time=float(i))
        for i, rid in enumerate(["r0", "r1"])
    }
    return sched, handles


def test_s3_fcfs_preempts_the_last_running_request():
    sched = make_scheduler(num_gpu_blocks=10)
    for i in range(3):
        add(sched, f"r{i}", 8, 12, prompt_token_ids=prompt(8, 100 + 50 * i))
    run = drive(sched)
    first = run.first(lambda s: s.preempted)
    assert run.steps[first].preempted == ["r2"]
    assert "r2" not in run.steps[first].scheduled
    assert not sched.has_requests()


def test_s3_priority_preempts_the_least_urgent_request_not_the_last():
    sched = make_scheduler(num_gpu_blocks=9, policy="priority")
    lazy = add(sched, "lazy", 8, 12, prompt_token_ids=prompt(8, 100), priority=1, arrival_time=0.0)
    run = drive(sched, max_steps=1)
    urgent = add(sched, "urgent", 8, 12, prompt_token_ids=prompt(8, 150), priority=0, arrival_time=1.0)
    run = drive(sched, max_steps=1, run=run)
    assert sched.running_handles() == [lazy, urgent], "precondition: the least urgent is not the last"
    run = drive(sched, run=run)
    first = run.first(lambda s: s.preempted)
    assert run.steps[first].preempted == ["lazy"]
    assert "urgent" in run.steps[first].scheduled, "priority goes on with the next request"
    assert run.outputs["lazy"] == expected_outputs("lazy", 12)


def test_s4_preempted_request_is_reset_keeps_its_outputs_and_waits_at_the_head():
    sched, handles = two_growing_requests(num_gpu_blocks=9)
    run = drive(sched, max_steps=1)
    while not run.steps[-1].preempted:
        before = sched.request_info(handles["r1"])
        step(sched, run)
    assert run.steps[-1].preempted == ["r1"]
    info = sched.request_info(handles["r1"])
    assert info["status"] == "preempted"
    assert info["num_computed_tokens"] == 0 and info["blocks"] == []
    assert info["num_preemptions"] == 1
    assert info["num_output_tokens"] == before["num_output_tokens"] > 0
    assert sched.waiting_handles()[0] == handles["r1"]
    assert sched.stats()["num_preemptions_total"] == 1


def test_s4_preempted_request_resumes_with_a_prefix_hit_on_its_own_blocks():
    sched, _ = two_growing_requests(num_gpu_blocks=9)
    run = drive(sched)
    preempted_at = run.first(lambda s: "r1" in s.preempted)
    resumed_at = run.first(lambda s: s.kinds.get("r1") == KIND_RESUMED)
    assert resumed_at > preempted_at
    hit = run.steps[resumed_at].num_cached["r1"]
    assert hit > 0 and hit % sched.config.block_size == 0
    assert run.steps[resumed_at].num_computed["r1"] == hit
    assert "r1" not in [rid for s in run.steps[preempted_at:] for rid, k in s.kinds.items() if k == KIND_NEW]


def test_s4_preempted_request_resumes_with_identical_outputs():
    small, _ = two_growing_requests(num_gpu_blocks=9)
    ample, _ = two_growing_requests(num_gpu_blocks=257)
    small_run, ample_run = drive(small), drive(ample)
    assert small_run.preempted() and not ample_run.preempted()
    assert dict(small_run.outputs) == dict(ample_run.outputs)
    assert small_run.outputs["r1"] == expected_outputs("r1", 12)
    assert small_run.finish_reasons == ample_run.finish_reasons == {"r0": LENGTH, "r1": LENGTH}
    assert small.num_free_blocks == small.config.num_gpu_blocks - 1


def test_s5_a_step_that_preempted_admits_no_waiting_request():
    # Find the step at which "r1" is preempted, then replay with a tiny urgent
    # request arriving just before it: it would fit the victim's freed blocks
    # and heads the priority queue, but S5 holds it one step.
    dry, _ = two_growing_requests(num_gpu_blocks=9, policy="priority")
    preempting = drive(dry).first(lambda s: s.preempted)

    sched, _ = two_growing_requests(num_gpu_blocks=9, policy="priority")
    run = drive(sched, max_steps=preempting)
    add(sched, "tiny", 3, 1, prompt_token_ids=prompt(3, 500), priority=-1, arrival_time=9.0)
    held = step(sched, run)
    assert held.preempted == ["r1"]
    assert "tiny" not in held.scheduled
    assert sched.num_free_blocks >= 1, "precondition: the tiny request would have fit"
    nxt = step(sched, run)
    assert nxt.kinds.get("tiny") == KIND_NEW


def test_s10_a_waiting_request_that_does_not_fit_never_preempts():
    sched = make_scheduler(num_gpu_blocks=11, long_prefill_token_threshold=8)
    add(sched, "r0", num_prompt_tokens=24, max_tokens=4)
    run = drive(sched, max_steps=1)
    add(sched, "r1", num_prompt_tokens=24, max_tokens=4, prompt_token_ids=prompt(24, 300))
    nxt = step(sched, run)
    # The 8-token chunk (2 blocks) fits the 3 free blocks, the 6-block prompt does not.
    assert nxt.scheduled == {"r0": 1} and nxt.preempted == []


def test_s10_without_reserve_full_isl_the_first_chunk_is_enough():
    sched = make_scheduler(
        num_gpu_blocks=11, long_prefill_token_threshold=8, scheduler_reserve_full_isl=False
    )
    add(sched, "r0", num_prompt_tokens=24, max_tokens=4)
    run = drive(sched, max_steps=1)
    add(sched, "r1", num_prompt_tokens=24, max_tokens=4, prompt_token_ids=prompt(24, 300))
    assert step(sched, run).scheduled == {"r0": 1, "r1": 8}


# --------------------------------------------------------------------------- S6 slots


def test_s6_max_num_active_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=8, max_num_active_seqs=2)
    for i in range(5):
        add(sched, f"r{i}", num_prompt_tokens=4, max_tokens=3, prompt_token_ids=prompt(4, 100 + 10 * i))
    run = drive(sched, max_steps=1)
    assert list(run.steps[0].scheduled) == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    run = drive(sched, run=run)
    assert all(len(s.scheduled) <= 2 for s in run.steps)
    assert {rid: len(o) for rid, o in run.outputs.items()} == {f"r{i}": 3 for i in range(5)}


def test_s6_a_session_waiting_for_input_keeps_its_active_slot():
    sched = make_scheduler(max_num_active_seqs=1)
    add(sched, "session", max_tokens=2, streaming=True)
    run = drive(sched)
    assert sched.num_waiting_for_streaming_input == 1
    add(sched, "other", max_tokens=2, prompt_token_ids=prompt(8, 300))
    run = drive(sched, max_steps=3, run=run)
    assert all("other" not in s.scheduled for s in run.steps)
    sched.close_stream("session")
    run = drive(sched, run=run)
    assert run.outputs["other"] == expected_outputs("other", 2)


# --------------------------------------------------------------------------- S7 skip vs stop


def test_s7_a_request_whose_remote_kv_is_loading_is_skipped_and_a_later_one_admitted():
    sched = make_scheduler()
    sched.use_test_connector(8, 2)
    remote = add(sched, "remote", num_prompt_tokens=20, max_tokens=2)
    add(sched, "local", num_prompt_tokens=3, max_tokens=2, prompt_token_ids=prompt(3, 300))
    first = step(sched)
    assert first.scheduled == {"local": 3}
    assert sched.request_info(remote)["status"] == "waiting_for_remote_kvs"
    assert sched.waiting_handles() == [remote]


def test_s7_remote_kv_request_is_admitted_after_the_load_with_external_tokens_cached():
    sched = make_scheduler()
    sched.use_test_connector(num_external_tokens=8, ready_after_steps=2)
    add(sched, "remote", num_prompt_tokens=20, max_tokens=2)
    run = drive(sched)
    admitted = run.first(lambda s: "remote" in s.scheduled)
    assert admitted == 2
    assert run.steps[admitted].kinds["remote"] == KIND_NEW
    assert run.steps[admitted].num_cached["remote"] == 8
    assert run.steps[admitted].scheduled["remote"] == 12
    assert run.outputs["remote"] == expected_outputs("remote", 2)
    assert sched.num_free_blocks == sched.config.num_gpu_blocks - 1


def test_s7_skipped_requests_go_back_to_the_head_in_their_original_order():
    sched = make_scheduler()
    sched.use_test_connector(num_external_tokens=8, ready_after_steps=3)
    a = add(sched, "a", num_prompt_tokens=20, prompt_token_ids=prompt(20, 100))
    b = add(sched, "b", num_prompt_tokens=20, prompt_token_ids=prompt(20, 300))
    run = drive(sched, max_steps=2)
    assert sched.waiting_handles() == [a, b]
    run = drive(sched, run=run)
    admitted = run.first(lambda s: s.admitted())
    assert run.steps[admitted].admitted() == ["a", "b"]


# --------------------------------------------------------------------------- S8 prefix cache


def test_s8_a_request_sharing_a_prompt_prefix_hits_it_in_whole_blocks():
    sched = make_scheduler()
    shared = prompt(22, 100)  # 5 whole blocks of 4 and 2 tokens
    add(sched, "first", prompt_token_ids=shared + [900, 901, 902])
    run = drive(sched, max_steps=1)
    add(sched, "second", prompt_token_ids=shared + [800, 801, 802, 803, 804])
    nxt = step(sched, run)
    assert run.steps[0].num_cached == {"first": 0}
    assert nxt.num_cached == {"second": 20}
    assert nxt.scheduled["second"] == 27 - 20


def test_s8_the_hit_is_capped_at_num_tokens_minus_one():
    sched = make_scheduler()
    add(sched, "first", prompt_token_ids=prompt(16))
    run = drive(sched, max_steps=1)
    add(sched, "duplicate", prompt_token_ids=prompt(16))
    nxt = step(sched, run)
    # 16 tokens cached, but the last one must be computed for logits: 3 whole blocks.
    assert nxt.num_cached == {"duplicate": 12}
    assert nxt.scheduled["duplicate"] == 4


def test_s8_blocks_are_cached_at_schedule_time_so_a_later_admission_in_the_same_step_hits():
    sched = make_scheduler()
    add(sched, "a", prompt_token_ids=prompt(16))
    add(sched, "b", prompt_token_ids=prompt(16))
    assert step(sched).num_cached == {"a": 0, "b": 12}


def test_s8_prefix_cache_counters_in_stats():
    sched = make_scheduler()
    shared = prompt(22, 100)
    add(sched, "first", prompt_token_ids=shared + [900, 901, 902])
    run = drive(sched, max_steps=1)
    add(sched, "second", prompt_token_ids=shared + [800, 801, 802, 803, 804])
    drive(sched, run=run)
    stats = sched.stats()
    assert stats["prefix_cache_requests"] == 2
    assert stats["prefix_cache_queries"] == 25 + 27
    assert stats["prefix_cache_hits"] == 20
    assert stats["prefix_cache_preempted_queries"] == stats["prefix_cache_preempted_hits"] == 0


def test_s8_no_hits_with_prefix_caching_disabled():
    sched = make_scheduler(enable_prefix_caching=False)
    add(sched, "a", prompt_token_ids=prompt(16))
    add(sched, "b", prompt_token_ids=prompt(16))
    run = drive(sched)
    assert run.steps[0].num_cached == {"a": 0, "b": 0}
    assert sched.stats()["prefix_cache_hits"] == 0


def test_s8_s16_all_blocks_are_free_or_only_cached_once_everything_finished():
    sched = make_scheduler(num_gpu_blocks=20)
    for i in range(6):
        add(sched, f"r{i}", num_prompt_tokens=12, max_tokens=6, prompt_token_ids=prompt(12, 100 + 4 * i))
    drive(sched)
    assert not sched.has_requests()
    assert sched.num_free_blocks == 19
    assert sched.stats()["kv_cache_usage"] == 0.0


# --------------------------------------------------------------------------- S13 pause


def test_s13_paused_new_keeps_running_requests_going_and_admits_nobody_new():
    sched = make_scheduler()
    add(sched, "running", max_tokens=6)
    run = drive(sched, max_steps=1)
    sched.set_pause_state("paused_new")
    add(sched, "new", max_tokens=3, prompt_token_ids=prompt(8, 300))
    run = drive(sched, max_steps=3, run=run)
    assert [s.scheduled for s in run.steps[1:]] == [{"running": 1}] * 3
    assert sched.num_waiting == 1
    sched.set_pause_state("unpaused")
    run = drive(sched, run=run)
    assert run.outputs["running"] == expected_outputs("running", 6)
    assert run.outputs["new"] == expected_outputs("new", 3)


def test_s13_paused_new_still_schedules_a_kv_holding_session_with_new_input():
    sched = make_scheduler()
    add(sched, "session", max_tokens=2, streaming=True)
    run = drive(sched)
    sched.set_pause_state("paused_new")
    add(sched, "new", prompt_token_ids=prompt(8, 300))
    sched.add_stream_input("session", [60, 61, 62], 2)
    nxt = step(sched, run)
    assert list(nxt.scheduled) == ["session"]


def test_s13_paused_all_schedules_nothing_and_loses_nothing():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    handles = {
        "decoding": add(sched, "decoding", max_tokens=5),
        "prefilling": add(
            sched, "prefilling", num_prompt_tokens=40, max_tokens=3, prompt_token_ids=prompt(40, 300)
        ),
    }
    run = drive(sched, max_steps=2)
    before = {rid: sched.request_info(h) for rid, h in handles.items()}
    sched.set_pause_state("paused_all")
    assert not sched.has_requests(), "nothing may run: an engine does not step (vLLM 0.33)"
    for _ in range(3):
        step(sched, run)  # called anyway, it schedules nothing
    assert [(s.scheduled, s.total) for s in run.steps[2:]] == [({}, 0)] * 3
    assert {rid: sched.request_info(h) for rid, h in handles.items()} == before
    sched.set_pause_state("unpaused")
    run = drive(sched, run=run)
    assert run.outputs["decoding"] == expected_outputs("decoding", 5)
    assert run.outputs["prefilling"] == expected_outputs("prefilling", 3)
    assert not sched.has_requests()


def test_s13_unknown_pause_state_is_value_error():
    with pytest.raises(ValueError, match="pause state"):
        make_scheduler().set_pause_state("paused")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- S14 queues


def test_s14_priority_queue_orders_by_priority_then_arrival_then_request_id():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    add(sched, "low", priority=1, arrival_time=1.0)
    add(sched, "late", priority=0, arrival_time=3.0)
    add(sched, "z", priority=0, arrival_time=2.0)
    add(sched, "y", priority=0, arrival_time=2.0)
    run = drive(sched)
    order = [rid for s in run.steps for rid in s.admitted()]
    assert order == ["y", "z", "late", "low"]


def test_s14_fcfs_queue_admits_in_arrival_order():
    sched = make_scheduler(max_num_seqs=1)
    for rid in ["c", "a", "b"]:
        add(sched, rid, priority={"c": 5, "a": 0, "b": 1}[rid])
    run = drive(sched)
    assert [rid for s in run.steps for rid in s.admitted()] == ["c", "a", "b"]


# --------------------------------------------------------------------------- S15 streaming sessions


def test_s15_a_session_waits_for_input_after_its_segment_ends():
    sched = make_scheduler()
    handle = add(sched, "session", max_tokens=3, streaming=True)
    run = drive(sched)
    assert run.steps[-1].segment_ended == ["session"]
    assert run.finish_reasons == {}
    assert sched.num_waiting_for_streaming_input == 1
    assert sched.stats()["num_waiting_for_streaming_input"] == 1
    info = sched.request_info(handle)
    assert info["status"] == "waiting_for_streaming_req" and info["blocks"], "it keeps its KV"
    assert sched.num_running == 0 and sched.num_waiting == 0


def test_s15_stream_input_brings_the_session_back_with_its_kv():
    sched = make_scheduler()
    add(sched, "session", num_prompt_tokens=6, max_tokens=3, streaming=True)
    run = drive(sched)
    sched.add_stream_input("session", [60, 61, 62, 63, 64], 2)
    assert sched.num_waiting_for_streaming_input == 0 and sched.num_waiting == 1
    nxt = step(sched, run)
    # Only the last sampled token and the new input are computed: 6 + 3 - 1 were kept.
    assert nxt.num_computed["session"] == 8 and nxt.scheduled["session"] == 1 + 5
    run = drive(sched, run=run)
    assert run.outputs["session"] == expected_outputs("session", 5)
    assert sched.num_waiting_for_streaming_input == 1


def test_s15_close_stream_ends_a_waiting_session_at_once():
    sched = make_scheduler()
    handle = add(sched, "session", max_tokens=2, streaming=True)
    drive(sched)
    sched.close_stream("session")
    assert sched.num_waiting_for_streaming_input == 0
    assert sched.num_free_blocks == sched.config.num_gpu_blocks - 1
    assert sched.has_requests()
    out = sched.schedule()
    assert [int(h) for h in out.finished] == [handle]
    sched.update_from_tokens(np.zeros(0, dtype=np.int64))
    assert not sched.has_requests()


def test_s15_close_stream_during_a_segment_finishes_it_when_the_segment_ends():
    sched = make_scheduler()
    add(sched, "session", max_tokens=3, streaming=True)
    run = drive(sched, max_steps=1)
    sched.close_stream("session")
    run = drive(sched, run=run)
    assert run.finish_reasons == {"session": LENGTH}
    assert sched.num_waiting_for_streaming_input == 0 and not sched.has_requests()


def test_s15_input_arriving_during_a_segment_is_queued_for_the_next():
    sched = make_scheduler()
    add(sched, "session", max_tokens=2, streaming=True)
    run = drive(sched, max_steps=1)
    sched.add_stream_input("session", [60, 61], 2, is_last=True)
    run = drive(sched, run=run)
    assert run.steps[1].segment_ended == ["session"]
    assert run.outputs["session"] == expected_outputs("session", 4)
    assert run.finish_reasons == {"session": LENGTH}
    assert sched.num_waiting_for_streaming_input == 0 and not sched.has_requests()


def test_s15_stream_input_for_a_plain_request_or_unknown_id_is_rejected():
    sched = make_scheduler()
    add(sched, "plain")
    with pytest.raises(ValueError, match="not an open streaming session"):
        sched.add_stream_input("plain", [1], 1)
    with pytest.raises(KeyError):
        sched.add_stream_input("nobody", [1], 1)
    with pytest.raises(KeyError):
        sched.close_stream("nobody")


# --------------------------------------------------------------------------- S18 aborts


def test_s18_abort_reports_the_status_before_the_abort():
    sched = make_scheduler(num_gpu_blocks=10, max_num_active_seqs=3)
    for i in range(3):
        add(sched, f"r{i}", 8, 12, prompt_token_ids=prompt(8, 100 + 50 * i))
    add(sched, "queued", 8, 12, prompt_token_ids=prompt(8, 400))  # over the active cap
    run = drive(sched, max_steps=1)
    while not run.steps[-1].preempted:
        step(sched, run)
    assert run.steps[-1].preempted == ["r2"]
    assert sched.abort_request("r2") == "preempted"
    assert sched.abort_request("queued") == "waiting"
    assert sched.abort_request("r0") == "running"


def test_s18_abort_of_an_unknown_or_finished_id_is_a_no_op():
    sched = make_scheduler()
    add(sched, "done", max_tokens=1)
    drive(sched)
    assert sched.abort_request("done") is None
    assert sched.abort_request("never-added") is None
    add(sched, "twice")
    assert sched.abort_request("twice") == "waiting"
    assert sched.abort_request("twice") is None


def test_s18_abort_frees_a_running_request_blocks_at_once():
    sched = make_scheduler()
    usable = sched.config.num_gpu_blocks - 1
    add(sched, "keep", num_prompt_tokens=8)
    victim = add(sched, "abort-me", num_prompt_tokens=12, prompt_token_ids=prompt(12, 300))
    drive(sched, max_steps=1)
    held = len(sched.request_info(victim)["blocks"])
    free = sched.num_free_blocks
    assert sched.abort_request("abort-me") == "running"
    assert sched.num_free_blocks == free + held
    assert sched.num_running == 1
    drive(sched)
    assert sched.num_free_blocks == usable


def test_s18_has_requests_is_true_right_after_an_abort_and_false_after_the_next_schedule():
    sched = make_scheduler()
    add(sched, "only")
    drive(sched, max_steps=1)
    sched.abort_request("only")
    assert sched.has_requests(), "the abort must still reach the runner"
    after = step(sched)
    assert after.scheduled == {} and after.finished == ["only"]
    assert not sched.has_requests()


def test_s18_abort_while_a_step_is_in_flight_is_never_reported_as_finished_by_the_model():
    sched = make_scheduler()
    add(sched, "r", max_tokens=1)
    sched.schedule()
    assert sched.abort_request("r") == "running"
    res = sched.update_from_tokens(np.array([42], dtype=np.int64))
    assert len(res) == 0
    assert ABORT not in list(res.finish_reasons)
    assert sched.has_requests()
    assert sched.request_ids(sched.schedule().finished) == ["r"]


def test_s18_an_aborted_id_can_be_added_again():
    sched = make_scheduler()
    add(sched, "r")
    sched.abort_request("r")
    add(sched, "r", max_tokens=2)
    run = drive(sched)
    assert run.outputs["r"] == expected_outputs("r", 2)


# --------------------------------------------------------------------------- §3 config validation


def test_config_defaults_follow_design_section_3():
    cfg = SchedulerConfig()
    assert cfg.max_num_seqs == 256 and cfg.max_num_active_seqs == 256
    assert cfg.max_num_batched_tokens == 8192 and cfg.max_num_scheduled_tokens == 8192
    assert cfg.block_size == 16 and cfg.enable_prefix_caching and cfg.policy == "fcfs"
    assert make_scheduler().config.block_size == 4


def test_config_none_or_a_left_out_setting_takes_the_core_default():
    names = [
        "max_num_seqs", "max_num_active_seqs", "max_num_batched_tokens", "max_num_scheduled_tokens",
        "max_model_len", "long_prefill_token_threshold", "long_prefill_token_threshold_adaptive",
        "prefill_schedule_interval", "enable_chunked_prefill", "policy", "max_loras", "num_speculative_tokens",
        "num_lookahead_tokens", "block_size", "num_gpu_blocks", "enable_prefix_caching",
        "scheduler_reserve_full_isl", "watermark", "priority_preemption", "max_preemptions_per_request",
    ]  # fmt: skip
    default, explicit_none = SchedulerConfig(), SchedulerConfig(**dict.fromkeys(names))
    assert {n: getattr(default, n) for n in names} == {n: getattr(explicit_none, n) for n in names}
    assert repr(default) == repr(explicit_none)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_active_seqs=None, watermark=0.1, policy="priority")
    assert (cfg.max_num_seqs, cfg.max_num_active_seqs, cfg.watermark, cfg.policy) == (8, 8, 0.1, "priority")
    assert cfg.max_num_batched_tokens == default.max_num_batched_tokens


def test_config_active_seqs_above_slots_names_both_values():
    with pytest.raises(ValueError) as e:
        SchedulerConfig(max_num_active_seqs=300)
    assert str(e.value) == "max_num_active_seqs (300) cannot be greater than max_num_seqs (256)"


def test_config_budget_below_slots_names_both_values():
    with pytest.raises(ValueError) as e:
        SchedulerConfig(max_num_batched_tokens=128)
    assert str(e.value) == "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)"


def test_config_unknown_policy_is_named():
    with pytest.raises(ValueError, match='policy \\("lifo"\\)'):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, names",
    [
        pytest.param(
            dict(enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=8192),
            ["max_num_batched_tokens (4096)", "max_model_len (8192)"],
            id="no-chunking-budget-below-model-len",
        ),
        pytest.param(
            dict(max_num_scheduled_tokens=100, max_num_batched_tokens=512, max_num_seqs=8),
            ["max_num_scheduled_tokens (100)", "512"],
            id="compute-budget-below-input-budget",
        ),
        pytest.param(dict(num_gpu_blocks=1), ["num_gpu_blocks (1)"], id="pool-without-usable-block"),
        pytest.param(dict(watermark=1.5), ["watermark (1.5)"], id="watermark-out-of-range"),
        pytest.param(dict(max_num_seqs=0), ["max_num_seqs (0)"], id="no-slots"),
        pytest.param(dict(block_size=0), ["block_size (0)"], id="zero-block-size"),
        pytest.param(
            dict(prefill_schedule_interval=0), ["prefill_schedule_interval (0)"], id="zero-interval"
        ),
        pytest.param(
            dict(num_speculative_tokens=8192),
            ["num_speculative_tokens (8192)", "max_num_batched_tokens (8192)"],
            id="drafts-fill-the-budget",
        ),
    ],
)
def test_config_invalid_values_are_value_errors_naming_the_values(kwargs, names):
    with pytest.raises(ValueError) as e:
        SchedulerConfig(**kwargs)
    for name in names:
        assert name in str(e.value)


def test_config_negative_value_is_a_value_error_naming_the_field():
    """§3 / §8: a bad setting fails fast with a message naming it (like a
    negative ``max_tokens`` does on the request path)."""
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=-1)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        SchedulerConfig(8)  # type: ignore[call-arg]


# --------------------------------------------------------------------------- §4 invalid and ignored requests


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(prompt_token_ids=[]), "prompt_token_ids must not be empty", id="empty-prompt"),
        pytest.param(dict(prompt_token_ids=[5, -1]), "prompt_token_ids contains -1", id="negative-token"),
        pytest.param(
            dict(prompt_token_ids=[2**32]), "prompt_token_ids contains 4294967296", id="token-too-large"
        ),
        pytest.param(dict(max_tokens=0, streaming=True), "max_tokens \\(0\\)", id="max-tokens-0-streaming"),
        pytest.param(dict(max_tokens=-3), "max_tokens \\(-3\\)", id="negative-max-tokens"),
        pytest.param(
            dict(min_tokens=5, max_tokens=2), "min_tokens \\(5\\).*max_tokens \\(2\\)", id="min-above-max"
        ),
        pytest.param(dict(stop_token_ids=[-7]), "stop_token_ids contains -7", id="negative-stop-token"),
    ],
)
def test_lifecycle_invalid_request_is_value_error_naming_the_field(kwargs, message):
    sched = make_scheduler()
    with pytest.raises(ValueError, match=message):
        add(sched, "bad", **kwargs)
    assert not sched.has_requests()


def test_lifecycle_duplicate_live_request_id_is_value_error():
    sched = make_scheduler()
    add(sched, "r")
    with pytest.raises(ValueError, match='"r" is already in use'):
        add(sched, "r")
    assert sched.num_waiting == 1


def test_lifecycle_prompt_longer_than_max_model_len_is_finished_as_ignored():
    sched = make_scheduler(max_model_len=64)
    handle = add(sched, "long", num_prompt_tokens=70)
    assert sched.has_requests() and sched.num_waiting == 0
    out = sched.schedule()
    assert out.num_reqs == 0 and [int(h) for h in out.finished] == [handle]
    res = sched.update_from_tokens(np.zeros(0, dtype=np.int64))
    assert [int(h) for h in res.handles] == [handle]
    assert list(res.finish_reasons) == [IGNORED] and list(res.token_ids) == []
    reason = sched.ignore_reason(handle)
    assert reason is not None and "70" in reason and "64" in reason
    assert not sched.has_requests()


def test_lifecycle_prompt_larger_than_the_whole_kv_pool_is_finished_as_ignored():
    sched = make_scheduler(num_gpu_blocks=5)  # 4 usable blocks of 4 = 16 tokens
    add(sched, "fits", num_prompt_tokens=4, max_tokens=2)
    handle = add(sched, "huge", num_prompt_tokens=20, prompt_token_ids=prompt(20, 300))
    run = drive(sched, max_steps=1)
    assert run.steps[0].scheduled == {"fits": 4}
    assert run.steps[0].finish_reasons == {"huge": IGNORED}
    reason = sched.ignore_reason(handle)
    assert reason is not None and "20 tokens" in reason and "4" in reason
    drive(sched, run=run)
    assert not sched.has_requests()
    assert run.outputs["fits"] == expected_outputs("fits", 2)


def test_s16_a_request_whose_growth_exceeds_the_kv_pool_is_never_stuck():
    """§4 / S16: the prompt fits the pool (3 of 4 blocks) but prompt + outputs
    cannot; alone in the engine it must still end (length-capped or ignored),
    never preempt itself and wait forever."""
    sched = make_scheduler(num_gpu_blocks=5)  # 16 tokens of KV
    handle = add(sched, "grows", num_prompt_tokens=12, max_tokens=10)
    run = drive(sched, max_steps=50)
    assert not sched.has_requests(), f"still {sched.request_info(handle)} after 50 steps"
    assert run.finish_reasons.get("grows") in (LENGTH, IGNORED)
    assert run.outputs["grows"] == expected_outputs("grows", len(run.outputs["grows"]))
    assert sched.num_free_blocks == 4


def test_lifecycle_kinds_are_new_then_cached():
    sched = make_scheduler()
    add(sched, "r", max_tokens=3)
    run = drive(sched)
    assert [s.kinds["r"] for s in run.steps if "r" in s.kinds] == [KIND_NEW, KIND_CACHED, KIND_CACHED]


# --------------------------------------------------------------------------- gate telemetry

SCAN_STOPS = {
    "active_seqs",
    "token_budget",
    "kv_blocks",
    "draft_slots",
    "paused",
    "prefill_interval",
    "no_waiting",
    "preempted",
}
SKIP_REASONS = {"lora_slots", "remote_kv", "stale_output"}


def test_gates_stats_carry_every_gate_and_skip_reason_starting_at_zero():
    stats = make_scheduler().stats()
    assert stats["scan_stops_total"] == dict.fromkeys(SCAN_STOPS, 0)
    assert stats["skips_total"] == dict.fromkeys(SKIP_REASONS, 0)
    assert stats["last_scan_stop"] is None


def test_gates_active_seqs_stop_and_lora_skips_are_observed_through_the_binding():
    sched = make_scheduler(max_num_active_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", num_prompt_tokens=4, prompt_token_ids=prompt(4, 100 + 10 * i))
    step(sched)
    stats = sched.stats()
    assert stats["last_scan_stop"] == "active_seqs"
    assert stats["scan_stops_total"]["active_seqs"] == 1
    assert sum(stats["scan_stops_total"].values()) == stats["num_steps"] == 1

    sched = make_scheduler(max_loras=1)
    add(sched, "l1", lora_id=1)
    add(sched, "l2a", lora_id=2, prompt_token_ids=prompt(8, 200))
    add(sched, "l2b", lora_id=2, prompt_token_ids=prompt(8, 300))
    step(sched)
    assert sched.stats()["skips_total"]["lora_slots"] == 2


# ------------------------------------------------------ drafts, LoRA skips, pauses (vLLM 0.33)


def test_s2_drafts_go_out_as_spec_token_ids_and_the_verified_ones_come_back():
    sched = make_scheduler(num_speculative_tokens=3)
    h = add(sched, "a", num_prompt_tokens=5, max_tokens=20)
    step(sched)
    sched.update_draft_token_ids(u32([h]), u32([0, 3]), u32([40, 41, 42]))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == [4] and list(out.num_spec_tokens) == [3]
    assert out.spec_token_ids.dtype == np.int64 and list(out.spec_token_ids) == [40, 41, 42]
    # The model agrees with the first two drafts, then samples its own token.
    res = sched.update_from_output(u32([0, 3]), u32([40, 41, 60]))
    assert list(res.token_ids) == [40, 41, 60]
    info = sched.request_info(h)
    assert info["num_computed_tokens"] == info["num_tokens"] - 1 == 8, "the rejected draft is rolled back"


def test_s2_a_one_token_admission_beside_decodes_is_padded_with_minus_one_drafts():
    sched = make_scheduler(num_speculative_tokens=2)
    add(sched, "a", num_prompt_tokens=4, max_tokens=20)
    step(sched)
    add(sched, "b", num_prompt_tokens=1, max_tokens=20, prompt_token_ids=[300])
    out = sched.schedule()
    assert sched.request_ids(out.req_handles) == ["a", "b"]
    assert list(out.num_scheduled_tokens) == [1, 3] and list(out.spec_token_ids) == [-1, -1]


def test_s2_update_draft_token_ids_with_mismatched_offsets_is_value_error():
    sched = make_scheduler(num_speculative_tokens=2)
    h = add(sched, "a")
    step(sched)
    with pytest.raises(ValueError, match="draft_offsets"):
        sched.update_draft_token_ids(u32([h]), u32([0, 2, 4]), u32([1, 2, 3, 4]))


def test_s7_lora_skips_are_reported_in_the_step_output_with_their_reason():
    sched = make_scheduler(max_loras=1)
    add(sched, "l1", lora_id=1)
    add(sched, "l2", lora_id=2, prompt_token_ids=prompt(8, 200))
    add(sched, "base", prompt_token_ids=prompt(8, 300))
    out = sched.schedule()
    assert sched.request_ids(out.req_handles) == ["l1", "base"]
    assert sched.request_ids(out.skipped) == ["l2"]
    assert list(out.skip_reasons) == [0], "0 = lora_slots, as in stats()['skips_total']"


def test_s13_has_requests_counts_only_what_the_pause_state_lets_run():
    sched = make_scheduler()
    add(sched, "running")
    step(sched)
    add(sched, "waiting", prompt_token_ids=prompt(8, 300))
    sched.set_pause_state("paused_all")
    assert not sched.has_requests()
    sched.set_pause_state("paused_new")
    assert sched.has_requests(), "the running request may run"
    sched.abort_request("running")
    step(sched)  # reports the abort
    assert not sched.has_requests(), "the waiting request may not be admitted"
    sched.set_pause_state("unpaused")
    assert sched.has_requests()


def test_config_speculative_and_lora_settings_have_getters():
    cfg = SchedulerConfig(num_speculative_tokens=4, num_lookahead_tokens=4, max_loras=2)
    assert (cfg.num_speculative_tokens, cfg.num_lookahead_tokens, cfg.max_loras) == (4, 4, 2)
    assert SchedulerConfig().num_lookahead_tokens == 0


# --------------------------------------------------------------------------- what the engine asks the core


def test_s17_runs_after_in_flight_counts_the_tokens_in_flight():
    """Async scheduling asks the core whether a request will still run once the steps in flight
    land (docs/design.md §2: Python never re-implements a scheduling rule)."""
    sched = make_scheduler()
    sched.set_async_scheduling(True)
    add(sched, "a", num_prompt_tokens=8, max_tokens=2)
    assert sched.runs_after_in_flight()  # waiting
    sched.schedule()  # the prefill samples token 1
    assert sched.runs_after_in_flight()
    sched.schedule()  # token 2, the last one, in flight too
    assert not sched.runs_after_in_flight()


def test_s13_runs_after_in_flight_follows_the_pause_state():
    sched = make_scheduler()
    add(sched, "a")
    sched.set_pause_state("paused_new")
    assert sched.pause_state == "paused_new" and not sched.runs_after_in_flight()
    sched.set_pause_state("unpaused")
    assert sched.pause_state == "unpaused" and sched.runs_after_in_flight()


def test_prompt_lengths_and_arrival_times_are_read_from_the_core_by_handle():
    sched = make_scheduler()
    a = add(sched, "a", num_prompt_tokens=5, arrival_time=10.5)
    b = add(sched, "b", num_prompt_tokens=9, arrival_time=11.0)
    handles = u32([b, a])
    assert sched.num_prompt_tokens(handles).tolist() == [9, 5]
    assert sched.arrival_times(handles).tolist() == [11.0, 10.5]
    with pytest.raises(KeyError):
        sched.arrival_times(u32([99]))


# --------------------------------------------------------------------------- S19, S20


def test_s19_skip_reading_prefix_cache_takes_no_hit_and_leaves_its_blocks_to_others():
    sched = make_scheduler()
    tokens = prompt(40)
    add(sched, "a", prompt_token_ids=tokens, max_tokens=1)
    drive(sched)
    add(sched, "b", prompt_token_ids=tokens, max_tokens=1, skip_reading_prefix_cache=True)
    out = sched.schedule()
    assert out.num_cached_tokens.tolist() == [0] and out.num_scheduled_tokens.tolist() == [40]


def test_s20_prefill_only_finishes_length_capped_with_no_token():
    sched = make_scheduler()
    h = add(sched, "p", prompt_token_ids=prompt(20), max_tokens=0)
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [20]
    eco = sched.update_from_tokens(np.full(1, -1, dtype=np.int64))
    assert eco.handles.tolist() == [h] and eco.finish_reasons.tolist() == [LENGTH]
    assert eco.token_offsets.tolist() == [0, 0]
    assert sched.schedule().finished.tolist() == [h]
