//! Unit tests of the scheduling step, one or more per docs/design.md rule id.

use super::*;
use crate::config::Policy;
use crate::connector::TestConnector;
use crate::output::{EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput};
use crate::request::StreamInput;
use crate::telemetry::{GateCounters, ScanStop, SkipReason};

/// 4-token blocks, a 64-token budget and `usable` blocks (plus the null block).
fn sched_with(usable: usize, f: impl FnOnce(&mut SchedulerConfig)) -> Scheduler {
    let mut cfg = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        block_size: 4,
        num_gpu_blocks: usable + 1,
        ..Default::default()
    };
    f(&mut cfg);
    Scheduler::new(cfg).expect("valid test config")
}

fn sched(usable: usize) -> Scheduler {
    sched_with(usable, |_| {})
}

/// Distinct prompts per id, so no accidental prefix sharing.
fn prompt(id: &str, len: usize) -> Vec<u32> {
    let seed = id
        .bytes()
        .fold(17u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..len as u32)
        .map(|i| 3 + (seed.wrapping_mul(7919).wrapping_add(i * 104_729)) % 997)
        .collect()
}

fn add(s: &mut Scheduler, id: &str, len: usize, max_tokens: usize) -> Handle {
    s.add_request(NewRequest::new(id, prompt(id, len), max_tokens))
        .unwrap()
}

fn add_with(
    s: &mut Scheduler,
    id: &str,
    len: usize,
    max_tokens: usize,
    f: impl FnOnce(&mut NewRequest),
) -> Handle {
    let mut n = NewRequest::new(id, prompt(id, len), max_tokens);
    f(&mut n);
    s.add_request(n).unwrap()
}

/// The fake model: token 7 for every request whose prefill completed.
fn outputs_for(s: &Scheduler, out: &SchedulerOutput) -> ModelRunnerOutput {
    let tokens: Vec<Option<u32>> = out
        .req_handles
        .iter()
        .map(|&h| (!s.requests[h as usize].progress.is_prefill_chunk).then_some(7))
        .collect();
    ModelRunnerOutput::from_tokens(&tokens)
}

fn step(s: &mut Scheduler) -> (SchedulerOutput, EngineCoreOutputs) {
    let out = s.schedule();
    let mro = outputs_for(s, &out);
    let res = s.update_from_output(&mro).unwrap();
    s.check_invariants().unwrap();
    (out, res)
}

fn id(s: &Scheduler, h: Handle) -> String {
    s.request(h).unwrap().request_id.clone()
}

fn scheduled(s: &Scheduler, out: &SchedulerOutput) -> Vec<(String, u32)> {
    out.req_handles
        .iter()
        .zip(&out.num_scheduled_tokens)
        .map(|(&h, &n)| (id(s, h), n))
        .collect()
}

fn names(s: &Scheduler, hs: &[Handle]) -> Vec<String> {
    hs.iter().map(|&h| id(s, h)).collect()
}

fn sv(xs: &[(&str, u32)]) -> Vec<(String, u32)> {
    xs.iter().map(|(a, n)| (a.to_string(), *n)).collect()
}

// ------------------------------------------------------------------ S1, S2

#[test]
fn s1_token_budget_caps_the_sum_of_scheduled_tokens() {
    let mut s = sched(64);
    add(&mut s, "a", 40, 4);
    add(&mut s, "b", 40, 4);
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("a", 40), ("b", 24)]));
    assert_eq!(out.total_num_scheduled_tokens, 64);
}

#[test]
fn s1_drafts_use_compute_budget_but_not_input_budget() {
    let mut s = sched_with(64, |c| {
        c.max_num_seqs = 4;
        c.max_num_batched_tokens = 12;
        c.max_num_scheduled_tokens = Some(16);
        c.num_speculative_tokens = 3;
    });
    for r in ["a", "b", "c", "d"] {
        add(&mut s, r, 2, 20);
    }
    let out = s.schedule(); // 4 x 2 prompt tokens, 3 input slots kept for drafts
    assert_eq!(out.total_num_scheduled_tokens, 8);
    let mut mro = outputs_for(&s, &out);
    mro.draft_offsets = vec![0, 3, 6, 9, 12];
    mro.draft_token_ids = vec![9; 12];
    s.update_from_output(&mro).unwrap();
    let out = s.schedule();
    // 4 real tokens + 12 drafts: more than the 12-token input budget, within
    // the 16-token compute budget.
    assert_eq!(out.num_scheduled_tokens, vec![4, 4, 4, 4]);
    assert_eq!(out.num_spec_tokens, vec![3, 3, 3, 3]);
}

#[test]
fn s1_paused_all_sets_the_budget_to_zero() {
    let mut s = sched(64);
    add(&mut s, "a", 10, 4);
    step(&mut s);
    s.set_pause_state(PauseState::PausedAll);
    let (out, _) = step(&mut s);
    assert!(out.is_empty());
    assert_eq!(s.num_running(), 1);
}

#[test]
fn s2_running_request_gets_the_rest_of_its_prompt_then_one_token_per_step() {
    let mut s = sched(64);
    add(&mut s, "a", 100, 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![64]);
    let (out, res) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![36]);
    assert_eq!(out.num_computed_tokens, vec![64]);
    assert_eq!(res.token_ids, vec![7]);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![1]);
}

#[test]
fn s2_position_never_passes_max_model_len() {
    let mut s = sched_with(64, |c| c.max_model_len = 12);
    add(&mut s, "a", 8, 100);
    let mut total_outputs = 0;
    for _ in 0..10 {
        let (out, res) = step(&mut s);
        for (&n, &c) in out
            .num_scheduled_tokens
            .iter()
            .zip(&out.num_computed_tokens)
        {
            assert!(
                (n + c) as usize <= 11,
                "computes position {} >= max_model_len - 1",
                n + c
            );
        }
        total_outputs += res.token_ids.len();
        if res.finish_reasons.contains(&(FinishReason::Length as u8)) {
            break;
        }
    }
    assert_eq!(
        total_outputs, 4,
        "stops at max_model_len: 8 prompt + 4 outputs"
    );
}

// ------------------------------------------------------------------ S3, S4, S5

/// Three 7-token requests in six blocks: all fit, then grow into a shortage.
fn three_in_six_blocks(policy: Policy) -> Scheduler {
    let mut s = sched_with(6, |c| c.policy = policy);
    for r in ["r0", "r1", "r2"] {
        add(&mut s, r, 7, 20);
    }
    step(&mut s); // prefill: 2 blocks each
    step(&mut s); // decode to 9 tokens, still 2 blocks of computed
    s
}

#[test]
fn s3_fcfs_victim_is_the_last_running_request() {
    let mut s = three_in_six_blocks(Policy::Fcfs);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["r2"]);
    assert_eq!(scheduled(&s, &out), sv(&[("r0", 1), ("r1", 1)]));
}

#[test]
fn s4_preempted_request_restarts_at_the_head_of_waiting_keeping_its_outputs() {
    let mut s = three_in_six_blocks(Policy::Fcfs);
    add(&mut s, "late", 3, 4);
    let (out, _) = step(&mut s);
    let victim = out.preempted[0];
    let r = s.request(victim).unwrap();
    assert_eq!(r.status, RequestStatus::Preempted);
    assert_eq!(s.progress(victim).unwrap().num_computed_tokens, 0);
    assert_eq!(r.num_output_tokens, 2, "outputs survive preemption");
    assert_eq!(r.num_preemptions, 1);
    assert!(s.blocks_of(victim).is_empty());
    assert_eq!(s.waiting_order()[0], victim, "head of the waiting queue");
    assert_eq!(s.stats().num_preemptions_total, 1);
}

#[test]
fn s5_a_step_that_preempts_admits_nobody() {
    let mut s = three_in_six_blocks(Policy::Fcfs);
    add(&mut s, "tiny", 1, 1);
    let (out, _) = step(&mut s);
    assert!(!out.preempted.is_empty());
    assert!(out.kinds.iter().all(|&k| k == ScheduledKind::Cached as u8));
    assert!(s.waiting_order().iter().any(|&h| id(&s, h) == "tiny"));
}

/// running = [a, b, c] where b (latest arrival) is the one that needs a block.
fn b_needs_a_block(policy: Policy) -> Scheduler {
    let mut s = sched_with(6, |c| c.policy = policy);
    add_with(&mut s, "a", 5, 20, |r| r.arrival_time = 1.0);
    add_with(&mut s, "b", 7, 20, |r| r.arrival_time = 3.0);
    step(&mut s);
    add_with(&mut s, "c", 5, 20, |r| r.arrival_time = 2.0);
    step(&mut s);
    assert_eq!(names(&s, s.running()), vec!["a", "b", "c"]);
    assert_eq!(s.num_free_blocks(), 0);
    s
}

#[test]
fn s3_priority_victim_is_lowest_priority_latest_arrival_and_self_preemption_continues() {
    let mut s = b_needs_a_block(Policy::Priority);
    let (out, _) = step(&mut s);
    assert_eq!(
        names(&s, &out.preempted),
        vec!["b"],
        "b is max (priority, arrival)"
    );
    assert_eq!(
        scheduled(&s, &out),
        sv(&[("a", 1), ("c", 1)]),
        "c still runs"
    );
}

#[test]
fn s3_fcfs_takes_the_last_request_in_the_same_situation() {
    let mut s = b_needs_a_block(Policy::Fcfs);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["c"]);
    assert_eq!(scheduled(&s, &out), sv(&[("a", 1), ("b", 1)]));
}

#[test]
fn s3_fcfs_self_preemption_stops_the_running_phase() {
    // big is the last running request: the FCFS victim is big itself.
    let mut s = sched(4);
    add(&mut s, "small", 3, 2);
    add(&mut s, "big", 12, 20);
    add(&mut s, "queued", 1, 1);
    step(&mut s);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["big"]);
    assert_eq!(scheduled(&s, &out), sv(&[("small", 1)]));
    assert_eq!(names(&s, &s.waiting_order()), vec!["big", "queued"]);
}

