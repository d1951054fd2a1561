//! The waiting phase of a step (S6/S7/S10/S11): admits waiting requests,
//! one head of queue at a time (`admit_head`), until a gate stops the scan.

use super::step::advance;
use super::{PauseState, Scheduled, Scheduler, StepBudget, WhichQueue};
use crate::connector::KvLoad;
use crate::kv::manager::AllocRequest;
use crate::kv::CacheHit;
use crate::output::{ScheduledKind, SchedulerOutput};
use crate::queue::{QueueEntry, RequestQueue};
use crate::request::{FinishReason, Handle, RequestStatus};
use crate::telemetry::{ScanStop, SkipReason};

/// How the head of the waiting queues left `admit_head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admission {
    /// Not admitted, and the scan goes on with the next head: skipped for a
    /// reason of its own (S7), its remote load started, it ended (outgrew the
    /// pool, S16), or room was made for another try (KV given back by a
    /// waiting request, a priority preemption).
    Skip,
    /// The scan stops at this gate.
    Stop(ScanStop),
    /// Admitted into `running` (S11).
    Admitted,
}

/// What one waiting scan keeps from head to head.
struct WaitingScan {
    /// S7: the adapters in the batch (sorted).
    lora_set: Vec<u32>,
    /// S7: requests taken out of their queue until the scan ends.
    deferred: Vec<(WhichQueue, QueueEntry)>,
    max_active: usize,
    /// S10: blocks the watermark keeps free once a row is scheduled.
    watermark_blocks: usize,
}

/// The KV a head finds at admission (S8): its prefix-cache hit, and what a
/// connector offers past it.
struct FoundKv {
    hit: CacheHit,
    num_external: usize,
    load_async: bool,
}

/// How much of the head this step computes.
#[derive(Debug, Clone, Copy)]
struct Sizing {
    /// Tokens that count as computed at admission (before, hit, remote).
    num_computed: usize,
    /// Tokens scheduled, padding included.
    n: usize,
    /// S2: `-1` drafts padding a one-token admission.
    num_pad: usize,
    /// S12: more than the last token is left to compute.
    is_prefill_work: bool,
}

impl Scheduler {
    /// S6/S7/S10/S11: admits waiting requests; returns the gate that
    /// stopped the scan.
    pub(super) fn schedule_waiting(
        &mut self,
        out: &mut SchedulerOutput,
        rows: &mut Vec<Scheduled>,
        budget: &mut StepBudget,
    ) -> ScanStop {
        let mut scan = self.begin_waiting_scan();
        let stop = loop {
            match self.admit_head(&mut scan, out, rows, budget) {
                Admission::Skip | Admission::Admitted => {}
                Admission::Stop(gate) => break gate,
            }
        };
        self.end_waiting_scan(scan, budget.defer);
        stop
    }

    fn begin_waiting_scan(&mut self) -> WaitingScan {
        let mut lora_set = std::mem::take(&mut self.bufs.lora_set);
        lora_set.clear();
        if self.cfg.max_loras > 0 {
            // S7: the adapters of every running request, scheduled in this
            // step or not (as vLLM 0.33).
            lora_set.extend(self.running.iter().filter_map(|&h| self.req(h).lora_id));
            lora_set.sort_unstable();
            lora_set.dedup();
        }
        let mut deferred = std::mem::take(&mut self.bufs.deferred);
        deferred.clear();
        WaitingScan {
            lora_set,
            deferred,
            max_active: self.cfg.max_num_active_seqs(),
            watermark_blocks: (self.cfg.watermark * self.kv.pool.num_usable_blocks() as f64)
                as usize,
        }
    }

    /// Puts the skipped requests back (S7) and does S12's capacity escape.
    fn end_waiting_scan(&mut self, mut scan: WaitingScan, defer: bool) {
        // S7: skipped requests go back to the head of their queue in order.
        let (kv_back, wait_back): (Vec<_>, Vec<_>) = scan
            .deferred
            .drain(..)
            .partition(|(q, _)| *q == WhichQueue::KvHolding);
        self.kv_holding
            .prepend_all(kv_back.into_iter().map(|(_, e)| e).collect());
        self.waiting
            .prepend_all(wait_back.into_iter().map(|(_, e)| e).collect());
        self.bufs.lora_set = scan.lora_set;
        self.bufs.deferred = scan.deferred;
        // S12 capacity escape: a release step that leaves requests waiting
        // (beyond those skipped for their own reasons, in this step or an
        // earlier one) turns throttling off.
        if !defer && self.cfg.prefill_schedule_interval > 1 {
            self.interval.capacity_bound = self.num_waiting() > self.num_deferred_waiting;
        }
    }

