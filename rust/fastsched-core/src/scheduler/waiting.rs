//! The waiting phase of a step (S6/S7/S10/S11): admits waiting requests.

use super::step::advance;
use super::{PauseState, Scheduled, Scheduler, WhichQueue};
use crate::kv::manager::AllocRequest;
use crate::kv::CacheHit;
use crate::output::ScheduledKind;
use crate::queue::QueueEntry;
use crate::request::{FinishReason, Handle, RequestStatus};
use crate::telemetry::{ScanStop, SkipReason};

impl Scheduler {
    /// S6/S7/S10/S11: admits waiting requests; returns the gate that
    /// stopped the scan.
    pub(super) fn schedule_waiting(
        &mut self,
        scheduled: &mut Vec<Scheduled>,
        block_ids: &mut Vec<u32>,
        preempted: &mut Vec<Handle>,
        token_budget: &mut usize,
        input_budget: &mut usize,
        threshold: usize,
        defer: bool,
    ) -> ScanStop {
        let draft_slots = self.cfg.num_lookahead_tokens;
        let num_spec = self.cfg.num_speculative_tokens;
        let max_active = self.cfg.max_num_active_seqs();
        let watermark_blocks =
            (self.cfg.watermark * self.kv.pool.num_usable_blocks() as f64) as usize;
        // S7: the adapters of every running request, scheduled in this step
        // or not (as vLLM 0.33), are the step's LoRA set.
        let mut lora_set = std::mem::take(&mut self.lora_set);
        lora_set.clear();
        if self.cfg.max_loras > 0 {
            lora_set.extend(self.running.iter().filter_map(|&h| self.req(h).lora_id));
            lora_set.sort_unstable();
            lora_set.dedup();
        }
        let mut deferred: Vec<(WhichQueue, QueueEntry)> = Vec::new();

        // The queue is looked at before the budget (neither has side
        // effects) so that an empty queue reads as `NoWaiting`.
        let stop = loop {
            let which = if !self.kv_holding.is_empty() {
                WhichQueue::KvHolding
            } else if self.waiting.is_empty() {
                break ScanStop::NoWaiting;
            } else if self.pause == PauseState::Unpaused {
                WhichQueue::Waiting
            } else {
                break ScanStop::Paused;
            };
            if *token_budget == 0 {
                break ScanStop::TokenBudget;
            }
            if *input_budget <= draft_slots {
                // An exhausted input budget is a budget stop, not a draft one.
                break if *input_budget == 0 {
                    ScanStop::TokenBudget
                } else {
                    ScanStop::DraftSlots
                };
            }
            if self.running.len() + self.num_waiting_for_streaming_input >= max_active {
                if self.preempt_for_priority(
                    which,
                    scheduled,
                    block_ids,
                    preempted,
                    token_budget,
                    input_budget,
                ) {
                    continue;
                }
                break ScanStop::ActiveSeqs;
            }
            let queue = match which {
                WhichQueue::KvHolding => &mut self.kv_holding,
                WhichQueue::Waiting => &mut self.waiting,
            };
            let h = queue.peek().expect("non-empty queue");

            // S7: skips for the request's own reasons.
            if self.req(h).status == RequestStatus::WaitingForRemoteKvs {
                let done = self.connector.as_ref().is_some_and(|c| c.is_load_done(h));
                if !done {
                    self.defer_head(which, h, SkipReason::RemoteKv, &mut deferred);
                    continue;
                }
                self.finish_remote_load(h);
            }
            let slot = &self.requests[h as usize];
            let req = slot.req.as_deref().expect("live handle");
            let num_computed_before = slot.progress.num_computed_tokens;
            if slot.progress.num_output_placeholders > 0 {
                self.defer_head(which, h, SkipReason::StaleOutput, &mut deferred);
                continue;
            }
            if let Some(lora) = req.lora_id {
                if lora_set.len() >= self.cfg.max_loras && lora_set.binary_search(&lora).is_err() {
                    self.defer_head(which, h, SkipReason::LoraSlots, &mut deferred);
                    continue;
                }
            }

            // S16: a preempted request whose sequence outgrew the whole pool
            // can never run again; it ends as length-capped instead of waiting forever.
            if self.kv_blocks_needed(req.num_tokens()) > self.kv.pool.num_usable_blocks() {
                match which {
                    WhichQueue::KvHolding => self.kv_holding.pop(),
                    WhichQueue::Waiting => self.waiting.pop(),
                };
                self.finish(h, RequestStatus::FinishedLengthCapped);
                self.pending_finished.push((h, FinishReason::Length));
                continue;
            }

            // S8: prefix cache (and connector) hits for a request holding no KV.
            let mut hit = CacheHit::default();
            let mut num_external = 0;
            let mut load_async = false;
            if num_computed_before == 0 {
                let req = self.requests[h as usize].req.as_ref().expect("live handle");
                hit = self.kv.get_computed_blocks(req);
                if let Some(c) = self.connector.as_mut() {
                    (num_external, load_async) = c.get_num_new_matched_tokens(req, hit.num_tokens);
                    // The last token is always computed, whatever the connector offers.
                    num_external = num_external.min(req.num_tokens() - 1 - hit.num_tokens);
                    load_async &= num_external > 0;
                }
            }
            let req = self.requests[h as usize].req.as_ref().expect("live handle");
            let num_computed = num_computed_before + hit.num_tokens + num_external;
            let is_prefill_work = num_computed + 1 < req.num_tokens();
            if defer && is_prefill_work {
                break ScanStop::PrefillInterval;
            }
            let mut n = req.num_tokens() - num_computed;
            let mut num_pad = 0;
            if load_async {
                // Reserve the whole prompt now: a request that holds only the
                // loaded blocks could wait forever for the rest while others
                // holding KV wait for it.
                n = req.num_tokens() - hit.num_tokens - num_external;
            } else {
                if threshold > 0 && n > threshold {
                    n = threshold;
                }
                let cap = (*token_budget).min(*input_budget - draft_slots);
                if !self.cfg.enable_chunked_prefill && n > cap {
                    break ScanStop::TokenBudget;
                }
                n = n.min(cap);
                let one_left = num_computed + 1 == req.num_tokens();
                if one_left && num_spec > 0 && self.pads_to_uniform_decode(scheduled, num_computed)
                {
                    // S2 spec decode: one token left, padded with `k` drafts
                    // of -1 so the batch stays a uniform decode; rather no
                    // admission than an unpadded one (vLLM 0.33).
                    if 1 + num_spec > *token_budget {
                        break ScanStop::TokenBudget;
                    }
                    num_pad = num_spec;
                    n += num_pad;
                }
            }
            let alloc = AllocRequest {
                num_computed_tokens: num_computed_before,
                num_new_tokens: n + num_external,
                num_lookahead_tokens: self.cfg.num_lookahead_tokens,
                full_sequence_must_fit: self.cfg.scheduler_reserve_full_isl,
                reserve_blocks: if scheduled.is_empty() {
                    0
                } else {
                    watermark_blocks
                },
                delay_cache: load_async,
            };
            self.block_scratch.clear();
            if self
                .kv
                .allocate_slots(req, alloc, Some(&hit), &mut self.block_scratch)
                .is_none()
            {
                // S16: KV-holding requests that all wait for more blocks while
                // nothing runs would wait forever: the latest of them gives its
                // KV back (recompute later) so the head can go.
                if which == WhichQueue::KvHolding && self.running.is_empty() && scheduled.is_empty()
                {
                    if let Some(victim) = self
                        .kv_holding
                        .ordered()
                        .into_iter()
                        .rev()
                        .find(|&v| v != h)
                    {
                        self.release_waiting_kv(victim);
                        continue;
                    }
                }
                break ScanStop::KvBlocks; // S10: a request that does not fit stops the scan.
            }
            let queue = match which {
                WhichQueue::KvHolding => &mut self.kv_holding,
                WhichQueue::Waiting => &mut self.waiting,
            };
            queue.pop();
            if load_async {
                let req = self.req_mut(h);
                req.status = RequestStatus::WaitingForRemoteKvs;
                req.num_loaded_tokens = num_computed;
                let entry = QueueEntry::of(req);
                deferred.push((WhichQueue::KvHolding, entry));
                if let Some(c) = self.connector.as_mut() {
                    c.start_load(h);
                }
                continue;
            }
            // S11: admission. New and resumed rows send the whole block table.
            self.running.push(h);
            let blocks = self.kv.blocks(h);
            block_ids.extend_from_slice(blocks);
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
                req.num_cached_tokens = Some(num_computed);
            }
            if let Some(lora) = req.lora_id {
                if let Err(pos) = lora_set.binary_search(&lora) {
                    lora_set.insert(pos, lora);
                }
            }
            if was_deferred {
                self.num_deferred_waiting -= 1;
            }
            let row = Scheduled {
                handle: h,
                num_tokens: n as u32,
                num_computed_before: num_computed as u32,
                num_cached_tokens: num_computed as u32,
                num_spec: num_pad as u32,
                num_blocks,
                kind,
                carries_prefill: is_prefill_work,
                samples: false,
            };
            let p = &mut self.requests[h as usize].progress;
            p.num_computed_tokens = num_computed;
            scheduled.push(advance(p, row, async_scheduling));
            // S1: padding drafts, like drafts, use no input budget.
            *token_budget -= n;
            *input_budget -= n - num_pad;
        };
        self.lora_set = lora_set;

