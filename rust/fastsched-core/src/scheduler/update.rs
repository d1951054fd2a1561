//! `update_from_output()` (S17): sampled tokens, drafts, stop conditions.

use super::{InFlightRow, Scheduler};
use crate::error::{Error, Result};
use crate::output::{EngineCoreOutputs, ModelRunnerOutput};
use crate::request::{Handle, Request, RequestStatus};

impl Scheduler {
    // ----------------------------------------------------------------- outputs

    /// S17: appends sampled tokens to the requests of the oldest step in
    /// flight, applies stop conditions, frees finished requests at once.
    pub fn update_from_output(&mut self, mro: &ModelRunnerOutput) -> Result<EngineCoreOutputs> {
        let step = self.in_flight.front().ok_or_else(|| {
            Error::OutputMismatch(
                "update_from_output called with no scheduled step in flight".into(),
            )
        })?;
        let n = step.rows.len();
        if mro.sampled_offsets.len() != n + 1 {
            return Err(Error::OutputMismatch(format!(
                "step {} scheduled {n} requests but sampled_offsets has {} entries (expected {})",
                step.step_id,
                mro.sampled_offsets.len(),
                n + 1
            )));
        }
        check_csr("sampled", &mro.sampled_offsets, mro.sampled_token_ids.len())?;
        let has_drafts = !mro.draft_offsets.is_empty();
        if has_drafts {
            if mro.draft_offsets.len() != n + 1 {
                return Err(Error::OutputMismatch(format!(
                    "draft_offsets has {} entries, expected {}",
                    mro.draft_offsets.len(),
                    n + 1
                )));
            }
            check_csr("draft", &mro.draft_offsets, mro.draft_token_ids.len())?;
        }
        let step = self.in_flight.pop_front().expect("checked above");
        let mut outs = EngineCoreOutputs {
            handles: Vec::with_capacity(n),
            token_offsets: Vec::with_capacity(n + 1),
            token_ids: Vec::with_capacity(mro.sampled_token_ids.len()),
            finish_reasons: Vec::with_capacity(n),
            segment_ended: Vec::with_capacity(n),
            num_cached_tokens: Vec::with_capacity(n),
        };
        outs.token_offsets.push(0);
        self.stopped.clear();
        warm_rows(&self.requests, &step.rows);
        let hasher = self.hasher.clone();
        let max_model_len = self.cfg.max_model_len;
        for (j, row) in step.rows.iter().enumerate() {
            let h = row.handle;
            let Some(req) = self.requests[h as usize].as_deref_mut() else {
                continue;
            };
            if req.is_finished() {
                continue; // aborted while the step was in flight
            }
            if row.samples && req.num_output_placeholders > 0 {
                req.num_output_placeholders -= 1;
            }
            let sampled = &mro.sampled_token_ids
                [mro.sampled_offsets[j] as usize..mro.sampled_offsets[j + 1] as usize];
            let num_spec = row.num_spec as usize;
            if num_spec > 0 && req.num_computed_tokens > 0 && !sampled.is_empty() {
                let accepted = sampled.len() - 1;
                req.num_computed_tokens -= num_spec.saturating_sub(accepted);
            }
            let mut stop = None;
            let tokens_before = outs.token_ids.len();
            for &t in sampled {
                req.append_output_token(t, &hasher);
                outs.token_ids.push(t);
                stop = req.check_stop_after(t, max_model_len);
                if stop.is_some() {
                    break;
                }
            }
            if !has_drafts {
                // Written only when there is something to clear: most steps
                // carry no drafts and leave the line clean.
                if !req.spec_token_ids.is_empty() {
                    req.spec_token_ids.clear();
                }
            } else if stop.is_none() {
                let drafts = &mro.draft_token_ids
                    [mro.draft_offsets[j] as usize..mro.draft_offsets[j + 1] as usize];
                let room = max_model_len.saturating_sub(req.num_tokens() + 1);
                req.spec_token_ids.clear();
                req.spec_token_ids.extend_from_slice(
                    &drafts[..drafts.len().min(self.cfg.num_speculative_tokens).min(room)],
                );
            }
            if outs.token_ids.len() == tokens_before && stop.is_none() {
                continue;
            }
            outs.handles.push(h);
            outs.token_offsets.push(outs.token_ids.len() as u32);
            let prefill_done = !req.is_prefill_chunk;
            outs.num_cached_tokens.push(match req.num_cached_tokens {
                Some(c) if prefill_done => c as i64,
                _ => -1,
            });
            let mut reason = 0;
            let mut segment_ended = false;
            if let Some(mut status) = stop {
                // S15: a session whose next input cannot fit ends here.
                let next_input = req
                    .pending_stream_inputs
                    .front()
                    .map_or(0, |i| i.token_ids.len());
                let overflow = req.streaming && req.num_tokens() + next_input >= max_model_len;
                if overflow {
                    status = RequestStatus::FinishedLengthCapped;
                }
                if !req.streaming || overflow {
                    reason = status.finish_reason().map_or(0, |r| r as u8);
                    self.finish_from_output(h, status);
                } else {
                    segment_ended = true;
                    self.end_segment(h);
                }
            }
            outs.finish_reasons.push(reason);
            outs.segment_ended.push(segment_ended);
        }
        if !self.stopped.is_empty() {
            // A few stops among many running requests: search the short,
            // sorted list rather than re-read every running request.
            self.stopped.sort_unstable();
            let stopped = &self.stopped;
            self.running.retain(|h| stopped.binary_search(h).is_err());
        }
        self.spare_step = Some(step);
        for (h, reason) in std::mem::take(&mut self.pending_finished) {
            outs.handles.push(h);
            outs.token_offsets.push(outs.token_ids.len() as u32);
            outs.num_cached_tokens.push(-1);
            outs.finish_reasons.push(reason as u8);
            outs.segment_ended.push(false);
        }
        Ok(outs)
    }

    /// A request stopped by the model: off `running` (or its queue, when it
    /// was preempted while the step was in flight) and freed now.
    fn finish_from_output(&mut self, h: Handle, status: RequestStatus) {
        match self.req(h).status {
            RequestStatus::Running => self.stopped.push(h),
            _ => {
                if !self.waiting.remove(h) {
                    self.kv_holding.remove(h);
                }
            }
        }
        self.finish(h, status);
    }
}

/// Reads the lines `update_from_output` writes for each row (the request's
/// two hot lines and the end of its tokens) in a loop short enough for the
/// CPU to have many of those cache misses in flight at once; the update loop,
/// whose stores would otherwise wait on them one row at a time, then finds
/// them in cache. Only a performance hint.
fn warm_rows(requests: &[Option<Box<Request>>], rows: &[InFlightRow]) {
    let mut sink = 0u64;
    for row in rows {
        if let Some(r) = requests[row.handle as usize].as_deref() {
            let last = r.token_ids.last().copied().unwrap_or(0);
            sink ^= u64::from(last) ^ r.spec_token_ids.len() as u64;
        }
    }
    std::hint::black_box(sink);
}

fn check_csr(name: &str, offsets: &[u32], len: usize) -> Result<()> {
    let ok = offsets.first() == Some(&0)
        && offsets.windows(2).all(|w| w[0] <= w[1])
        && offsets.last().is_some_and(|&l| l as usize == len);
    if ok {
        Ok(())
    } else {
        Err(Error::OutputMismatch(format!(
            "{name}_offsets must start at 0, never decrease and end at len({name}_token_ids) = {len}"
        )))
    }
}
