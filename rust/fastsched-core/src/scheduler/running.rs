//! The running phase of a step (S2/S3): extends running requests,
//! preempting (S4) on KV shortage.

use super::step::advance;
use super::{warm_range, Scheduled, Scheduler, Slot, StepBudget};
use crate::config::Policy;
use crate::kv::manager::AllocRequest;
use crate::output::{ScheduledKind, SchedulerOutput};
use crate::queue::QueueEntry;
use crate::request::{Handle, RequestStatus};

/// What the rows `grow_or_preempt` took back (priority victims already
/// scheduled) return to the budgets.
#[derive(Debug, Default)]
struct TakenBack {
    tokens: usize,
    input_tokens: usize,
}

impl Scheduler {
    /// S2/S3: extends the running requests in order, preempting (S4) on KV
    /// shortage; spends the step's budget. A request that needs no new block
    /// (most, most steps) is decided from its `Progress` and its KV block
    /// counts: the request itself is not read.
    pub(super) fn schedule_running(
        &mut self,
        out: &mut SchedulerOutput,
        scheduled: &mut Vec<Scheduled>,
        budget: &mut StepBudget,
    ) {
        let spec_decoding = self.cfg.num_speculative_tokens > 0;
        let lookahead = self.cfg.num_lookahead_tokens;
        let async_scheduling = self.async_scheduling;
        let max_computed = self.cfg.max_model_len - 1;
        let StepBudget {
            threshold, defer, ..
        } = *budget;
        // Locals rather than the budget's fields: the loop keeps them in
        // registers (the out-of-line slow path reports what it changed).
        let (mut tokens_left, mut inputs_left) = (budget.tokens, budget.inputs);
        let mut running_prefill = budget.running_prefill;
        let mut i = 0;
        'running: while i < self.running.len() && tokens_left > 0 {
            if let Some(ahead) = warm_range(i, self.running.len()) {
                let handles = &self.running[ahead];
                warm_progress(&self.requests, handles);
                self.kv.warm_block_counts(handles);
            }
            let h = self.running[i];
            let p = self.requests[h as usize].progress;
            if defer && p.is_prefill_chunk {
                i += 1;
                continue;
            }
            // S1: drafts use compute budget (token_budget) but no input budget.
            let real = p.num_tokens + p.num_output_placeholders as usize - p.num_computed_tokens;
            // Only speculative decoding proposes drafts.
            let num_drafts = if spec_decoding {
                self.req(h).spec_token_ids.len()
            } else {
                0
            };
            let mut n = real + num_drafts;
            if threshold > 0 && n > threshold {
                n = threshold;
            }
            n = n
                .min(tokens_left)
                .min(max_computed.saturating_sub(p.num_computed_tokens));
            if n.min(real) > inputs_left {
                n = inputs_left;
            }
            if n == 0 {
                i += 1;
                continue;
            }
            // A running request's row sends only its new blocks, which
            // `allocate_slots` appends to the step's block ids.
            let alloc = AllocRequest {
                num_computed_tokens: p.num_computed_tokens,
                num_new_tokens: n,
                num_lookahead_tokens: lookahead,
                delay_cache: true,
                ..Default::default()
            };
            let blocks_before = if self.kv.fits_in_held_blocks(h, &alloc, p.num_tokens) {
                out.block_ids.len()
            } else {
                let (grown, back) = self.grow_or_preempt(h, alloc, out, scheduled, &mut i);
                tokens_left += back.tokens;
                inputs_left += back.input_tokens;
                match grown {
                    Some(blocks_before) => blocks_before,
                    None => match self.cfg.policy {
                        Policy::Fcfs => break 'running,
                        Policy::Priority => continue 'running,
                    },
                }
            };
            // Preempting others left this request as it was: `p` and `real`
            // still hold.
            let num_spec = n.saturating_sub(real);
            // S8 caching at schedule time (Difference 3), batched: see
            // `cache_pending_blocks`.
            let cache_upto = (p.num_computed_tokens + n).min(p.num_tokens);
            if self.kv.has_blocks_to_cache(h, cache_upto) {
                self.bufs.pending_caching.push((h, cache_upto));
            }
            let row = Scheduled {
                handle: h,
                num_tokens: n as u32,
                num_computed_before: p.num_computed_tokens as u32,
                num_cached_tokens: 0,
                num_spec: num_spec as u32,
                num_blocks: (out.block_ids.len() - blocks_before) as u32,
                kind: ScheduledKind::Cached,
                carries_prefill: p.is_prefill_chunk,
                samples: false,
            };
            running_prefill |= p.is_prefill_chunk;
            let p = &mut self.requests[h as usize].progress;
            scheduled.push(advance(p, row, async_scheduling));
            tokens_left -= n;
            inputs_left -= n - num_spec;
            i += 1;
        }
        (budget.tokens, budget.inputs) = (tokens_left, inputs_left);
        budget.running_prefill = running_prefill;
    }

    /// S3: allocates what running request `h` (at `running[*i]`) needs
    /// beyond the blocks it holds, preempting victims until it fits. Returns
    /// where its new block ids start in `out.block_ids`, or `None` when `h`
    /// itself was preempted, and what the rows it took back return: a
    /// priority victim already scheduled gives its row's tokens back to the
    /// budgets. Every priority victim ahead of `h` in `running`, scheduled
    /// or passed over (a prefill chunk S12 holds), moves the scan position
    /// `*i` back one, as vLLM 0.33's `if victim_index < req_index`. Out of
    /// line: few requests per step need it, and the running loop stays small
    /// without it.
    #[inline(never)]
    fn grow_or_preempt(
        &mut self,
        h: Handle,
        alloc: AllocRequest,
        out: &mut SchedulerOutput,
        scheduled: &mut Vec<Scheduled>,
        i: &mut usize,
    ) -> (Option<usize>, TakenBack) {
        let mut back = TakenBack::default();
        loop {
            let req = self.requests[h as usize].req.as_ref().expect("live handle");
            let blocks_before = out.block_ids.len();
            if self
                .kv
                .allocate_slots(req, alloc, None, &mut out.block_ids)
                .is_some()
            {
                return (Some(blocks_before), back);
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
                    if pos < *i {
                        *i -= 1;
                    }
                    if let Some(j) = scheduled.iter().position(|s| s.handle == victim) {
                        let s = self.unschedule(scheduled, j, &mut out.block_ids);
                        back.tokens += s.num_tokens as usize;
                        back.input_tokens += (s.num_tokens - s.num_spec) as usize;
                    }
                    victim
                }
            };
            // Freeing blocks must not overtake the caching of earlier rows'.
            self.cache_pending_blocks();
            self.preempt(victim);
            out.preempted.push(victim);
            if victim == h {
                return (None, back);
            }
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
        if self.bufs.pending_caching.is_empty() {
            return;
        }
        let requests = &self.requests;
        let req = |h: Handle| requests[h as usize].req.as_deref().expect("live handle");
        self.kv.warm_for_caching(
            self.bufs
                .pending_caching
                .iter()
                .map(|&(h, upto)| (req(h), upto)),
        );
        for &(h, upto) in &self.bufs.pending_caching {
            self.kv.cache_blocks(req(h), upto);
        }
        self.bufs.pending_caching.clear();
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
        let p = &mut self.requests[s.handle as usize].progress;
        p.num_computed_tokens = s.num_computed_before as usize;
        // A running row's `carries_prefill` is the flag as it was before.
        p.is_prefill_chunk = s.carries_prefill;
        if self.async_scheduling && s.samples {
            p.num_output_placeholders -= 1;
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
        self.requests[h as usize].progress.num_computed_tokens = 0;
        let req = self.req_mut(h);
        debug_assert_eq!(req.status, RequestStatus::Running);
        req.status = RequestStatus::Preempted;
        req.spec_token_ids.clear();
        req.num_preemptions += 1;
        let entry = QueueEntry::of(req);
        self.waiting.prepend(entry);
        self.num_preemptions_total += 1;
    }
}

/// Reads the slab entries of `handles` in a loop short enough for their cache
/// misses to overlap (the entries of a batch of running requests are spread
/// over the slab, and the model's work evicts them between steps); the
/// running loop then finds them in cache. Only a performance hint.
fn warm_progress(requests: &[Slot], handles: &[Handle]) {
    let mut sink = 0usize;
    for &h in handles {
        sink ^= requests[h as usize].progress.num_tokens;
    }
    std::hint::black_box(sink);
}