#[test]
fn s3_priority_victim_already_scheduled_gives_back_its_budget() {
    let mut s = sched_with(4, |c| c.policy = Policy::Priority);
    add_with(&mut s, "x", 5, 20, |r| r.priority = 9);
    step(&mut s);
    add_with(&mut s, "y", 8, 20, |r| r.arrival_time = 1.0);
    step(&mut s);
    assert_eq!(s.num_free_blocks(), 0);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["x"]);
    assert_eq!(scheduled(&s, &out), sv(&[("y", 1)]));
    assert_eq!(out.total_num_scheduled_tokens, 1, "x's token was refunded");
}

/// Priority, prefill interval 3, 4-token blocks, `usable` blocks, a 6 + ...
/// budget: `p` (least urgent, 30 tokens) is admitted alone and runs ahead of
/// `d` and `e` in `running`; they join it in step 2, when `p` gets its second
/// chunk (T caps each request at `threshold`). From then on `p` is a prefill
/// chunk that S12 holds on two steps of three, while `d` and `e` decode.
fn chunk_ahead_of_decodes(
    usable: usize,
    budget: usize,
    threshold: usize,
    d_len: usize,
) -> Scheduler {
    let mut s = sched_with(usable, |c| {
        c.policy = Policy::Priority;
        c.prefill_schedule_interval = 3;
        c.max_num_batched_tokens = budget;
        c.long_prefill_token_threshold = threshold;
    });
    add_with(&mut s, "p", 30, 50, |r| r.priority = 9);
    step(&mut s);
    add_with(&mut s, "d", d_len, 50, |r| r.arrival_time = 1.0);
    add_with(&mut s, "e", 4, 50, |r| r.arrival_time = 2.0);
    let (out, _) = step(&mut s);
    assert_eq!(
        scheduled(&s, &out),
        sv(&[("p", threshold as u32), ("d", d_len as u32), ("e", 4)])
    );
    s
}

#[test]
fn s3_priority_victim_ahead_of_the_scan_moves_it_back_even_without_a_row() {
    // vLLM 0.33 moves `req_index` back for every victim ahead of it in
    // `running` (`if victim_index < req_index`), scheduled or not. Here the
    // victim is `p`, a prefill chunk the held step passed over: `d` needs a
    // block, the pool is empty, and `e`, behind `d`, still runs.
    let mut s = chunk_ahead_of_decodes(11, 16, 6, 5);
    for _held in [3, 4] {
        let (out, _) = step(&mut s);
        assert_eq!(scheduled(&s, &out), sv(&[("d", 1), ("e", 1)]));
    }
    let (out, _) = step(&mut s); // release step 5: p's next chunk
    assert_eq!(scheduled(&s, &out), sv(&[("p", 6), ("d", 1), ("e", 1)]));
    assert_eq!(s.num_free_blocks(), 0);
    // Held step 6: d's 9th token needs a third block.
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["p"]);
    assert_eq!(
        scheduled(&s, &out),
        sv(&[("d", 1), ("e", 1)]),
        "e is not passed over"
    );
}

// ------------------------------------------------------------------ S6, S7

#[test]
fn s6_max_num_active_seqs_caps_admission() {
    let mut s = sched_with(64, |c| c.max_num_active_seqs = Some(2));
    for r in ["a", "b", "c", "d"] {
        add(&mut s, r, 4, 10);
    }
    let (out, _) = step(&mut s);
    assert_eq!(out.len(), 2);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn s6_kv_holding_queue_is_served_first() {
    let mut s = sched(64);
    s.set_connector(Box::new(TestConnector::new(8, 1, 4)));
    add(&mut s, "remote", 13, 4); // 8 tokens load remotely
    step(&mut s); // load starts; the request waits aside holding blocks
    add(&mut s, "local", 2, 4);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["remote", "local"]);
    assert_eq!(out.num_cached_tokens[0], 8);
}

#[test]
fn s7_remote_kv_not_ready_is_skipped_and_later_requests_pass() {
    let mut s = sched(64);
    s.set_connector(Box::new(TestConnector::new(8, 2, 4)));
    let remote = add(&mut s, "remote", 13, 4);
    add(&mut s, "short", 3, 4); // under one block: nothing to load
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["short"]);
    assert_eq!(
        s.request(remote).unwrap().status,
        RequestStatus::WaitingForRemoteKvs
    );
    assert_eq!(
        s.blocks_of(remote).len(),
        4,
        "blocks for the whole prompt are reserved"
    );
    let (out, _) = step(&mut s);
    assert!(!out.req_handles.contains(&remote), "one step is not enough");
    let (out, _) = step(&mut s);
    let i = out.req_handles.iter().position(|&h| h == remote).unwrap();
    assert_eq!(out.num_scheduled_tokens[i], 5);
    assert_eq!(out.num_cached_tokens[i], 8);
    assert_eq!(out.kinds[i], ScheduledKind::New as u8);
}

#[test]
fn s7_lora_slots_full_skips_and_deferred_requests_keep_their_order() {
    let mut s = sched_with(64, |c| c.max_loras = 1);
    add_with(&mut s, "l1", 4, 10, |r| r.lora_id = Some(1));
    step(&mut s);
    add_with(&mut s, "l2a", 4, 10, |r| r.lora_id = Some(2));
    add_with(&mut s, "l2b", 4, 10, |r| r.lora_id = Some(2));
    add_with(&mut s, "l1b", 4, 10, |r| r.lora_id = Some(1));
    add(&mut s, "base", 4, 10);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["l1", "l1b", "base"]);
    assert_eq!(names(&s, &s.waiting_order()), vec!["l2a", "l2b"]);
}

#[test]
fn s7_stale_outputs_in_flight_defer_a_preempted_request() {
    let mut s = sched_with(4, |c| c.max_model_len = 64);
    s.set_async_scheduling(true);
    let r0 = add(&mut s, "r0", 7, 20);
    let r1 = add(&mut s, "r1", 7, 20);
    let o0 = s.schedule(); // prefill both
    let o1 = s.schedule(); // decode on placeholders
    assert_eq!(o1.num_scheduled_tokens, vec![1, 1]);
    s.update_from_output(&outputs_for(&s, &o0)).unwrap();
    let o2 = s.schedule(); // r0 needs a third block: r1 preempted, its step-1 token in flight
    assert_eq!(o2.preempted, vec![r1]);
    assert_eq!(s.progress(r1).unwrap().num_output_placeholders, 1);
    s.update_from_output(&ModelRunnerOutput::from_tokens(&[Some(7), Some(7)]))
        .unwrap(); // step 1's tokens arrive
    assert_eq!(
        s.request(r1).unwrap().num_output_tokens,
        2,
        "kept through preemption"
    );
    s.update_from_output(&ModelRunnerOutput::from_tokens(&[Some(7)]))
        .unwrap();
    s.abort_request("r0");
    let o3 = s.schedule();
    assert_eq!(o3.req_handles, vec![r1], "resumed once its output landed");
    assert_eq!(o3.kinds, vec![ScheduledKind::Resumed as u8]);
    let _ = r0;
}

#[test]
fn s7_stale_output_request_is_skipped_while_its_token_is_in_flight() {
    let mut s = sched_with(4, |c| c.max_model_len = 64);
    s.set_async_scheduling(true);
    add(&mut s, "r0", 7, 20);
    let r1 = add(&mut s, "r1", 7, 20);
    let o0 = s.schedule();
    s.schedule();
    s.update_from_output(&outputs_for(&s, &o0)).unwrap();
    s.schedule(); // r1 preempted with a placeholder outstanding
    s.abort_request("r0"); // room for r1 again
    let o3 = s.schedule();
    assert!(
        !o3.req_handles.contains(&r1),
        "skipped: its output is still in flight"
    );
    assert_eq!(s.waiting_order(), vec![r1]);
}

// ------------------------------------------------------------------ S8

#[test]
fn s8_duplicate_prompt_hits_whole_blocks_capped_below_num_tokens() {
    let mut s = sched(64);
    let p: Vec<u32> = (10..18).collect(); // 8 tokens = 2 full blocks
    s.add_request(NewRequest::new("a", p.clone(), 4)).unwrap();
    s.add_request(NewRequest::new("b", p.clone(), 4)).unwrap();
    let mut q = p.clone();
    q.push(99); // 9 tokens: both blocks may hit
    s.add_request(NewRequest::new("c", q, 4)).unwrap();
    let (out, _) = step(&mut s);
    // Blocks are cached at schedule time, so b and c hit a's blocks in the same step.
    assert_eq!(out.num_cached_tokens, vec![0, 4, 8]);
    assert_eq!(out.num_scheduled_tokens, vec![8, 4, 1]);
    let st = s.stats().prefix_cache;
    assert_eq!((st.queries, st.hits), (25, 12));
}

#[test]
fn s8_reset_prefix_cache_makes_every_block_a_miss_and_keeps_requests_going() {
    let mut s = sched(64);
    let p: Vec<u32> = (10..18).collect(); // 2 full blocks
    s.add_request(NewRequest::new("done", p.clone(), 1))
        .unwrap();
    s.add_request(NewRequest::new("running", (30..38).collect(), 8))
        .unwrap();
    step(&mut s);
    s.reset_prefix_cache();
    s.add_request(NewRequest::new("again", p.clone(), 1))
        .unwrap();
    s.add_request(NewRequest::new("same", (30..38).collect(), 1))
        .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(
        names(&s, &out.req_handles),
        vec!["running", "again", "same"]
    );
    assert_eq!(
        out.num_cached_tokens,
        vec![0, 0, 0],
        "no hit on blocks cached before the reset"
    );
    s.check_invariants().unwrap();
}