    /// One pass of the scan: the step's gates, then the head of the queue
    /// to serve (S6): its own reasons to wait (S7), its KV (S8, S10), and its
    /// admission (S11). The queues are looked at before the budgets (neither
    /// has side effects) so that an empty queue reads as `NoWaiting`.
    fn admit_head(
        &mut self,
        scan: &mut WaitingScan,
        out: &mut SchedulerOutput,
        rows: &mut Vec<Scheduled>,
        budget: &mut StepBudget,
    ) -> Admission {
        let which = match self.queue_to_serve() {
            Ok(which) => which,
            Err(gate) => return Admission::Stop(gate),
        };
        if let Some(gate) = self.budget_gate(budget) {
            return Admission::Stop(gate);
        }
        if self.running.len() + self.num_waiting_for_streaming_input >= scan.max_active {
            if self.preempt_for_priority(which, out, rows, budget) {
                return Admission::Skip;
            }
            return Admission::Stop(ScanStop::ActiveSeqs);
        }
        let h = self.queue(which).peek().expect("non-empty queue");
        if let Some(reason) = self.reason_to_skip(h, &scan.lora_set) {
            self.defer_head(which, h, reason, &mut scan.deferred);
            return Admission::Skip;
        }
        // S16: a preempted request whose sequence outgrew the whole pool
        // can never run again; it ends as length-capped instead of waiting forever.
        if self.kv_blocks_needed(self.req(h).num_tokens()) > self.kv.pool.num_usable_blocks() {
            self.queue_mut(which).pop();
            self.finish(h, RequestStatus::FinishedLengthCapped);
            self.pending_finished.push((h, FinishReason::Length));
            return Admission::Skip;
        }
        let found = self.find_computed_kv(h);
        let size = match self.size_admission(h, &found, rows, budget) {
            Ok(size) => size,
            Err(gate) => return Admission::Stop(gate),
        };
        if !self.allocate_admission(h, &found, size, scan, rows) {
            // S16: KV-holding requests that all wait for more blocks while
            // nothing runs would wait forever: the latest of them gives its
            // KV back (recompute later) so the head can go.
            if which == WhichQueue::KvHolding && self.running.is_empty() && rows.is_empty() {
                let latest = self
                    .kv_holding
                    .ordered()
                    .into_iter()
                    .rev()
                    .find(|&v| v != h);
                if let Some(victim) = latest {
                    self.release_waiting_kv(victim);
                    return Admission::Skip;
                }
            }
            return Admission::Stop(ScanStop::KvBlocks); // S10: no skipping past it.
        }
        self.queue_mut(which).pop();
        if found.load_async {
            self.start_remote_load(h, &found, size.num_computed, &mut scan.deferred);
            return Admission::Skip;
        }
        self.admit(h, size, scan, out, rows, budget);
        Admission::Admitted
    }

    /// S6/S13: the KV-holding queue first, then (only when unpaused) the
    /// waiting queue; or why there is nothing to take.
    fn queue_to_serve(&self) -> Result<WhichQueue, ScanStop> {
        if !self.kv_holding.is_empty() {
            Ok(WhichQueue::KvHolding)
        } else if self.waiting.is_empty() {
            Err(ScanStop::NoWaiting)
        } else if self.pause == PauseState::Unpaused {
            Ok(WhichQueue::Waiting)
        } else {
            Err(ScanStop::Paused)
        }
    }

    /// S1: the budgets that stop the scan (Difference 9: the draft slots).
    fn budget_gate(&self, budget: &StepBudget) -> Option<ScanStop> {
        if budget.tokens == 0 {
            return Some(ScanStop::TokenBudget);
        }
        if budget.inputs <= self.cfg.num_lookahead_tokens {
            // An exhausted input budget is a budget stop, not a draft one.
            return Some(if budget.inputs == 0 {
                ScanStop::TokenBudget
            } else {
                ScanStop::DraftSlots
            });
        }
        None
    }

    fn queue(&self, which: WhichQueue) -> &dyn RequestQueue {
        match which {
            WhichQueue::KvHolding => &*self.kv_holding,
            WhichQueue::Waiting => &*self.waiting,
        }
    }

