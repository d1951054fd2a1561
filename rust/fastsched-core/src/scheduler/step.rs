//! `schedule()`: one step's orchestration (S1 budgets, S9 cap, S12
//! interval), the output arrays, and the in-flight record.

use super::{InFlightStep, PauseState, Scheduled, Scheduler, StepBudget, MAX_SPARE_REQUESTS};
use crate::output::{ScheduledKind, SchedulerOutput};
use crate::request::Progress;
use crate::telemetry::ScanStop;

impl Scheduler {
    // ----------------------------------------------------------------- schedule

    /// S9: the per-request token cap of this step.
    fn effective_long_prefill_threshold(&self) -> usize {
        let e = self.running.len() + self.num_waiting();
        let t = self.cfg.long_prefill_token_threshold;
        if e <= 1 || t == 0 {
            return 0;
        }
        if self.cfg.long_prefill_token_threshold_adaptive {
            t.max(self.cfg.max_num_batched_tokens / e)
        } else {
            t
        }
    }

    /// S12: hold prefill work this step?
    fn prefill_deferred(&self) -> bool {
        let k = self.cfg.prefill_schedule_interval as i64;
        k > 1
            && !self.interval.capacity_bound
            && (self.interval.executed + 1) - self.interval.last_prefill < k
            && self
                .running
                .iter()
                .any(|&h| !self.requests[h as usize].progress.is_prefill_chunk)
    }

    pub fn schedule(&mut self) -> SchedulerOutput {
        let oldest_in_flight = self.in_flight.front().map_or(u64::MAX, |s| s.step_id);
        let (requests, free_handles) = (&mut self.requests, &mut self.free_handles);
        let spares = &mut self.spare_requests;
        self.to_release.retain(|&(step, h)| {
            let done = step < oldest_in_flight;
            if done {
                let req = requests[h as usize].req.take();
                if spares.len() < MAX_SPARE_REQUESTS {
                    spares.extend(req);
                }
                free_handles.push(h);
            }
            !done
        });
        if let Some(c) = self.connector.as_mut() {
            c.on_step();
        }
        let mut out = SchedulerOutput {
            step_id: self.next_step_id,
            // Sized like the last step's, which a step's usually resembles:
            // growing it block by block would reallocate it several times.
            block_ids: Vec::with_capacity(self.bufs.last_num_block_ids),
            ..Default::default()
        };
        self.next_step_id += 1;
        out.finished = std::mem::take(&mut self.finished_since_schedule);
        self.to_release
            .extend(out.finished.iter().map(|&h| (out.step_id, h)));

        let mut budget = StepBudget {
            tokens: if self.pause == PauseState::PausedAll {
                0
            } else {
                self.cfg.max_num_scheduled_tokens()
            },
            inputs: self.cfg.max_num_batched_tokens,
            threshold: self.effective_long_prefill_threshold(),
            defer: self.prefill_deferred(),
            running_prefill: false,
        };
        let mut rows = self
            .bufs
            .spare_step
            .take()
            .map_or_else(Vec::new, |s| s.rows);
        rows.clear();

        // S2/S3: running requests first.
        self.schedule_running(&mut out, &mut rows, &mut budget);

        self.cache_pending_blocks();

        // S5: a step that preempted admits nobody.
        let stop = if !out.preempted.is_empty() {
            ScanStop::Preempted
        } else if self.pause == PauseState::PausedAll {
            if self.num_waiting() > 0 {
                ScanStop::Paused
            } else {
                ScanStop::NoWaiting
            }
        } else {
            self.schedule_waiting(&mut out, &mut rows, &mut budget)
        };
        self.gates.record_stop(stop);
        if !self.bufs.skips.is_empty() {
            out.skipped = self.bufs.skips.iter().map(|&(h, _)| h).collect();
            out.skip_reasons = self.bufs.skips.iter().map(|&(_, r)| r as u8).collect();
            self.bufs.skips.clear();
        }

        self.bufs.last_num_block_ids = out.block_ids.len();
        self.finish_step(&mut out, rows, budget.running_prefill);
        out
    }