#[test]
fn s8_cached_blocks_of_finished_requests_stay_until_evicted_lru() {
    let mut s = sched(6);
    let p: Vec<u32> = (10..18).collect();
    s.add_request(NewRequest::new("a", p.clone(), 1)).unwrap();
    let (_, res) = step(&mut s);
    assert_eq!(res.finish_reasons, vec![FinishReason::Length as u8]);
    assert_eq!(s.num_free_blocks(), 6, "freed at once, but still cached");
    s.add_request(NewRequest::new("again", p.clone(), 1))
        .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_cached_tokens, vec![4]);
    // Unhashed blocks are reused first: a small request leaves the cache alone.
    add(&mut s, "other", 3, 1);
    step(&mut s);
    s.add_request(NewRequest::new("third", p.clone(), 1))
        .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_cached_tokens, vec![4]);
    // A request needing the whole pool evicts everything.
    add(&mut s, "huge", 24, 1);
    step(&mut s);
    s.add_request(NewRequest::new("last", p, 1)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_cached_tokens, vec![0]);
}

#[test]
fn s8_freed_blocks_go_tail_first_uncached_to_the_front() {
    let mut s = sched(8);
    let h = add(&mut s, "a", 9, 1); // blocks [1, 2, 3]; 1 and 2 full and cached
    step(&mut s);
    assert!(s.request(h).is_some());
    assert_eq!(s.kv().pool.free_queue(), vec![3, 4, 5, 6, 7, 8, 2, 1]);
}

#[test]
fn s8_no_prefix_caching_means_no_hits() {
    let mut s = sched_with(64, |c| c.enable_prefix_caching = false);
    let p: Vec<u32> = (10..30).collect();
    s.add_request(NewRequest::new("a", p.clone(), 4)).unwrap();
    s.add_request(NewRequest::new("b", p, 4)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_cached_tokens, vec![0, 0]);
}

// ------------------------------------------------------------------ S9

#[test]
fn s9_a_lone_request_is_never_capped() {
    let mut s = sched_with(64, |c| c.long_prefill_token_threshold = 8);
    add(&mut s, "a", 40, 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![40]);
}

#[test]
fn s9_threshold_caps_every_request_when_several_compete() {
    let mut s = sched_with(64, |c| c.long_prefill_token_threshold = 8);
    add(&mut s, "a", 40, 4);
    add(&mut s, "b", 40, 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![8, 8]);
    let (out, _) = step(&mut s);
    assert_eq!(
        out.num_scheduled_tokens,
        vec![8, 8],
        "running chunks are capped too"
    );
}

#[test]
fn s9_adaptive_threshold_rises_to_the_fair_share() {
    let mut s = sched_with(64, |c| {
        c.long_prefill_token_threshold = 4;
        c.long_prefill_token_threshold_adaptive = true;
    });
    add(&mut s, "a", 40, 4);
    add(&mut s, "b", 40, 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![32, 32]);
}

#[test]
fn s9_without_chunking_a_prompt_over_the_budget_stops_the_scan() {
    let mut s = sched_with(64, |c| {
        c.enable_chunked_prefill = false;
        c.max_model_len = 64;
    });
    add(&mut s, "a", 40, 4);
    add(&mut s, "b", 30, 4);
    add(&mut s, "c", 10, 4);
    let (out, _) = step(&mut s);
    assert_eq!(
        scheduled(&s, &out),
        sv(&[("a", 40)]),
        "c is not admitted past b"
    );
}

// ------------------------------------------------------------------ S10, S11

#[test]
fn s10_waiting_requests_never_preempt_running_ones() {
    let mut s = sched(6);
    add(&mut s, "a", 16, 40);
    step(&mut s);
    add(&mut s, "b", 12, 4); // needs 3 blocks, 2 free
    let (out, _) = step(&mut s);
    assert!(out.preempted.is_empty());
    assert_eq!(names(&s, &out.req_handles), vec!["a"]);
}

#[test]
fn s10_full_prompt_must_fit_even_when_the_first_chunk_would() {
    let mut s = sched_with(6, |c| c.max_num_batched_tokens = 8);
    add(&mut s, "a", 8, 40);
    step(&mut s); // a holds 2 blocks (+1 once it decodes)
    add(&mut s, "b", 20, 4); // first chunk of 7 tokens fits in 2 blocks, the prompt needs 5
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["a"]);
    let mut s = sched_with(6, |c| {
        c.max_num_batched_tokens = 8;
        c.scheduler_reserve_full_isl = false;
    });
    add(&mut s, "a", 8, 40);
    step(&mut s);
    add(&mut s, "b", 20, 4);
    let (out, _) = step(&mut s);
    assert_eq!(
        names(&s, &out.req_handles),
        vec!["a", "b"],
        "only the chunk is checked"
    );
}

#[test]
fn s10_watermark_keeps_a_fraction_free_once_something_is_scheduled() {
    let mut s = sched_with(8, |c| c.watermark = 0.5);
    add(&mut s, "a", 8, 4); // 2 blocks; first admission of the step: no watermark
    add(&mut s, "b", 8, 4); // 2 more would leave 4 free: allowed
    add(&mut s, "c", 4, 4); // 1 more would leave 3 < 4: refused
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["a", "b"]);
}

#[test]
fn s11_admission_reports_new_then_resumed_with_full_block_tables() {
    let mut s = sched(7);
    for r in ["r0", "r1", "r2"] {
        add(&mut s, r, 7, 20);
    }
    step(&mut s);
    step(&mut s);
    let (out, _) = step(&mut s); // r0 takes the last free block, r1 preempts r2
    let victim = out.preempted[0];
    s.abort_request("r0");
    let (out, _) = step(&mut s);
    let i = out.req_handles.iter().position(|&h| h == victim).unwrap();
    assert_eq!(out.kinds[i], ScheduledKind::Resumed as u8);
    assert_eq!(
        out.block_ids_of(i),
        s.blocks_of(victim),
        "whole table for a resumed request"
    );
    // r1 reused r2's freed tail block; its first block is still cached.
    assert_eq!(out.num_cached_tokens[i], 4, "hit on its own cached blocks");
    let j = out.req_handles.iter().position(|&h| h != victim).unwrap();
    assert_eq!(out.kinds[j], ScheduledKind::Cached as u8);
}

// ------------------------------------------------------------------ S12

#[test]
fn s12_prefill_waits_for_the_interval_while_decodes_run_every_step() {
    let mut s = sched_with(64, |c| c.prefill_schedule_interval = 3);
    add(&mut s, "d", 4, 50);
    step(&mut s); // release step: d's prefill
    let mut admitted_at = None;
    for k in 1..6 {
        if k == 1 {
            add(&mut s, "p", 8, 4);
        }
        let (out, _) = step(&mut s);
        assert!(
            out.req_handles.contains(&s.handle_of("d").unwrap()),
            "decode at step {k}"
        );
        if admitted_at.is_none() && out.kinds.contains(&(ScheduledKind::New as u8)) {
            admitted_at = Some(k);
        }
    }
    assert_eq!(
        admitted_at,
        Some(3),
        "held for k=3 executed steps since the last prefill"
    );
}

#[test]
fn s12_release_step_that_leaves_a_queue_turns_throttling_off() {
    let mut s = sched_with(64, |c| {
        c.prefill_schedule_interval = 3;
        c.max_num_active_seqs = Some(2);
    });
    add(&mut s, "d", 4, 50);
    step(&mut s);
    for r in ["p1", "p2", "p3"] {
        add(&mut s, r, 8, 30);
    }
    let new = |out: &SchedulerOutput| {
        out.kinds
            .iter()
            .filter(|&&k| k == ScheduledKind::New as u8)
            .count()
    };
    let (mut out, _) = step(&mut s);
    while new(&out) == 0 {
        (out, _) = step(&mut s);
    }
    assert_eq!(
        new(&out),
        1,
        "release step: p1 takes the last slot, p2 and p3 wait"
    );
    // Capacity escape: once a slot frees up, no interval is waited for.
    s.abort_request("d");
    let (out, _) = step(&mut s);
    assert_eq!(new(&out), 1, "admits on the very next step");
}

#[test]
fn s12_in_flight_chunks_are_held_too() {
    let mut s = sched_with(64, |c| {
        c.prefill_schedule_interval = 3;
        c.max_num_batched_tokens = 16;
        c.max_num_seqs = 4;
    });
    add(&mut s, "d", 4, 50);
    step(&mut s);
    add(&mut s, "long", 40, 4);
    let mut chunk_steps = Vec::new();
    for k in 1..8 {
        let (out, _) = step(&mut s);
        if let Some(h) = s.handle_of("long") {
            if let Some(i) = out.req_handles.iter().position(|&x| x == h) {
                if out.num_scheduled_tokens[i] > 1 {
                    chunk_steps.push(k);
                }
            }
        }
    }
    assert_eq!(chunk_steps, vec![3, 6], "one chunk per interval");
}

#[test]
fn s12_a_prefill_chunk_taken_back_by_a_preemption_still_restarts_the_interval() {
    // vLLM 0.33's `prefill_scheduled` is set when the running loop schedules
    // a prefill chunk and stays set when that request is preempted later in
    // the step, its row taken back: the step still restarts the interval.
    let mut s = chunk_ahead_of_decodes(12, 18, 7, 6);
    for _held in [3, 4] {
        let (out, _) = step(&mut s);
        assert_eq!(scheduled(&s, &out), sv(&[("d", 1), ("e", 1)]));
    }
    // Release step 5: p's last chunk is scheduled, then d needs a third
    // block and takes it back.
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["p"]);
    assert_eq!(scheduled(&s, &out), sv(&[("d", 1), ("e", 1)]));
    assert_eq!(s.interval.last_prefill, s.interval.executed);
    // So w, a prompt that would fit, waits out the interval: held on
    // steps 6 and 7, admitted on step 8.
    let w = add(&mut s, "w", 4, 5);
    for held in [6, 7] {
        let (out, _) = step(&mut s);
        assert!(!out.req_handles.contains(&w), "w held at step {held}");
        assert_eq!(scheduled(&s, &out), sv(&[("d", 1), ("e", 1)]));
    }
    let (out, _) = step(&mut s);
    assert!(out.req_handles.contains(&w), "released at step 8");
}

// ------------------------------------------------------------------ S13