    fn queue_mut(&mut self, which: WhichQueue) -> &mut dyn RequestQueue {
        match which {
            WhichQueue::KvHolding => &mut *self.kv_holding,
            WhichQueue::Waiting => &mut *self.waiting,
        }
    }

    /// S7: why the head cannot run in this step for a reason of its own, if
    /// it cannot. A remote load found done is taken in on the way.
    fn reason_to_skip(&mut self, h: Handle, lora_set: &[u32]) -> Option<SkipReason> {
        if self.req(h).status == RequestStatus::WaitingForRemoteKvs {
            if !self.connector.as_ref().is_some_and(|c| c.is_load_done(h)) {
                return Some(SkipReason::RemoteKv);
            }
            self.finish_remote_load(h);
        }
        if self.requests[h as usize].progress.num_output_placeholders > 0 {
            return Some(SkipReason::StaleOutput);
        }
        let lora = self.req(h).lora_id?;
        let full = lora_set.len() >= self.cfg.max_loras && lora_set.binary_search(&lora).is_err();
        full.then_some(SkipReason::LoraSlots)
    }

    /// S8: prefix-cache (and connector) hits, for a request holding no KV.
    fn find_computed_kv(&mut self, h: Handle) -> FoundKv {
        let mut found = FoundKv {
            hit: CacheHit::default(),
            num_external: 0,
            load_async: false,
        };
        if self.requests[h as usize].progress.num_computed_tokens > 0 {
            return found;
        }
        let req = self.requests[h as usize].req.as_ref().expect("live handle");
        if req.skip_reading_prefix_cache {
            return found; // S19: every position is computed
        }
        found.hit = self.kv.get_computed_blocks(req);
        if let Some(c) = self.connector.as_mut() {
            let (num_external, load_async) =
                c.get_num_new_matched_tokens(req, found.hit.num_tokens);
            // The last token is always computed, whatever the connector offers.
            found.num_external = num_external.min(req.num_tokens() - 1 - found.hit.num_tokens);
            found.load_async = load_async && found.num_external > 0;
        }
        found
    }

    /// How much of the head to compute in this step (S9 cap, budgets, S2
    /// padding), or the gate that stops the scan (S12, no chunking, a padded
    /// admission that does not fit).
    fn size_admission(
        &self,
        h: Handle,
        found: &FoundKv,
        rows: &[Scheduled],
        budget: &StepBudget,
    ) -> Result<Sizing, ScanStop> {
        let num_tokens = self.req(h).num_tokens();
        let num_computed = self.requests[h as usize].progress.num_computed_tokens
            + found.hit.num_tokens
            + found.num_external;
        let is_prefill_work = num_computed + 1 < num_tokens;
        if budget.defer && is_prefill_work {
            return Err(ScanStop::PrefillInterval);
        }
        let mut size = Sizing {
            num_computed,
            n: num_tokens - num_computed,
            num_pad: 0,
            is_prefill_work,
        };
        if found.load_async {
            // Reserve the whole prompt now: a request that holds only the
            // loaded blocks could wait forever for the rest while others
            // holding KV wait for it.
            size.n = num_tokens - found.hit.num_tokens - found.num_external;
            return Ok(size);
        }
        if budget.threshold > 0 && size.n > budget.threshold {
            size.n = budget.threshold;
        }
        let cap = budget
            .tokens
            .min(budget.inputs - self.cfg.num_lookahead_tokens);
        if !self.cfg.enable_chunked_prefill && size.n > cap {
            return Err(ScanStop::TokenBudget);
        }
        size.n = size.n.min(cap);
        let k = self.cfg.num_speculative_tokens;
        let one_left = num_computed + 1 == num_tokens;
        if one_left
            && k > 0
            && self.pads_to_uniform_decode(rows, budget.running_prefill, num_computed)
        {
            // S2 spec decode: one token left, padded with `k` drafts of -1 so
            // the batch stays a uniform decode; rather no admission than an
            // unpadded one (vLLM 0.33).
            if 1 + k > budget.tokens {
                return Err(ScanStop::TokenBudget);
            }
            size.num_pad = k;
            size.n += k;
        }
        Ok(size)
    }