        // S7: skipped requests go back to the head of their queue in order.
        let (kv_back, wait_back): (Vec<_>, Vec<_>) = deferred
            .into_iter()
            .partition(|(q, _)| *q == WhichQueue::KvHolding);
        self.kv_holding
            .prepend_all(kv_back.into_iter().map(|(_, e)| e).collect());
        self.waiting
            .prepend_all(wait_back.into_iter().map(|(_, e)| e).collect());
        // S12 capacity escape: a release step that leaves requests waiting
        // (beyond those skipped for their own reasons, in this step or an
        // earlier one) turns throttling off.
        if !defer && self.cfg.prefill_schedule_interval > 1 {
            self.interval.capacity_bound = self.num_waiting() > self.num_deferred_waiting;
        }
        stop
    }

    /// Priority preemption (opt-in): when the active set is full, the head
    /// of `which` displaces the S3 priority victim if the head is strictly
    /// more urgent and the victim is below `max_preemptions_per_request`. A
    /// victim already scheduled in the running phase gives its row back, as
    /// in S3. A head that S7 would skip anyway displaces nobody.
    fn preempt_for_priority(
        &mut self,
        which: WhichQueue,
        scheduled: &mut Vec<Scheduled>,
        block_ids: &mut Vec<u32>,
        preempted: &mut Vec<Handle>,
        token_budget: &mut usize,
        input_budget: &mut usize,
    ) -> bool {
        if !self.cfg.priority_preemption || self.running.is_empty() {
            return false;
        }
        let head = match which {
            WhichQueue::KvHolding => self.kv_holding.peek(),
            WhichQueue::Waiting => self.waiting.peek(),
        }
        .expect("non-empty queue");
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
            let s = self.unschedule(scheduled, j, block_ids);
            *token_budget += s.num_tokens as usize;
            *input_budget += (s.num_tokens - s.num_spec) as usize;
        }
        // Freeing blocks must not overtake the caching of earlier rows'.
        self.cache_pending_blocks();
        self.preempt(victim);
        preempted.push(victim);
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

    fn defer_head(
        &mut self,
        which: WhichQueue,
        h: Handle,
        reason: SkipReason,
        deferred: &mut Vec<(WhichQueue, QueueEntry)>,
    ) {
        self.gates.record_skip(reason);
        self.step_skips.push((h, reason));
        match which {
            WhichQueue::KvHolding => self.kv_holding.pop(),
            WhichQueue::Waiting => self.waiting.pop(),
        };
        let req = self.req_mut(h);
        if !std::mem::replace(&mut req.deferred, true) {
            self.num_deferred_waiting += 1;
        }
        deferred.push((which, QueueEntry::of(self.req(h))));
    }

    /// S2 spec decode, vLLM 0.33: an admission with one token left to
    /// compute is padded to a uniform decode (`1 + k` tokens) when no running
    /// row of this step is a prefill chunk (by its flag from its previous
    /// schedule), when there is a decode batch to join (a running row) or the
    /// admission hit cached KV, and when the padded positions stay below
    /// `max_model_len`.
    fn pads_to_uniform_decode(&self, scheduled: &[Scheduled], num_computed: usize) -> bool {
        let mut running_rows = scheduled
            .iter()
            .filter(|s| s.kind == ScheduledKind::Cached)
            .peekable();
        let joins_a_batch = running_rows.peek().is_some() || num_computed > 0;
        joins_a_batch
            && !running_rows.any(|s| s.carries_prefill)
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
        self.kv.cache_blocks(req, computed);
    }
}