#[test]
fn s13_paused_new_runs_running_and_kv_holding_only_and_resume_loses_nothing() {
    let mut s = sched(64);
    add(&mut s, "a", 4, 10);
    step(&mut s);
    s.set_pause_state(PauseState::PausedNew);
    add(&mut s, "b", 4, 10);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["a"]);
    assert_eq!(s.num_waiting(), 1);
    s.set_pause_state(PauseState::Unpaused);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["a", "b"]);
}

#[test]
fn s13_paused_new_still_admits_kv_holding_sessions() {
    let mut s = sched(64);
    add_with(&mut s, "sess", 4, 1, |r| r.streaming = true);
    step(&mut s);
    s.set_pause_state(PauseState::PausedNew);
    s.add_stream_input(
        "sess",
        StreamInput {
            token_ids: vec![5, 6],
            max_tokens: 1,
            is_last: false,
        },
    )
    .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["sess"]);
}

// ------------------------------------------------------------------ S15

#[test]
fn s15_streaming_session_keeps_its_slot_and_the_counter_pairs() {
    let mut s = sched_with(64, |c| c.max_num_active_seqs = Some(1));
    let h = add_with(&mut s, "sess", 5, 2, |r| r.streaming = true);
    add(&mut s, "other", 4, 2);
    step(&mut s);
    let (_, res) = step(&mut s);
    assert_eq!(res.segment_ended, vec![true]);
    assert_eq!(res.finish_reasons, vec![0]);
    assert_eq!(
        s.request(h).unwrap().status,
        RequestStatus::WaitingForStreamingReq
    );
    assert_eq!(s.num_waiting_for_streaming_input(), 1);
    assert!(!s.blocks_of(h).is_empty(), "keeps its KV");
    let (out, _) = step(&mut s);
    assert!(
        out.is_empty(),
        "its slot counts against max_num_active_seqs"
    );
    s.add_stream_input(
        "sess",
        StreamInput {
            token_ids: vec![8, 9, 10],
            max_tokens: 1,
            is_last: true,
        },
    )
    .unwrap();
    assert_eq!(s.num_waiting_for_streaming_input(), 0);
    let (out, res) = step(&mut s);
    // 5 prompt + 2 outputs, the last output not yet computed, + 3 new tokens.
    assert_eq!(
        out.num_computed_tokens,
        vec![6],
        "continues from its cached KV"
    );
    assert_eq!(out.num_scheduled_tokens, vec![4]);
    assert_eq!(
        res.finish_reasons,
        vec![FinishReason::Length as u8],
        "last segment ends it"
    );
    s.check_invariants().unwrap();
}

#[test]
fn s15_a_token_scheduled_ahead_past_a_segment_end_is_dropped() {
    let mut s = sched_with(64, |c| c.max_model_len = 64);
    s.set_async_scheduling(true);
    let h = add_with(&mut s, "sess", 5, 1, |r| r.streaming = true);
    add(&mut s, "other", 4, 20);
    let o0 = s.schedule(); // prefill both; the session samples its one token
    let o1 = s.schedule(); // scheduled ahead: the session again, on a placeholder
    assert!(o1.req_handles.contains(&h));
    let res = s.update_from_output(&outputs_for(&s, &o0)).unwrap();
    assert!(res.segment_ended.contains(&true));
    let tokens = s.request(h).unwrap().num_tokens();
    let res = s.update_from_output(&outputs_for(&s, &o1)).unwrap();
    assert!(
        !res.handles.contains(&h),
        "nothing reported for the session"
    );
    assert_eq!(
        s.request(h).unwrap().num_tokens(),
        tokens,
        "its stale token is dropped"
    );
    assert_eq!(s.progress(h).unwrap().num_output_placeholders, 0);
    assert_eq!(s.num_waiting_for_streaming_input(), 1);
    s.check_invariants().unwrap();
}

#[test]
fn s15_closing_a_session_still_serves_input_already_sent() {
    let mut s = sched(64);
    add_with(&mut s, "sess", 5, 3, |r| r.streaming = true);
    step(&mut s);
    s.add_stream_input(
        "sess",
        StreamInput {
            token_ids: vec![8, 9],
            max_tokens: 1,
            is_last: false,
        },
    )
    .unwrap();
    s.close_stream("sess").unwrap();
    let mut reasons = Vec::new();
    for _ in 0..6 {
        let (_, res) = step(&mut s);
        reasons.extend(res.finish_reasons.iter().copied().filter(|&r| r != 0));
    }
    assert_eq!(
        reasons,
        vec![FinishReason::Length as u8],
        "ends after the queued segment"
    );
    assert_eq!(s.num_waiting_for_streaming_input(), 0);
    assert_eq!(s.num_free_blocks(), 64);
}

#[test]
fn s15_closing_a_waiting_session_finishes_it_and_decrements() {
    let mut s = sched(64);
    add_with(&mut s, "sess", 5, 1, |r| r.streaming = true);
    step(&mut s);
    assert_eq!(s.num_waiting_for_streaming_input(), 1);
    s.close_stream("sess").unwrap();
    assert_eq!(s.num_waiting_for_streaming_input(), 0);
    assert_eq!(s.num_free_blocks(), 64);
    assert!(s
        .add_stream_input(
            "sess",
            StreamInput {
                token_ids: vec![1],
                max_tokens: 1,
                is_last: true
            }
        )
        .is_err());
}

// ------------------------------------------------------------------ S17, S18

#[test]
fn s17_finished_requests_are_freed_in_the_same_update_and_reported_next_step() {
    let mut s = sched(64);
    let h = add_with(&mut s, "a", 5, 10, |r| r.stop_token_ids = vec![7]);
    let (_, res) = step(&mut s);
    assert_eq!(res.finish_reasons, vec![FinishReason::Stop as u8]);
    assert_eq!(s.num_free_blocks(), 64);
    assert_eq!(s.num_running(), 0);
    assert!(s.has_requests(), "the finish is still to be reported");
    let out = s.schedule();
    assert_eq!(out.finished, vec![h]);
    s.update_from_output(&ModelRunnerOutput::from_tokens(&[]))
        .unwrap();
    assert!(!s.has_requests());
}

#[test]
fn s17_mismatched_outputs_are_an_error_naming_the_sizes() {
    let mut s = sched(64);
    add(&mut s, "a", 5, 10);
    s.schedule();
    let err = s.update_from_output(&ModelRunnerOutput::from_tokens(&[Some(1), Some(2)]));
    let msg = err.unwrap_err().to_string();
    assert!(
        msg.contains("scheduled 1 requests") && msg.contains("expected 2"),
        "{msg}"
    );
    assert!(s
        .update_from_output(&ModelRunnerOutput::from_tokens(&[Some(1)]))
        .is_ok());
    assert!(
        s.update_from_output(&ModelRunnerOutput::from_tokens(&[]))
            .is_err(),
        "no step in flight"
    );
}

#[test]
fn s17_speculative_tokens_are_scheduled_and_rejected_ones_rolled_back() {
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 2);
    let h = add(&mut s, "a", 5, 20);
    let out = s.schedule();
    let mut mro = outputs_for(&s, &out);
    mro.draft_offsets = vec![0, 2];
    mro.draft_token_ids = vec![40, 41];
    s.update_from_output(&mro).unwrap();
    let out = s.schedule();
    assert_eq!(out.num_scheduled_tokens, vec![3]);
    assert_eq!(out.num_spec_tokens, vec![2]);
    // The first draft is accepted, the second rejected; plus the bonus token.
    let mro = ModelRunnerOutput {
        sampled_offsets: vec![0, 2],
        sampled_token_ids: vec![40, 50],
        ..Default::default()
    };
    let res = s.update_from_output(&mro).unwrap();
    assert_eq!(res.token_ids, vec![40, 50]);
    let r = s.request(h).unwrap();
    assert_eq!(r.num_tokens(), 8);
    assert_eq!(
        s.progress(h).unwrap().num_computed_tokens,
        7,
        "one rejected draft rolled back"
    );
}

#[test]
fn s18_abort_frees_at_once_and_unknown_or_finished_ids_are_no_ops() {
    let mut s = sched(64);
    add(&mut s, "run", 8, 10);
    step(&mut s);
    add(&mut s, "wait", 8, 10);
    assert_eq!(s.abort_request("run"), Some(RequestStatus::Running));
    assert_eq!(s.abort_request("wait"), Some(RequestStatus::Waiting));
    assert_eq!(s.num_free_blocks(), 64);
    assert_eq!(s.abort_request("run"), None);
    assert_eq!(s.abort_request("nobody"), None);
    assert!(s.has_requests(), "the step after an abort is not idle");
    let out = s.schedule();
    assert_eq!(out.finished.len(), 2);
    assert!(out.is_empty());
    s.update_from_output(&ModelRunnerOutput::from_tokens(&[]))
        .unwrap();
    assert!(!s.has_requests());
}

#[test]
fn s18_aborted_requests_are_never_reported_as_finished_by_the_model() {
    let mut s = sched(64);
    add(&mut s, "a", 8, 10);
    let out = s.schedule();
    s.abort_request("a");
    let res = s.update_from_output(&outputs_for(&s, &out)).unwrap();
    assert!(res.is_empty());
}

#[test]
fn s16_a_lone_request_that_outgrows_the_pool_ends_instead_of_waiting_forever() {
    let mut s = sched(4); // 16 tokens
    let h = add(&mut s, "r", 12, 10);
    let mut reasons = Vec::new();
    for _ in 0..20 {
        let (_, res) = step(&mut s);
        reasons.extend(res.finish_reasons.iter().copied().filter(|&r| r != 0));
        if !s.has_requests() {
            break;
        }
    }
    assert_eq!(reasons, vec![FinishReason::Length as u8]);
    assert!(!s.has_requests());
    assert_eq!(s.num_free_blocks(), 4);
    let _ = h;
}

// ------------------------------------------------------------------ §4 ignored