    /// S10: allocates the head's slots, or changes nothing and says no.
    fn allocate_admission(
        &mut self,
        h: Handle,
        found: &FoundKv,
        size: Sizing,
        scan: &WaitingScan,
        rows: &[Scheduled],
    ) -> bool {
        let alloc = AllocRequest {
            num_computed_tokens: self.requests[h as usize].progress.num_computed_tokens,
            num_new_tokens: size.n + found.num_external,
            num_lookahead_tokens: self.cfg.num_lookahead_tokens,
            full_sequence_must_fit: self.cfg.scheduler_reserve_full_isl,
            reserve_blocks: if rows.is_empty() {
                0
            } else {
                scan.watermark_blocks
            },
            delay_cache: found.load_async,
        };
        let req = self.requests[h as usize]
            .req
            .as_deref()
            .expect("live handle");
        self.bufs.block_scratch.clear();
        self.kv
            .allocate_slots(req, alloc, Some(&found.hit), &mut self.bufs.block_scratch)
            .is_some()
    }

    /// A head whose KV loads asynchronously holds its blocks in the
    /// KV-holding queue until the load is done (Difference 5).
    fn start_remote_load(
        &mut self,
        h: Handle,
        found: &FoundKv,
        num_computed: usize,
        deferred: &mut Vec<(WhichQueue, QueueEntry)>,
    ) {
        let first_block = found.hit.blocks.len();
        let blocks = first_block..first_block + found.num_external / self.cfg.block_size;
        let load = KvLoad {
            load_id: self.next_load_id,
            handle: h,
            first_block,
            block_ids: self.kv.blocks(h)[blocks.clone()].to_vec(),
            block_hashes: self.req(h).block_hashes[blocks].to_vec(),
        };
        self.next_load_id += 1;
        let req = self.req_mut(h);
        req.status = RequestStatus::WaitingForRemoteKvs;
        req.num_loaded_tokens = num_computed;
        deferred.push((WhichQueue::KvHolding, QueueEntry::of(req)));
        if let Some(c) = self.connector.as_mut() {
            c.start_load(load);
        }
    }

    /// S11: the head (already popped) joins `running`. New and resumed rows
    /// send the whole block table.
    fn admit(
        &mut self,
        h: Handle,
        size: Sizing,
        scan: &mut WaitingScan,
        out: &mut SchedulerOutput,
        rows: &mut Vec<Scheduled>,
        budget: &mut StepBudget,
    ) {
        self.running.push(h);
        let blocks = self.kv.blocks(h);
        out.block_ids.extend_from_slice(blocks);
        let num_blocks = blocks.len() as u32;
        let async_scheduling = self.async_scheduling;
        let req = self.req_mut(h);
        let kind = match req.status {
            RequestStatus::Preempted => ScheduledKind::Resumed,
            _ if req.first_scheduled => ScheduledKind::Resumed,
            _ => ScheduledKind::New,
        };
        req.status = RequestStatus::Running;
        req.first_scheduled = true;
        let was_deferred = std::mem::take(&mut req.deferred);
        if req.num_cached_tokens.is_none() {
            req.num_cached_tokens = Some(size.num_computed);
        }
        if let Some(lora) = req.lora_id {
            if let Err(pos) = scan.lora_set.binary_search(&lora) {
                scan.lora_set.insert(pos, lora);
            }
        }
        if was_deferred {
            self.num_deferred_waiting -= 1;
        }
        let row = Scheduled {
            handle: h,
            num_tokens: size.n as u32,
            num_computed_before: size.num_computed as u32,
            num_cached_tokens: size.num_computed as u32,
            num_spec: size.num_pad as u32,
            num_blocks,
            kind,
            carries_prefill: size.is_prefill_work,
            samples: false,
        };
        let p = &mut self.requests[h as usize].progress;
        p.num_computed_tokens = size.num_computed;
        rows.push(advance(p, row, async_scheduling));
        // S1: padding, like drafts, uses no input budget.
        budget.spend(size.n, size.num_pad);
    }