    /// Fills the output arrays from the step's rows, does the S12
    /// bookkeeping, and records the step (its rows) for `update_from_output`.
    /// `running_prefill`: the running phase scheduled a prefill chunk, even
    /// one whose row was taken back since.
    fn finish_step(
        &mut self,
        out: &mut SchedulerOutput,
        scheduled: Vec<Scheduled>,
        running_prefill: bool,
    ) {
        // One tight pass per column: cheaper than pushing to seven vectors
        // per row.
        out.req_handles = scheduled.iter().map(|s| s.handle).collect();
        out.num_scheduled_tokens = scheduled.iter().map(|s| s.num_tokens).collect();
        out.num_computed_tokens = scheduled.iter().map(|s| s.num_computed_before).collect();
        out.kinds = scheduled.iter().map(|s| s.kind as u8).collect();
        out.num_cached_tokens = scheduled.iter().map(|s| s.num_cached_tokens).collect();
        out.num_spec_tokens = scheduled.iter().map(|s| s.num_spec).collect();
        out.block_offsets = std::iter::once(0)
            .chain(scheduled.iter().scan(0, |end, s| {
                *end += s.num_blocks;
                Some(*end)
            }))
            .collect();
        debug_assert_eq!(
            out.block_offsets.last().copied(),
            Some(out.block_ids.len() as u32)
        );
        out.total_num_scheduled_tokens = scheduled.iter().map(|s| s.num_tokens as usize).sum();
        if self.cfg.num_speculative_tokens > 0 {
            self.take_scheduled_drafts(out, &scheduled);
        }

        if out.total_num_scheduled_tokens > 0 {
            self.interval.executed += 1;
        }
        // vLLM 0.33: a step restarts the interval if its running phase
        // scheduled a prefill chunk (a victim's chunk taken back included,
        // Difference 10) or it admitted prefill work; stamped after the
        // count, so even a step left with no tokens restarts it.
        if running_prefill || scheduled.iter().any(|s| s.carries_prefill) {
            self.interval.last_prefill = self.interval.executed;
        }
        self.in_flight.push_back(InFlightStep {
            step_id: out.step_id,
            rows: scheduled,
        });
    }
}

impl Scheduler {
    /// S2 spec decode: moves the drafts each row verifies into
    /// `out.spec_token_ids` (padding rows get `-1`s). Every scheduled running
    /// request gives up its drafts, as in vLLM, whether or not the budget let
    /// all of them in: the next ones arrive with this step's output.
    fn take_scheduled_drafts(&mut self, out: &mut SchedulerOutput, scheduled: &[Scheduled]) {
        out.spec_token_ids
            .reserve(out.num_spec_tokens.iter().map(|&n| n as usize).sum());
        for row in scheduled {
            let num_spec = row.num_spec as usize;
            let req = self.req_mut(row.handle);
            if row.kind == ScheduledKind::Cached {
                // The running phase scheduled at most the drafts it held.
                debug_assert!(num_spec <= req.spec_token_ids.len());
                let drafts = &req.spec_token_ids[..num_spec.min(req.spec_token_ids.len())];
                out.spec_token_ids
                    .extend(drafts.iter().map(|&t| i64::from(t)));
                out.spec_token_ids
                    .extend(std::iter::repeat_n(-1, num_spec - drafts.len()));
            } else {
                out.spec_token_ids.extend(std::iter::repeat_n(-1, num_spec));
            }
            req.spec_token_ids.clear();
        }
    }
}

/// vLLM's `_update_after_schedule` for one row, done as the row is pushed:
/// the scheduled tokens count as computed, and a request whose prefill
/// completes samples a token (under async scheduling, a placeholder for it),
/// unless it is prefill-only (S20). `Scheduler::unschedule` undoes it.
#[inline]
pub(super) fn advance(p: &mut Progress, mut row: Scheduled, async_scheduling: bool) -> Scheduled {
    p.num_computed_tokens += row.num_tokens as usize;
    p.is_prefill_chunk = p.num_computed_tokens < p.num_tokens + p.num_output_placeholders as usize;
    row.samples = !p.is_prefill_chunk && !p.prefill_only;
    if async_scheduling && row.samples {
        p.num_output_placeholders += 1;
    }
    row
}