#[test]
fn s4_prompt_that_can_never_fit_is_finished_as_ignored_with_a_reason() {
    let mut s = sched_with(4, |c| c.max_model_len = 32);
    let long = add(&mut s, "long", 32, 1);
    let big = add(&mut s, "big", 17, 1);
    assert!(s
        .ignore_reason(long)
        .unwrap()
        .contains("max_model_len (32)"));
    assert!(s
        .ignore_reason(big)
        .unwrap()
        .contains("17 tokens needs 5 KV blocks"));
    let out = s.schedule();
    assert_eq!(out.finished, vec![long, big]);
    let res = s
        .update_from_output(&ModelRunnerOutput::from_tokens(&[]))
        .unwrap();
    assert_eq!(res.finish_reasons, vec![4, 4]);
    assert!(!s.has_requests());
}

#[test]
fn s4_invalid_requests_are_rejected_naming_the_field() {
    let mut s = sched(4);
    let e = s.add_request(NewRequest::new("e", vec![], 1)).unwrap_err();
    assert!(e.to_string().contains("prompt_token_ids"));
    // max_tokens 0 is a prefill-only request (S20), except for a streaming session.
    let mut z = NewRequest::new("z", vec![1], 0);
    z.streaming = true;
    let e = s.add_request(z).unwrap_err();
    assert!(e.to_string().contains("max_tokens (0)"));
    add(&mut s, "dup", 1, 1);
    assert_eq!(
        s.add_request(NewRequest::new("dup", vec![1], 1))
            .unwrap_err(),
        Error::DuplicateRequest("dup".into())
    );
}

// ------------------------------------------------------------------ gate telemetry

fn stops(s: &Scheduler, gate: ScanStop) -> u64 {
    s.stats().gates.scan_stops(gate)
}

fn last_stop(s: &Scheduler) -> Option<ScanStop> {
    s.stats().gates.last_scan_stop
}

fn skips(s: &Scheduler, reason: SkipReason) -> u64 {
    s.stats().gates.skips(reason)
}

#[test]
fn gate_counters_start_at_zero_and_record_one_stop_per_step() {
    let mut s = sched(64);
    assert_eq!(s.stats().gates, GateCounters::default());
    assert_eq!(last_stop(&s), None);
    add(&mut s, "a", 4, 3);
    for _ in 0..5 {
        s.schedule();
    }
    let g = s.stats().gates;
    assert_eq!(g.scan_stops_total.iter().sum::<u64>(), 5);
    assert_eq!(g.skips_total, [0; SkipReason::COUNT]);
}

#[test]
fn gate_active_seqs_is_recorded_when_the_active_cap_is_reached() {
    let mut s = sched_with(64, |c| c.max_num_active_seqs = Some(2));
    for r in ["a", "b", "c", "d"] {
        add(&mut s, r, 4, 10);
    }
    step(&mut s);
    assert_eq!(last_stop(&s), Some(ScanStop::ActiveSeqs));
    assert_eq!(stops(&s, ScanStop::ActiveSeqs), 1);
}

#[test]
fn gate_token_budget_is_recorded_when_the_budget_runs_out() {
    let mut s = sched(64);
    add(&mut s, "a", 40, 4);
    add(&mut s, "b", 40, 4);
    add(&mut s, "c", 10, 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.total_num_scheduled_tokens, 64);
    assert_eq!(last_stop(&s), Some(ScanStop::TokenBudget));
    assert_eq!(stops(&s, ScanStop::TokenBudget), 1);
}

#[test]
fn gate_token_budget_is_recorded_when_a_whole_prompt_does_not_fit_without_chunking() {
    let mut s = sched_with(64, |c| {
        c.enable_chunked_prefill = false;
        c.max_model_len = 64;
    });
    add(&mut s, "a", 40, 4);
    add(&mut s, "b", 30, 4);
    step(&mut s);
    assert_eq!(last_stop(&s), Some(ScanStop::TokenBudget));
}

#[test]
fn gate_kv_blocks_is_recorded_when_the_next_request_does_not_fit() {
    let mut s = sched(6);
    add(&mut s, "a", 16, 40);
    step(&mut s);
    add(&mut s, "b", 12, 4); // needs 3 blocks, 2 free
    step(&mut s);
    assert_eq!(last_stop(&s), Some(ScanStop::KvBlocks));
    assert_eq!(stops(&s, ScanStop::KvBlocks), 1);
}

#[test]
fn gate_draft_slots_is_recorded_when_only_draft_slots_are_left_of_the_input_budget() {
    let mut s = sched_with(64, |c| {
        c.max_num_seqs = 4;
        c.max_num_batched_tokens = 12;
        c.num_speculative_tokens = 3;
        c.num_lookahead_tokens = 3;
    });
    add(&mut s, "a", 9, 4); // takes 12 - 3 draft slots: 3 left, all of them drafts'
    add(&mut s, "b", 2, 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![9]);
    assert_eq!(last_stop(&s), Some(ScanStop::DraftSlots));
}

#[test]
fn gate_paused_is_recorded_when_a_pause_holds_back_waiting_requests() {
    let mut s = sched(64);
    add(&mut s, "a", 4, 10);
    step(&mut s);
    s.set_pause_state(PauseState::PausedNew);
    add(&mut s, "b", 4, 10);
    step(&mut s);
    assert_eq!(last_stop(&s), Some(ScanStop::Paused));
    s.set_pause_state(PauseState::PausedAll); // S5: the waiting phase does not run
    step(&mut s);
    assert_eq!(last_stop(&s), Some(ScanStop::Paused));
    assert_eq!(stops(&s, ScanStop::Paused), 2);
}

#[test]
fn gate_prefill_interval_is_recorded_when_s12_holds_a_prefill() {
    let mut s = sched_with(64, |c| c.prefill_schedule_interval = 3);
    add(&mut s, "d", 4, 50);
    step(&mut s); // release step: d's prefill
    add(&mut s, "p", 8, 4);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["d"]);
    assert_eq!(last_stop(&s), Some(ScanStop::PrefillInterval));
}

#[test]
fn gate_no_waiting_is_recorded_when_nothing_is_left_to_take() {
    let mut s = sched(64);
    add(&mut s, "a", 4, 10);
    step(&mut s);
    assert_eq!(
        last_stop(&s),
        Some(ScanStop::NoWaiting),
        "a admitted, queue empty"
    );
    s.set_pause_state(PauseState::PausedAll);
    step(&mut s);
    assert_eq!(
        last_stop(&s),
        Some(ScanStop::NoWaiting),
        "paused, but nothing waits"
    );
    assert_eq!(stops(&s, ScanStop::NoWaiting), 2);
}

#[test]
fn gate_preempted_is_recorded_when_the_step_preempts() {
    let mut s = three_in_six_blocks(Policy::Fcfs);
    assert_eq!(stops(&s, ScanStop::Preempted), 0);
    let (out, _) = step(&mut s);
    assert!(!out.preempted.is_empty());
    assert_eq!(last_stop(&s), Some(ScanStop::Preempted));
    assert_eq!(stops(&s, ScanStop::Preempted), 1);
}

#[test]
fn skip_lora_slots_is_counted_once_per_skipped_request() {
    let mut s = sched_with(64, |c| c.max_loras = 1);
    add_with(&mut s, "l1", 4, 10, |r| r.lora_id = Some(1));
    step(&mut s);
    add_with(&mut s, "l2a", 4, 10, |r| r.lora_id = Some(2));
    add_with(&mut s, "l2b", 4, 10, |r| r.lora_id = Some(2));
    add(&mut s, "base", 4, 10);
    step(&mut s);
    assert_eq!(skips(&s, SkipReason::LoraSlots), 2);
    assert_eq!(last_stop(&s), Some(ScanStop::NoWaiting), "all else skipped");
}

#[test]
fn skip_remote_kv_is_counted_while_a_load_is_not_done() {
    let mut s = sched(64);
    s.set_connector(Box::new(TestConnector::new(8, 2, 4)));
    add(&mut s, "remote", 13, 4);
    step(&mut s); // the load starts: not a skip
    assert_eq!(skips(&s, SkipReason::RemoteKv), 0);
    step(&mut s); // one step is not enough
    assert_eq!(skips(&s, SkipReason::RemoteKv), 1);
    step(&mut s); // done: admitted
    assert_eq!(skips(&s, SkipReason::RemoteKv), 1);
}

#[test]
fn skip_stale_output_is_counted_while_a_token_is_in_flight() {
    let mut s = sched_with(4, |c| c.max_model_len = 64);
    s.set_async_scheduling(true);
    add(&mut s, "r0", 7, 20);
    add(&mut s, "r1", 7, 20);
    let o0 = s.schedule();
    s.schedule();
    s.update_from_output(&outputs_for(&s, &o0)).unwrap();
    s.schedule(); // r1 preempted with a placeholder outstanding
    assert_eq!(last_stop(&s), Some(ScanStop::Preempted));
    s.abort_request("r0");
    s.schedule();
    assert_eq!(skips(&s, SkipReason::StaleOutput), 1);
}

// ------------------------------------------------------- priority preemption

/// Active set of 2 under S12 (interval 3): "d" decodes every step, "long"
/// (priority 5) is a prefill chunk held on non-release steps, so it has no
/// row in those steps. Returns once "long" runs as a held chunk.
fn full_active_set_with_a_held_chunk(f: impl FnOnce(&mut SchedulerConfig)) -> Scheduler {
    let mut s = sched_with(64, |c| {
        c.policy = Policy::Priority;
        c.prefill_schedule_interval = 3;
        c.max_num_batched_tokens = 16;
        c.max_num_seqs = 4;
        c.max_num_active_seqs = Some(2);
        f(c);
    });
    add(&mut s, "d", 4, 50);
    step(&mut s);
    add_with(&mut s, "long", 40, 4, |r| {
        r.priority = 5;
        r.arrival_time = 1.0;
    });
    let long = s.handle_of("long").unwrap();
    while !(s.running().contains(&long) && s.requests[long as usize].progress.is_prefill_chunk) {
        step(&mut s);
    }
    s
}