    /// Priority preemption (opt-in): when the active set is full, the head
    /// of `which` displaces the S3 priority victim if the head is strictly
    /// more urgent and the victim is below `max_preemptions_per_request`. A
    /// victim already scheduled in the running phase gives its row back, as
    /// in S3. A head that S7 would skip anyway displaces nobody.
    fn preempt_for_priority(
        &mut self,
        which: WhichQueue,
        out: &mut SchedulerOutput,
        scheduled: &mut Vec<Scheduled>,
        budget: &mut StepBudget,
    ) -> bool {
        if !self.cfg.priority_preemption || self.running.is_empty() {
            return false;
        }
        let head = self.queue(which).peek().expect("non-empty queue");
        let pos = self.priority_victim_position();
        let victim = self.running[pos];
        let (hr, vr) = (self.req(head), self.req(victim));
        let remote_pending = hr.status == RequestStatus::WaitingForRemoteKvs
            && !self
                .connector
                .as_ref()
                .is_some_and(|c| c.is_load_done(head));
        let row = scheduled.iter().position(|s| s.handle == victim);
        // Only a running row can be taken back (never one admitted in this scan).
        let row_is_running = row.is_none_or(|j| scheduled[j].kind == ScheduledKind::Cached);
        if hr.priority >= vr.priority
            || vr.num_preemptions >= self.cfg.max_preemptions_per_request
            || remote_pending
            || self.requests[head as usize]
                .progress
                .num_output_placeholders
                > 0
            || !row_is_running
        {
            return false;
        }
        self.running.remove(pos);
        if let Some(j) = row {
            // As in S3: the victim's row gives back its tokens and budget.
            let s = self.unschedule(scheduled, j, &mut out.block_ids);
            budget.refund(&s);
        }
        // Freeing blocks must not overtake the caching of earlier rows'.
        self.cache_pending_blocks();
        self.preempt(victim);
        out.preempted.push(victim);
        true
    }

    /// Frees the KV of a waiting request that holds some; it starts over
    /// like a preempted request.
    fn release_waiting_kv(&mut self, h: Handle) {
        self.kv_holding.remove(h);
        self.kv.free(h);
        if let Some(c) = self.connector.as_mut() {
            c.request_finished(h);
        }
        self.requests[h as usize].progress.num_computed_tokens = 0;
        let req = self.req_mut(h);
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        let entry = QueueEntry::of(req);
        self.waiting.prepend(entry);
        self.num_preemptions_total += 1;
    }

    /// A load that brought nothing: the request gives its blocks back and
    /// waits again at the head of the waiting queue, not as a preemption.
    pub(super) fn return_loading_kv(&mut self, h: Handle) {
        self.kv_holding.remove(h);
        self.kv.free(h);
        let req = self.req_mut(h);
        req.status = if req.num_preemptions > 0 {
            RequestStatus::Preempted
        } else {
            RequestStatus::Waiting
        };
        req.num_loaded_tokens = 0;
        let entry = QueueEntry::of(req);
        self.waiting.prepend(entry);
        if let Some(c) = self.connector.as_mut() {
            c.request_finished(h);
        }
    }

    fn defer_head(
        &mut self,
        which: WhichQueue,
        h: Handle,
        reason: SkipReason,
        deferred: &mut Vec<(WhichQueue, QueueEntry)>,
    ) {
        self.gates.record_skip(reason);
        self.bufs.skips.push((h, reason));
        self.queue_mut(which).pop();
        let req = self.req_mut(h);
        if !std::mem::replace(&mut req.deferred, true) {
            self.num_deferred_waiting += 1;
        }
        deferred.push((which, QueueEntry::of(self.req(h))));
    }

    /// S2 spec decode, vLLM 0.33: an admission with one token left to
    /// compute is padded to a uniform decode (`1 + k` tokens) when the
    /// running phase scheduled no prefill chunk (`running_prefill`, by each
    /// request's flag from its previous schedule), when there is a decode
    /// batch to join (a running row) or the admission hit cached KV, and when
    /// the padded positions stay below `max_model_len`.
    fn pads_to_uniform_decode(
        &self,
        scheduled: &[Scheduled],
        running_prefill: bool,
        num_computed: usize,
    ) -> bool {
        let has_running_row = scheduled.iter().any(|s| s.kind == ScheduledKind::Cached);
        (has_running_row || num_computed > 0)
            && !running_prefill
            // vLLM: `computed + 1 + k + 1 <= max_model_len`.
            && num_computed + 1 + self.cfg.num_speculative_tokens < self.cfg.max_model_len
    }

    /// A remote load completed: the hit and the loaded tokens count as
    /// computed (never the last token, which must produce logits).
    fn finish_remote_load(&mut self, h: Handle) {
        let slot = &mut self.requests[h as usize];
        let req = slot.req.as_deref_mut().expect("live handle");
        let computed = req.num_loaded_tokens.min(req.num_tokens() - 1);
        slot.progress.num_computed_tokens = computed;
        req.status = if req.num_preemptions > 0 {
            RequestStatus::Preempted
        } else {
            RequestStatus::Waiting
        };
        self.kv.cache_blocks_unrecorded(req, computed);
    }
}
