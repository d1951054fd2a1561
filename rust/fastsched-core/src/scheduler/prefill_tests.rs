//! Tests of S19 (`skip_reading_prefix_cache`) and S20 (prefill-only requests).

use super::*;
use crate::connector::TestConnector;
use crate::output::{EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput};

fn sched_with(f: impl FnOnce(&mut SchedulerConfig)) -> Scheduler {
    let mut cfg = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        block_size: 4,
        num_gpu_blocks: 65,
        ..Default::default()
    };
    f(&mut cfg);
    Scheduler::new(cfg).expect("valid test config")
}

/// The fake model: token 7 for every row that samples (its prefill completed
/// and it is not prefill-only).
fn step(s: &mut Scheduler) -> (SchedulerOutput, EngineCoreOutputs) {
    let out = s.schedule();
    let tokens: Vec<Option<u32>> = out
        .req_handles
        .iter()
        .map(|&h| {
            let p = &s.requests[h as usize].progress;
            (!p.is_prefill_chunk && !p.prefill_only).then_some(7)
        })
        .collect();
    let res = s
        .update_from_output(&ModelRunnerOutput::from_tokens(&tokens))
        .unwrap();
    s.check_invariants().unwrap();
    (out, res)
}

fn skipping(id: &str, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    let mut n = NewRequest::new(id, prompt, max_tokens);
    n.skip_reading_prefix_cache = true;
    n
}

#[test]
fn s19_skip_reading_prefix_cache_gets_no_hit_but_its_blocks_are_cached_for_others() {
    let mut s = sched_with(|_| {});
    let p: Vec<u32> = (10..19).collect(); // 9 tokens: two full blocks may hit
    s.add_request(NewRequest::new("a", p.clone(), 2)).unwrap();
    step(&mut s);
    s.add_request(skipping("b", p.clone(), 2)).unwrap();
    let (out, _) = step(&mut s);
    let b = s.handle_of("b").unwrap();
    let row = out.req_handles.iter().position(|&h| h == b).unwrap();
    assert_eq!(
        (out.num_cached_tokens[row], out.num_scheduled_tokens[row]),
        (0, 9)
    );
    // A later reader still hits (a's blocks, or b's duplicates of them).
    s.add_request(NewRequest::new("c", p, 2)).unwrap();
    let (out, _) = step(&mut s);
    let c = s.handle_of("c").unwrap();
    let row = out.req_handles.iter().position(|&h| h == c).unwrap();
    assert_eq!(out.num_cached_tokens[row], 8);
}

#[test]
fn s19_skip_reading_prefix_cache_takes_no_kv_connector_tokens() {
    let mut s = sched_with(|_| {});
    s.set_connector(Box::new(TestConnector::new(8, 1, 4)));
    s.add_request(skipping("a", (10..22).collect(), 2)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(
        (out.num_computed_tokens[0], out.num_scheduled_tokens[0]),
        (0, 12)
    );
    assert_eq!(s.stats().prefix_cache.queries, 0, "no lookup at all");
}

#[test]
fn s20_prefill_only_ends_length_capped_with_no_token_after_its_last_chunk() {
    let mut s = sched_with(|c| c.max_num_batched_tokens = 8);
    let h = s
        .add_request(NewRequest::new("a", (10..30).collect(), 0))
        .unwrap();
    let mut chunks = Vec::new();
    loop {
        let (out, res) = step(&mut s);
        chunks.push(out.num_scheduled_tokens[0]);
        if let Some(i) = res.handles.iter().position(|&x| x == h) {
            assert_eq!(res.finish_reasons[i], FinishReason::Length as u8);
            assert_eq!(res.token_offsets[i], res.token_offsets[i + 1], "no token");
            assert_eq!(res.num_cached_tokens[i], 0);
            break;
        }
        assert!(chunks.len() < 4, "a 20-token prompt takes 3 chunks of 8");
    }
    assert_eq!(
        chunks,
        vec![8, 8, 4],
        "all 20 prompt tokens computed, the last one too"
    );
    assert!(s.request(h).is_none() || s.request(h).unwrap().is_finished());
    assert_eq!(s.schedule().finished, vec![h]);
}

#[test]
fn s20_prefill_only_under_async_scheduling_is_scheduled_once_per_chunk() {
    let mut s = sched_with(|c| c.max_num_batched_tokens = 8);
    s.set_async_scheduling(true);
    let h = s
        .add_request(NewRequest::new("a", (10..22).collect(), 0))
        .unwrap();
    let first = s.schedule(); // 8 tokens
    assert!(s.runs_after_in_flight(), "4 prompt tokens are left");
    let second = s.schedule(); // the last 4, while the first chunk is in flight
    assert_eq!(
        (
            first.num_scheduled_tokens[0],
            second.num_scheduled_tokens[0]
        ),
        (8, 4)
    );
    assert!(!s.runs_after_in_flight(), "nothing is left to schedule");
    assert!(s.schedule().req_handles.is_empty(), "no third step for it");
    let none = ModelRunnerOutput::from_tokens(&[None]);
    assert!(s.update_from_output(&none).unwrap().handles.is_empty());
    let res = s.update_from_output(&none).unwrap();
    assert_eq!(res.handles, vec![h]);
    assert_eq!(res.finish_reasons, vec![FinishReason::Length as u8]);
    // The empty third step is in flight too.
    s.update_from_output(&ModelRunnerOutput::from_tokens(&[]))
        .unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn s20_prefill_only_is_refused_for_a_streaming_session() {
    let mut s = sched_with(|_| {});
    let mut n = NewRequest::new("a", vec![1, 2, 3], 0);
    n.streaming = true;
    let err = s.add_request(n).unwrap_err().to_string();
    assert!(err.contains("max_tokens (0)"), "{err}");
}