/// Steps until something is preempted (at most `k` steps); returns that step.
fn step_until_preempted(s: &mut Scheduler, k: usize) -> Option<SchedulerOutput> {
    (0..k).find_map(|_| {
        let (out, _) = step(s);
        (!out.preempted.is_empty()).then_some(out)
    })
}

#[test]
fn priority_preemption_more_urgent_arrival_displaces_the_worst_running_request() {
    let mut s = full_active_set_with_a_held_chunk(|c| c.priority_preemption = true);
    add_with(&mut s, "hi", 8, 4, |r| {
        r.priority = 1;
        r.arrival_time = 2.0;
    });
    let out = step_until_preempted(&mut s, 3).expect("long is preempted");
    assert_eq!(names(&s, &out.preempted), vec!["long"]);
    assert!(
        !out.req_handles.contains(&s.handle_of("long").unwrap()),
        "only a victim without a row in the step"
    );
    let long = s.request(s.handle_of("long").unwrap()).unwrap();
    assert_eq!(long.num_preemptions, 1);
    // hi takes the freed slot at the next prefill step, ahead of long.
    let hi = s.handle_of("hi").unwrap();
    while !s.running().contains(&hi) {
        step(&mut s);
    }
    assert_eq!(names(&s, s.running()), vec!["d", "hi"]);
}

#[test]
fn priority_preemption_equal_priority_does_not_preempt() {
    let mut s = full_active_set_with_a_held_chunk(|c| c.priority_preemption = true);
    add_with(&mut s, "same", 8, 4, |r| {
        r.priority = 5;
        r.arrival_time = 0.5;
    });
    assert!(step_until_preempted(&mut s, 6).is_none());
}

#[test]
fn priority_preemption_cap_protects_a_request_preempted_that_many_times() {
    let mut s = full_active_set_with_a_held_chunk(|c| {
        c.priority_preemption = true;
        c.max_preemptions_per_request = 2;
    });
    let long = s.handle_of("long").unwrap();
    s.req_mut(long).num_preemptions = 2;
    add_with(&mut s, "hi", 8, 4, |r| r.priority = 1);
    assert!(step_until_preempted(&mut s, 6).is_none());
}

#[test]
fn priority_preemption_is_off_by_default() {
    assert!(!SchedulerConfig::default().priority_preemption);
    let mut s = full_active_set_with_a_held_chunk(|_| {});
    add_with(&mut s, "hi", 8, 4, |r| r.priority = 1);
    assert!(step_until_preempted(&mut s, 6).is_none());
}

#[test]
fn priority_preemption_under_fcfs_is_a_config_error_naming_both_values() {
    let cfg = SchedulerConfig {
        priority_preemption: true,
        ..Default::default()
    };
    match Scheduler::new(cfg) {
        Err(crate::error::Error::InvalidConfig(m)) => {
            assert!(
                m.contains("priority_preemption (true)") && m.contains("fcfs"),
                "{m}"
            )
        }
        other => panic!("expected InvalidConfig, got {:?}", other.err()),
    }
}

#[test]
fn priority_preemption_displaces_a_decoding_low_priority_request_in_the_same_step() {
    let mut s = sched_with(64, |c| {
        c.policy = Policy::Priority;
        c.priority_preemption = true;
        c.max_num_active_seqs = Some(2);
    });
    add_with(&mut s, "low", 4, 20, |r| r.priority = 5);
    add_with(&mut s, "mid", 4, 20, |r| r.priority = 3);
    step(&mut s);
    step(&mut s); // both decoding: each gets a row in the running phase
    add_with(&mut s, "urgent", 4, 5, |r| r.priority = 0);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.preempted), vec!["low"]);
    assert_eq!(
        scheduled(&s, &out),
        sv(&[("mid", 1), ("urgent", 4)]),
        "low's row was taken back"
    );
    assert_eq!(out.total_num_scheduled_tokens, 5);
    assert_eq!(
        s.request(s.handle_of("low").unwrap()).unwrap().status,
        RequestStatus::Preempted
    );
}

#[test]
fn a_slab_entry_is_half_a_cache_line() {
    assert_eq!(std::mem::size_of::<Slot>(), 32);
}

#[test]
fn s16_progress_follows_tokens_appended_by_outputs_and_streamed_input() {
    let mut s = sched(64);
    let h = add(&mut s, "a", 5, 10);
    step(&mut s);
    step(&mut s);
    assert_eq!(s.progress(h).unwrap().num_tokens, 7);
    assert_eq!(s.request(h).unwrap().num_tokens(), 7);
    s.check_invariants().unwrap();
    let h2 = add_with(&mut s, "b", 3, 1, |r| r.streaming = true);
    step(&mut s); // b's one-token segment ends
    s.add_stream_input(
        "b",
        StreamInput {
            token_ids: vec![9, 9],
            max_tokens: 1,
            is_last: true,
        },
    )
    .unwrap();
    assert_eq!(s.progress(h2).unwrap().num_tokens, 6);
    s.check_invariants().unwrap();
}

#[test]
fn s17_update_from_tokens_matches_update_from_output_and_its_errors() {
    let mut a = sched(64);
    let mut b = sched(64);
    for s in [&mut a, &mut b] {
        add(s, "long", 70, 3);
        add(s, "short", 5, 3);
    }
    for _ in 0..6 {
        let (oa, ob) = (a.schedule(), b.schedule());
        assert_eq!(oa.req_handles, ob.req_handles);
        let tokens: Vec<Option<u32>> = oa
            .req_handles
            .iter()
            .map(|&h| (!a.requests[h as usize].progress.is_prefill_chunk).then_some(7))
            .collect();
        let ra = a
            .update_from_output(&ModelRunnerOutput::from_tokens(&tokens))
            .unwrap();
        let rb = b.update_from_tokens(&tokens).unwrap();
        assert_eq!(
            (
                ra.handles,
                ra.token_offsets,
                ra.token_ids,
                ra.finish_reasons
            ),
            (
                rb.handles,
                rb.token_offsets,
                rb.token_ids,
                rb.finish_reasons
            )
        );
    }
    let e = b.update_from_tokens(&[Some(7)]).unwrap_err().to_string();
    assert!(e.contains("no scheduled step in flight"), "{e}");
    add(&mut b, "next", 5, 3);
    b.schedule();
    let e = b.update_from_tokens(&[]).unwrap_err().to_string();
    assert!(
        e.contains("scheduled 1 requests but sampled_offsets has 1 entries (expected 2)"),
        "{e}"
    );
}

// ------------------------------------------- vLLM 0.33: drafts, LoRA, pauses

/// Hands `h` the drafts for its next step, as an engine's drafter does after
/// the step's update.
fn give_drafts(s: &mut Scheduler, h: Handle, drafts: &[u32]) {
    s.update_draft_token_ids(&[h], &[0, drafts.len() as u32], drafts)
        .unwrap();
}

/// One step whose model samples `sampled[i]` for row `i` (empty: none).
fn step_sampling(s: &mut Scheduler, sampled: &[&[u32]]) -> (SchedulerOutput, EngineCoreOutputs) {
    let out = s.schedule();
    assert_eq!(out.len(), sampled.len(), "rows of {:?}", scheduled(s, &out));
    let mut mro = ModelRunnerOutput {
        sampled_offsets: vec![0],
        ..Default::default()
    };
    for row in sampled {
        mro.sampled_token_ids.extend_from_slice(row);
        mro.sampled_offsets.push(mro.sampled_token_ids.len() as u32);
    }
    let res = s.update_from_output(&mro).unwrap();
    s.check_invariants().unwrap();
    (out, res)
}

#[test]
fn s2_drafts_take_no_lookahead_kv_or_input_slots_unless_configured() {
    // vLLM's n-gram drafter (and drafts supplied by the caller): blocks cover
    // the scheduled tokens only, and admissions get the whole budget.
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 2);
    let a = add(&mut s, "a", 40, 10);
    let b = add(&mut s, "b", 24, 10);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![40, 24]);
    assert_eq!((s.blocks_of(a).len(), s.blocks_of(b).len()), (10, 6));
    // A drafter that writes KV for its drafts (EAGLE, a draft model).
    let mut s = sched_with(64, |c| {
        c.num_speculative_tokens = 2;
        c.num_lookahead_tokens = 2;
    });
    let a = add(&mut s, "a", 40, 10);
    add(&mut s, "b", 24, 10);
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![40, 22]);
    assert_eq!(s.blocks_of(a).len(), 11);
}

#[test]
fn s2_scheduled_drafts_go_to_the_runner_and_leave_the_request() {
    let mut s = sched_with(64, |c| {
        c.num_speculative_tokens = 3;
        c.max_num_seqs = 2;
        c.max_num_batched_tokens = 6;
    });
    let a = add(&mut s, "a", 3, 20);
    let b = add(&mut s, "b", 3, 20);
    step(&mut s);
    give_drafts(&mut s, a, &[40, 41, 42]);
    give_drafts(&mut s, b, &[50, 51, 52]);
    let out = s.schedule();
    // b gets what is left of the budget: its first draft only.
    assert_eq!(out.num_scheduled_tokens, vec![4, 2]);
    assert_eq!(out.num_spec_tokens, vec![3, 1]);
    assert_eq!(out.spec_token_ids, vec![40, 41, 42, 50]);
    assert_eq!(out.spec_token_ids_of(1), &[50]);
    for h in [a, b] {
        assert!(s.request(h).unwrap().spec_token_ids.is_empty());
    }
}

#[test]
fn s2_a_running_request_the_budget_skipped_keeps_its_drafts() {
    let mut s = sched_with(64, |c| {
        c.num_speculative_tokens = 3;
        c.max_num_seqs = 2;
        c.max_num_batched_tokens = 4;
    });
    let a = add(&mut s, "a", 2, 20);
    let b = add(&mut s, "b", 2, 20);
    step(&mut s);
    give_drafts(&mut s, a, &[40, 41, 42]);
    give_drafts(&mut s, b, &[50, 51, 52]);
    let (out, _) = step_sampling(&mut s, &[&[60]]);
    assert_eq!(names(&s, &out.req_handles), vec!["a"]);
    assert_eq!(s.request(b).unwrap().spec_token_ids, vec![50, 51, 52]);
}

