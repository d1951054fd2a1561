//! S16: the consistency checks run by tests and the property test.

use std::collections::HashMap;

use super::Scheduler;
use crate::request::{Handle, RequestStatus};

impl Scheduler {
    /// S16: every live request is in exactly one place, and the block pool's
    /// accounting holds (free + referenced = pool, held blocks referenced).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.kv.check_invariants()?;
        let mut place: HashMap<Handle, &'static str> = HashMap::new();
        let mut put = |h: Handle, where_: &'static str| match place.insert(h, where_) {
            Some(prev) => Err(format!("request handle {h} is both in {prev} and {where_}")),
            None => Ok(()),
        };
        for &h in &self.running {
            put(h, "running")?;
        }
        for h in self.waiting.ordered() {
            put(h, "waiting")?;
        }
        for h in self.kv_holding.ordered() {
            put(h, "kv_holding")?;
        }
        let mut streaming = 0;
        let mut deferred = 0;
        for r in self.live_requests() {
            if r.deferred {
                deferred += 1;
                if !matches!(place.get(&r.handle), Some(&"waiting") | Some(&"kv_holding")) {
                    return Err(format!(
                        "deferred request {:?} is not waiting",
                        r.request_id
                    ));
                }
            }
            let expected = match r.status {
                RequestStatus::Running => "running",
                RequestStatus::Waiting
                | RequestStatus::Preempted
                | RequestStatus::WaitingForRemoteKvs => {
                    if place.get(&r.handle) == Some(&"kv_holding") {
                        "kv_holding"
                    } else {
                        "waiting"
                    }
                }
                RequestStatus::WaitingForStreamingReq => {
                    streaming += 1;
                    "streaming"
                }
                _ => unreachable!("live requests are not finished"),
            };
            let num_tokens = self.requests[r.handle as usize].progress.num_tokens;
            if num_tokens != r.num_tokens() {
                return Err(format!(
                    "request {:?} has {} tokens but its progress says {num_tokens}",
                    r.request_id,
                    r.num_tokens()
                ));
            }
            let actual = place.get(&r.handle).copied().unwrap_or("streaming");
            if actual != expected {
                return Err(format!(
                    "request {:?} has status {} but sits in {actual}",
                    r.request_id,
                    r.status.as_str()
                ));
            }
            if r.status != RequestStatus::Running
                && r.status != RequestStatus::WaitingForStreamingReq
                && !self.kv.blocks(r.handle).is_empty()
                && actual != "kv_holding"
            {
                return Err(format!("waiting request {:?} holds blocks", r.request_id));
            }
            for &b in self.kv.blocks(r.handle) {
                if self.kv.pool.ref_cnt(b) == 0 {
                    return Err(format!(
                        "request {:?} holds unreferenced block {b}",
                        r.request_id
                    ));
                }
            }
        }
        if place.len() + streaming != self.live_requests().count() {
            return Err("a queued handle is not a live request".into());
        }
        if streaming != self.num_waiting_for_streaming_input {
            return Err(format!(
                "{streaming} sessions wait for input but the counter says {}",
                self.num_waiting_for_streaming_input
            ));
        }
        if deferred != self.num_deferred_waiting {
            return Err(format!(
                "{deferred} requests are deferred but the counter says {}",
                self.num_deferred_waiting
            ));
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running requests exceed max_num_seqs ({})",
                self.running.len(),
                self.cfg.max_num_seqs
            ));
        }
        Ok(())
    }
}
