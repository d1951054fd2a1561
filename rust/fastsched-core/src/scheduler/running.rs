//! The running phase of a step (S2/S3): extends running requests,
//! preempting (S4) on KV shortage.

use super::step::advance;
use super::{Scheduled, Scheduler};
use crate::config::Policy;
use crate::kv::manager::AllocRequest;
use crate::output::{ScheduledKind, SchedulerOutput};
use crate::queue::QueueEntry;
use crate::request::{Handle, RequestStatus};

impl Scheduler {
    /// S2/S3: extends the running requests in order, preempting (S4) on KV
    /// shortage; spends `token_budget` and `input_budget`.
    pub(super) fn schedule_running(
        &mut self,
        out: &mut SchedulerOutput,
        scheduled: &mut Vec<Scheduled>,
        token_budget: &mut usize,
        input_budget: &mut usize,
        threshold: usize,
        defer: bool,
    ) {
        let lookahead = self.cfg.num_speculative_tokens;
        let async_scheduling = self.async_scheduling;
        let mut i = 0;
        'running: while i < self.running.len() && *token_budget > 0 {
            let h = self.running[i];
            let req = self.req(h);
            if defer && req.is_prefill_chunk {
                i += 1;
                continue;
            }
            // S1: drafts use compute budget (token_budget) but no input budget.
            let real = req.num_tokens() + req.num_output_placeholders - req.num_computed_tokens;
            let mut n = real + req.spec_token_ids.len();
            if threshold > 0 && n > threshold {
                n = threshold;
            }
            n = n
                .min(*token_budget)
                .min((self.cfg.max_model_len - 1).saturating_sub(req.num_computed_tokens));
            if n.min(real) > *input_budget {
                n = *input_budget;
            }
            if n == 0 {
                i += 1;
                continue;
            }
            // A running request's row sends only its new blocks, which
            // `allocate_slots` appends to the step's block ids.
            let blocks_before = loop {
                let alloc = AllocRequest {
                    num_new_tokens: n,
                    num_lookahead_tokens: lookahead,
                    delay_cache: true,
                    ..Default::default()
                };
                let req = self.requests[h as usize].as_ref().expect("live handle");
                let blocks_before = out.block_ids.len();
                if self
                    .kv
                    .allocate_slots(req, alloc, None, &mut out.block_ids)
                    .is_some()
                {
                    break blocks_before;
                }
                // S3: preempt a victim and retry.
                let victim = match self.cfg.policy {
                    Policy::Fcfs => self
                        .running
                        .pop()
                        .expect("running holds the request itself"),
                    Policy::Priority => {
                        let pos = self.priority_victim_position();
                        let victim = self.running.remove(pos);
                        if let Some(j) = scheduled.iter().position(|s| s.handle == victim) {
                            let s = self.unschedule(scheduled, j, &mut out.block_ids);
                            *token_budget += s.num_tokens as usize;
                            *input_budget += (s.num_tokens - s.num_spec) as usize;
                            i -= 1;
                        }
                        victim
                    }
                };
                // Freeing blocks must not overtake the caching of earlier rows'.
                self.cache_pending_blocks();
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == h {
                    match self.cfg.policy {
                        Policy::Fcfs => break 'running,
                        Policy::Priority => continue 'running,
                    }
                }
            };
            // Preempting others left this request as it was: `real` still holds.
            let num_spec = n.saturating_sub(real);
            let req = self.requests[h as usize]
                .as_deref_mut()
                .expect("live handle");
            // S8 caching at schedule time (Difference 3), batched: see
            // `cache_pending_blocks`.
            let cache_upto = (req.num_computed_tokens + n).min(req.num_tokens());
            if self.kv.has_blocks_to_cache(h, cache_upto) {
                self.pending_caching.push((h, cache_upto));
            }
            let row = Scheduled {
                handle: h,
                num_tokens: n as u32,
                num_computed_before: req.num_computed_tokens as u32,
                num_cached_tokens: 0,
                num_spec: num_spec as u32,
                num_blocks: (out.block_ids.len() - blocks_before) as u32,
                kind: ScheduledKind::Cached,
                carries_prefill: req.is_prefill_chunk,
                samples: false,
            };
            scheduled.push(advance(req, row, async_scheduling));
            *token_budget -= n;
            *input_budget -= n - num_spec;
            i += 1;
        }
    }

    /// Caches the newly full blocks of this step's running rows, in row
    /// order, as `allocate_slots` would have done row by row. Done as one
    /// batch so that the cache misses of all those blocks (their records,
    /// index slots and token copies are cold) overlap instead of being paid
    /// one row at a time. Nothing between a row's allocation and this call
    /// reads or frees those blocks: they are held, lookups happen in the
    /// waiting phase, and a preemption calls this first.
    pub(super) fn cache_pending_blocks(&mut self) {
        if self.pending_caching.is_empty() {
            return;
        }
        let requests = &self.requests;
        let req = |h: Handle| requests[h as usize].as_deref().expect("live handle");
        self.kv
            .warm_for_caching(self.pending_caching.iter().map(|&(h, upto)| (req(h), upto)));
        for &(h, upto) in &self.pending_caching {
            self.kv.cache_blocks(req(h), upto);
        }
        self.pending_caching.clear();
    }

    /// Takes back row `j` of the step being built (a priority victim that
    /// was already scheduled): undoes `advance` and drops its block ids.
    /// Rare, so the O(n) removals are fine.
    pub(super) fn unschedule(
        &mut self,
        scheduled: &mut Vec<Scheduled>,
        j: usize,
        block_ids: &mut Vec<u32>,
    ) -> Scheduled {
        let s = scheduled.remove(j);
        debug_assert_eq!(
            s.kind,
            ScheduledKind::Cached,
            "only running rows are taken back"
        );
        let start: usize = scheduled[..j].iter().map(|r| r.num_blocks as usize).sum();
        block_ids.drain(start..start + s.num_blocks as usize);
        let async_scheduling = self.async_scheduling;
        let req = self.req_mut(s.handle);
        req.num_computed_tokens = s.num_computed_before as usize;
        // A running row's `carries_prefill` is the flag as it was before.
        req.is_prefill_chunk = s.carries_prefill;
        if async_scheduling && s.samples {
            req.num_output_placeholders -= 1;
        }
        s
    }

    /// FCFS takes the last running request; priority the max of
    /// `(priority, arrival_time)` over the whole running list (first on ties).
    pub(super) fn priority_victim_position(&self) -> usize {
        let mut best = 0;
        for (pos, &h) in self.running.iter().enumerate().skip(1) {
            let (r, b) = (self.req(h), self.req(self.running[best]));
            let greater = r.priority > b.priority
                || (r.priority == b.priority && r.arrival_time.total_cmp(&b.arrival_time).is_gt());
            if greater {
                best = pos;
            }
        }
        best
    }

    /// S4: recompute preemption.
    pub(super) fn preempt(&mut self, h: Handle) {
        self.kv.free(h);
        let req = self.req_mut(h);
        debug_assert_eq!(req.status, RequestStatus::Running);
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.spec_token_ids.clear();
        req.num_preemptions += 1;
        let entry = QueueEntry::of(req);
        self.waiting.prepend(entry);
        self.num_preemptions_total += 1;
    }
}