#[test]
fn s2_update_draft_token_ids_skips_prefill_chunks_and_finished_requests() {
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 2);
    let long = add(&mut s, "long", 100, 20);
    step(&mut s); // a 64-token chunk
    let done = add_with(&mut s, "done", 3, 1, |r| r.eos_token_id = Some(7));
    step(&mut s); // long completes its prompt; done samples EOS and finishes
    give_drafts(&mut s, done, &[1, 2]);
    assert_eq!(s.request(done).unwrap().spec_token_ids, Vec::<u32>::new());
    let long2 = add(&mut s, "long2", 200, 20);
    step(&mut s); // long2 is a chunk now
    s.update_draft_token_ids(&[long, long2], &[0, 2, 4], &[1, 2, 3, 4])
        .unwrap();
    assert_eq!(s.request(long).unwrap().spec_token_ids, vec![1, 2]);
    assert!(s.request(long2).unwrap().spec_token_ids.is_empty());
    assert!(matches!(
        s.update_draft_token_ids(&[long], &[0, 2, 4], &[1, 2, 3, 4]),
        Err(Error::OutputMismatch(_))
    ));
}

#[test]
fn s2_a_one_token_admission_joining_decodes_is_padded_to_a_uniform_decode() {
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 2);
    let a = add(&mut s, "a", 4, 20);
    step(&mut s);
    let b = add(&mut s, "b", 1, 20);
    let (out, _) = step_sampling(&mut s, &[&[60], &[61]]);
    assert_eq!(out.num_scheduled_tokens, vec![1, 3]);
    assert_eq!(out.num_spec_tokens, vec![0, 2]);
    assert_eq!(out.spec_token_ids, vec![-1, -1]);
    // Verified with nothing accepted: the padding is rolled back.
    assert_eq!(s.progress(b).unwrap().num_computed_tokens, 1);
    assert_eq!(s.request(b).unwrap().num_tokens(), 2);
    assert_eq!(s.request(a).unwrap().num_tokens(), 6);
}

#[test]
fn s2_no_padding_without_a_decode_batch_or_beside_a_stale_prefill_chunk() {
    // Alone, and no cache hit: nothing to be uniform with.
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 2);
    add(&mut s, "lone", 1, 20);
    let (out, _) = step(&mut s);
    assert_eq!(
        (out.num_scheduled_tokens, out.num_spec_tokens),
        (vec![1], vec![0])
    );
    // Beside a request whose last schedule was a prefill chunk.
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 2);
    add(&mut s, "long", 100, 20);
    step(&mut s);
    add(&mut s, "b", 1, 20);
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("long", 36), ("b", 1)]));
    assert_eq!(out.num_spec_tokens, vec![0, 0]);
}

#[test]
fn s2_padding_that_does_not_fit_the_budget_stops_the_scan() {
    let mut s = sched_with(64, |c| {
        c.num_speculative_tokens = 3;
        c.max_num_seqs = 4;
        c.max_num_batched_tokens = 6;
    });
    let a = add(&mut s, "a", 2, 20);
    step(&mut s);
    give_drafts(&mut s, a, &[40, 41, 42]);
    add(&mut s, "b", 1, 20); // 1 + 3 padded tokens, 2 left: stop
    add(&mut s, "c", 2, 20); // would fit, but the scan stopped at b
    let (out, _) = step_sampling(&mut s, &[&[60]]);
    assert_eq!(scheduled(&s, &out), sv(&[("a", 4)]));
    assert_eq!(s.stats().gates.last_scan_stop, Some(ScanStop::TokenBudget));
}

#[test]
fn s2_padding_needs_room_below_max_model_len() {
    let padded = |max_model_len: usize| {
        let mut s = sched_with(64, |c| {
            c.num_speculative_tokens = 3;
            c.max_model_len = max_model_len;
        });
        add(&mut s, "a", 1, 2);
        step(&mut s);
        add(&mut s, "b", 1, 2);
        let (out, _) = step(&mut s);
        out.num_spec_tokens[1] > 0
    };
    assert!(padded(5), "0 computed + 1 + 3 drafts + 1 <= 5");
    assert!(!padded(4));
}

#[test]
fn s17_a_stop_inside_accepted_drafts_drops_the_rest() {
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 3);
    let a = add_with(&mut s, "a", 5, 20, |r| r.eos_token_id = Some(2));
    step(&mut s);
    give_drafts(&mut s, a, &[40, 2, 41]);
    // Two drafts accepted, the second an EOS: the bonus token is dropped.
    let (_, res) = step_sampling(&mut s, &[&[40, 2, 60]]);
    assert_eq!(res.token_ids, vec![40, 2]);
    assert_eq!(res.finish_reasons, vec![FinishReason::Stop as u8]);
}

/// `a` decodes with 3 drafts, all accepted, which complete its 2nd block
/// (4-token blocks): 5 prompt tokens + 1 output, then 4 more.
fn accepted_drafts_fill_a_block(max_tokens: usize) -> (Scheduler, Vec<u32>) {
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 3);
    let a = add(&mut s, "a", 5, max_tokens);
    step(&mut s);
    give_drafts(&mut s, a, &[40, 41, 42]);
    step_sampling(&mut s, &[&[40, 41, 42, 43]]);
    let mut tokens = prompt("a", 5);
    tokens.extend([7, 40, 41, 42, 43]);
    (s, tokens)
}

#[test]
fn s8_with_drafts_blocks_completed_by_accepted_tokens_are_cached_at_the_update() {
    // vLLM 0.33 caches them when it appends the tokens, not at the next
    // schedule: aborted right after, its second block is still a hit.
    let (mut s, tokens) = accepted_drafts_fill_a_block(20);
    s.abort_request("a");
    s.add_request(NewRequest::new("b", tokens, 5)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_cached_tokens, vec![8]);
}

#[test]
fn s8_with_drafts_a_request_finishing_on_accepted_tokens_caches_them_first() {
    // Finished by max_tokens inside the accepted drafts: its completed block
    // is hashed before it is freed, so it goes to the back of the free queue.
    let (mut s, mut tokens) = accepted_drafts_fill_a_block(4);
    tokens.truncate(9); // 1 + 3 outputs kept, the last dropped
    assert_eq!(s.num_running(), 0);
    s.add_request(NewRequest::new("b", tokens, 5)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_cached_tokens, vec![8]);
}

#[test]
fn s8_a_stop_inside_accepted_drafts_trims_the_computed_count_so_a_whole_last_block_stays_unhashed()
{
    // vLLM 0.33: the tokens dropped after the stop leave `num_computed_tokens`
    // too (`-= len(new_token_ids) - num_new`), so the cache point after the
    // drafts hashes only up to `num_tokens - 1`. Here the kept sequence is 8
    // tokens, two whole 4-token blocks: the second stays unhashed, and
    // freeing sends it to the front of the free queue with the third.
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 3);
    let a = add(&mut s, "a", 5, 3);
    step(&mut s);
    give_drafts(&mut s, a, &[40, 41, 42]);
    let out = s.schedule();
    assert_eq!(scheduled(&s, &out), sv(&[("a", 4)]));
    let a_blocks = s.blocks_of(a).to_vec();
    assert_eq!(a_blocks.len(), 3, "9 tokens computed");
    // All three drafts accepted; max_tokens stops it at 41, two tokens early.
    let mro = ModelRunnerOutput {
        sampled_offsets: vec![0, 4],
        sampled_token_ids: vec![40, 41, 42, 43],
        ..Default::default()
    };
    let res = s.update_from_output(&mro).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(res.token_ids, vec![40, 41]);
    assert_eq!(res.finish_reasons, vec![FinishReason::Length as u8]);
    // The next allocation takes the unhashed blocks from the front, last
    // first: a's third block, then its second (not a never-used one).
    let b = add(&mut s, "b", 8, 5);
    step(&mut s);
    assert_eq!(s.blocks_of(b), &[a_blocks[2], a_blocks[1]]);
    // Only a's first block is still cached: a prompt extending a's 8 tokens
    // hits 4 of them, not 8.
    let mut tokens = prompt("a", 5);
    tokens.extend([7, 40, 41, 9]);
    s.add_request(NewRequest::new("c", tokens, 5)).unwrap();
    let (out, _) = step(&mut s);
    let c = out
        .req_handles
        .iter()
        .position(|&h| id(&s, h) == "c")
        .unwrap();
    assert_eq!(out.num_cached_tokens[c], 4);
}

#[test]
fn s7_the_lora_set_counts_running_requests_this_step_did_not_schedule() {
    // Async scheduling: l1's next position would pass max_model_len until its
    // token lands, so the running phase skips it this step; its adapter is
    // still in the batch, and l2's is one too many.
    let mut s = sched_with(64, |c| {
        c.max_loras = 1;
        c.max_model_len = 16;
    });
    s.set_async_scheduling(true);
    add_with(&mut s, "l1", 14, 10, |r| r.lora_id = Some(1));
    s.schedule();
    s.schedule();
    add_with(&mut s, "l2", 4, 10, |r| r.lora_id = Some(2));
    add(&mut s, "base", 4, 10);
    let out = s.schedule();
    assert_eq!(names(&s, &out.req_handles), vec!["base"]);
    assert_eq!(names(&s, &out.skipped), vec!["l2"]);
    assert_eq!(out.skip_reasons, vec![SkipReason::LoraSlots as u8]);
}

#[test]
fn s7_skipped_requests_are_reported_in_the_step_output() {
    let mut s = sched_with(64, |c| c.max_loras = 1);
    add_with(&mut s, "l1", 4, 10, |r| r.lora_id = Some(1));
    step(&mut s);
    add_with(&mut s, "l2a", 4, 10, |r| r.lora_id = Some(2));
    add_with(&mut s, "l2b", 4, 10, |r| r.lora_id = Some(2));
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.skipped), vec!["l2a", "l2b"]);
    assert_eq!(out.skip_reasons, vec![SkipReason::LoraSlots as u8; 2]);
}

#[test]
fn s12_requests_skipped_in_an_earlier_step_do_not_count_as_capacity_bound() {
    let mut s = sched_with(64, |c| {
        c.prefill_schedule_interval = 3;
        c.max_loras = 1;
        c.max_num_batched_tokens = 16;
        c.policy = Policy::Priority;
    });
    add_with(&mut s, "l1", 4, 50, |r| r.lora_id = Some(1));
    add_with(&mut s, "l2", 4, 50, |r| r.lora_id = Some(2));
    step(&mut s); // release step: l1 admitted, l2 skipped
    assert!(!s.interval.capacity_bound, "l2 waits for its own reason");
    while s.interval.executed + 1 - s.interval.last_prefill < 3 {
        step(&mut s);
    }
    // The next release step: x, more urgent, takes the rest of the budget,
    // so the scan never reaches l2; l2 still does not count.
    add_with(&mut s, "x", 15, 4, |r| r.priority = -1);
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("l1", 1), ("x", 15)]));
    assert!(out.skipped.is_empty());
    assert!(!s.interval.capacity_bound);
}

#[test]
fn s13_has_requests_counts_only_what_the_pause_state_lets_run() {
    let mut s = sched(64);
    add(&mut s, "a", 4, 10);
    step(&mut s);
    add(&mut s, "b", 4, 10);
    s.set_pause_state(PauseState::PausedAll);
    assert!(!s.has_requests(), "PAUSED_ALL: nothing can run");
    s.set_pause_state(PauseState::PausedNew);
    assert!(s.has_requests(), "PAUSED_NEW: a runs");
    s.abort_request("a");
    assert!(s.has_requests(), "the abort is still to be reported");
    step(&mut s);
    assert!(!s.has_requests(), "b waits, but may not be admitted");
    s.set_pause_state(PauseState::Unpaused);
    assert!(s.has_requests());
}

#[test]
fn s15_a_segment_stopped_inside_accepted_drafts_goes_on_from_its_last_token() {
    let mut s = sched_with(64, |c| c.num_speculative_tokens = 3);
    let h = add_with(&mut s, "sess", 5, 20, |r| {
        r.streaming = true;
        r.eos_token_id = Some(2);
    });
    step(&mut s);
    give_drafts(&mut s, h, &[2, 41, 42]);
    step_sampling(&mut s, &[&[2, 41, 42, 43]]); // EOS accepted first: the segment ends
    assert_eq!(s.request(h).unwrap().num_tokens(), 7);
    assert_eq!(s.progress(h).unwrap().num_computed_tokens, 6);
    s.add_stream_input(
        "sess",
        StreamInput {
            token_ids: vec![5, 6],
            max_tokens: 2,
            is_last: false,
        },
    )
    .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![3]);
}

// ------------------------------------------------------- S7 engine connector

/// A scheduler with an engine-driven connector whose store holds the first
/// `external` tokens of a 13-token request `remote`.
fn engine_store(external: usize) -> (Scheduler, Handle) {
    let mut s = sched(64);
    s.use_engine_connector();
    let h = add(&mut s, "remote", 13, 4);
    s.set_external_tokens(h, external).unwrap();
    (s, h)
}

#[test]
fn s7_engine_connector_load_is_skipped_until_the_engine_reports_it() {
    let (mut s, remote) = engine_store(100);
    add(&mut s, "short", 3, 4);
    let (out, _) = step(&mut s);
    assert_eq!(names(&s, &out.req_handles), vec!["short"]);
    let loads = s.take_kv_loads().unwrap();
    assert_eq!(loads.len(), 1);
    let load = &loads[0];
    // 12 of 13 tokens, whole blocks: never the last token.
    assert_eq!((load.handle, load.first_block), (remote, 0));
    assert_eq!(load.block_ids, s.blocks_of(remote)[..3].to_vec());
    assert_eq!(
        load.block_hashes,
        s.request(remote).unwrap().block_hashes[..3].to_vec()
    );
    step(&mut s);
    step(&mut s);
    assert_eq!(
        skips(&s, SkipReason::RemoteKv),
        2,
        "skipped while not reported"
    );
    assert!(s.finish_kv_load(remote, load.load_id, 3).unwrap());
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("short", 1), ("remote", 1)]));
    assert_eq!(out.num_cached_tokens[1], 12);
    assert_eq!(skips(&s, SkipReason::RemoteKv), 2);
}

#[test]
fn s7_engine_connector_failed_load_is_recomputed() {
    let (mut s, remote) = engine_store(8);
    step(&mut s);
    let load = s.take_kv_loads().unwrap().remove(0);
    assert_eq!(load.block_ids.len(), 2);
    assert!(s.finish_kv_load(remote, load.load_id, 0).unwrap());
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("remote", 13)]));
    assert_eq!(out.num_cached_tokens[0], 0);
    assert!(
        s.take_kv_loads().unwrap().is_empty(),
        "a failed load is not retried"
    );
}

#[test]
fn s7_engine_connector_partial_load_keeps_its_loaded_prefix() {
    let (mut s, remote) = engine_store(12);
    step(&mut s);
    let load = s.take_kv_loads().unwrap().remove(0);
    assert!(s.finish_kv_load(remote, load.load_id, 1).unwrap());
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("remote", 9)]));
    // Only the loaded block is cached until the rest is computed.
    assert_eq!(
        s.kv().pool.block_hash(load.block_ids[0]),
        Some(load.block_hashes[0])
    );
}

#[test]
fn s7_engine_connector_loads_start_after_the_local_prefix_hit() {
    let mut s = sched(64);
    s.use_engine_connector();
    let first = add(&mut s, "a", 13, 1);
    step(&mut s); // caches the 3 full blocks of "a"
    step(&mut s);
    let mut p = prompt("a", 4);
    p.extend(prompt("b", 13));
    let h = s.add_request(NewRequest::new("b", p, 4)).unwrap();
    s.set_external_tokens(h, 12).unwrap();
    assert!(s.request(first).is_none_or(|r| r.is_finished()));
    step(&mut s);
    let load = s.take_kv_loads().unwrap().remove(0);
    assert_eq!(
        (load.first_block, load.block_ids.len()),
        (1, 2),
        "block 0 is a local hit"
    );
    assert!(s.finish_kv_load(h, load.load_id, 2).unwrap());
    let (out, _) = step(&mut s);
    assert_eq!(scheduled(&s, &out), sv(&[("b", 5)]));
}

#[test]
fn s7_engine_connector_report_of_an_aborted_request_is_ignored() {
    let (mut s, remote) = engine_store(12);
    step(&mut s);
    let load = s.take_kv_loads().unwrap().remove(0);
    s.abort_request("remote");
    assert!(!s.finish_kv_load(remote, load.load_id, 3).unwrap());
    assert!(!s.finish_kv_load(remote, load.load_id + 1, 3).unwrap());
}

#[test]
fn engine_connector_lists_each_newly_full_block_once_for_saving() {
    let mut s = sched(64);
    s.use_engine_connector();
    let h = add(&mut s, "a", 9, 10);
    step(&mut s); // 2 full prompt blocks
    let hashes = s.request(h).unwrap().block_hashes.clone();
    let blocks = s.blocks_of(h).to_vec();
    assert_eq!(
        s.take_cached_blocks(),
        vec![(blocks[0], hashes[0]), (blocks[1], hashes[1])]
    );
    step(&mut s); // 10 tokens
    assert_eq!(s.take_cached_blocks(), vec![]);
    step(&mut s);
    step(&mut s); // the 12th token is scheduled: block 2 is full
    let hashes = s.request(h).unwrap().block_hashes.clone();
    assert_eq!(s.take_cached_blocks(), vec![(s.blocks_of(h)[2], hashes[2])]);
}

#[test]
fn engine_connector_never_lists_adapter_blocks_for_saving() {
    let mut s = sched_with(64, |c| c.max_loras = 1);
    s.use_engine_connector();
    add_with(&mut s, "lora", 9, 4, |r| r.lora_id = Some(1));
    let base = add(&mut s, "base", 9, 4);
    step(&mut s);
    let hashes = s.request(base).unwrap().block_hashes.clone();
    let blocks = s.blocks_of(base).to_vec();
    assert_eq!(
        s.take_cached_blocks(),
        vec![(blocks[0], hashes[0]), (blocks[1], hashes[1])]
    );
}

#[test]
fn engine_connector_calls_without_one_name_it() {
    let mut s = sched(64);
    let h = add(&mut s, "a", 9, 4);
    let err = s.set_external_tokens(h, 8).unwrap_err();
    assert!(err.to_string().contains("use_engine_connector"), "{err}");
}

#[test]
fn s8_prompt_block_hashes_are_the_hashes_a_request_gets() {
    let mut s = sched(64);
    let tokens = prompt("p", 10); // two full blocks and a partial one
    let h = add_with(&mut s, "p", 10, 1, |n| {
        n.lora_id = Some(3);
        n.cache_salt = Some("tenant".into());
    });
    let want = s.request(h).unwrap().block_hashes.clone();
    assert_eq!(want.len(), 2);
    assert_eq!(
        s.prompt_block_hashes(&tokens, Some(3), Some("tenant")),
        want
    );
    assert_ne!(s.prompt_block_hashes(&tokens, None, Some("tenant")), want);
}

#[test]
fn s8_kv_events_follow_a_request_whose_blocks_are_cached_then_evicted() {
    let mut s = sched(3);
    s.record_kv_events(true);
    let a = prompt("a", 8);
    add(&mut s, "a", 8, 1);
    step(&mut s);
    let stored = s.take_kv_events().stored;
    assert_eq!(stored, s.prompt_block_hashes(&a, None, None));
    // Another prompt needs all three blocks: both of a's are evicted.
    add(&mut s, "b", 12, 1);
    step(&mut s);
    let events = s.take_kv_events();
    let mut removed = events.removed.clone();
    removed.sort_unstable();
    let mut want = stored.clone();
    want.sort_unstable();
    assert_eq!(removed, want);
}
