//! `update_from_output()` and `update_from_tokens()` (S17): sampled tokens,
//! drafts, stop conditions.

use super::{warm_range, Scheduled, Scheduler, Slot};
use crate::error::{Error, Result};
use crate::output::{EngineCoreOutputs, ModelRunnerOutput};
use crate::request::{FinishReason, Handle, Request, RequestStatus};

impl Scheduler {
    // ----------------------------------------------------------------- outputs

    /// S17: appends sampled tokens to the requests of the oldest step in
    /// flight, applies stop conditions, frees finished requests at once.
    pub fn update_from_output(&mut self, mro: &ModelRunnerOutput) -> Result<EngineCoreOutputs> {
        let n = self.check_rows(mro.sampled_offsets.len())?;
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
        let offsets = &mro.sampled_offsets;
        let sampled =
            |j: usize| &mro.sampled_token_ids[offsets[j] as usize..offsets[j + 1] as usize];
        let drafts = has_drafts.then_some(mro);
        Ok(self.apply_outputs(sampled, mro.sampled_token_ids.len(), drafts))
    }

    /// [`Self::update_from_output`] for the common case of at most one
    /// sampled token per scheduled request and no drafts, given as one
    /// `Option` per row (`None`: a partial prefill). Errors as
    /// `update_from_output` with the equivalent offsets would; it only skips
    /// building and checking them.
    pub fn update_from_tokens(&mut self, tokens: &[Option<u32>]) -> Result<EngineCoreOutputs> {
        self.check_rows(tokens.len() + 1)?;
        let sampled = |j: usize| tokens[j].as_slice();
        Ok(self.apply_outputs(sampled, tokens.len(), None))
    }

    /// The number of rows of the oldest step in flight, which
    /// `num_offsets - 1` rows of sampled tokens must match.
    fn check_rows(&self, num_offsets: usize) -> Result<usize> {
        let step = self.in_flight.front().ok_or_else(|| {
            Error::OutputMismatch(
                "update_from_output called with no scheduled step in flight".into(),
            )
        })?;
        let n = step.rows.len();
        if num_offsets != n + 1 {
            return Err(Error::OutputMismatch(format!(
                "step {} scheduled {n} requests but sampled_offsets has {num_offsets} entries (expected {})",
                step.step_id,
                n + 1
            )));
        }
        Ok(n)
    }

    /// S17 for the oldest step in flight (checked by the caller): row `j`
    /// sampled `sampled(j)` (at most `max_tokens` in all) and, when
    /// `drafts` is given, proposed its CSR row of draft tokens.
    fn apply_outputs<'a>(
        &mut self,
        sampled: impl Fn(usize) -> &'a [u32],
        max_tokens: usize,
        drafts: Option<&ModelRunnerOutput>,
    ) -> EngineCoreOutputs {
        let step = self.in_flight.pop_front().expect("checked by the caller");
        let n = step.rows.len();
        let num_pending = self.pending_finished.len();
        let mut outs = EngineCoreOutputs {
            handles: Vec::with_capacity(n + num_pending),
            token_offsets: Vec::with_capacity(n + num_pending + 1),
            token_ids: Vec::with_capacity(max_tokens),
            // Filled at the end from `ended`: most rows neither finish nor
            // end a segment.
            finish_reasons: Vec::new(),
            segment_ended: Vec::new(),
            num_cached_tokens: Vec::with_capacity(n + num_pending),
        };
        outs.token_offsets.push(0);
        self.bufs.stopped.clear();
        // (output row, finish reason, segment ended) of the rows that stopped.
        let mut ended: Vec<(usize, u8, bool)> = Vec::new();
        let spec_decoding = self.cfg.num_speculative_tokens > 0;
        let hasher = self.hasher.clone();
        let max_model_len = self.cfg.max_model_len;
        for (j, row) in step.rows.iter().enumerate() {
            if let Some(ahead) = warm_range(j, n) {
                warm_rows(&self.requests, &step.rows[ahead]);
            }
            let h = row.handle;
            let slot = &mut self.requests[h as usize];
            let Some(req) = slot.req.as_deref_mut() else {
                continue;
            };
            if req.is_finished() {
                continue; // aborted while the step was in flight
            }
            let p = &mut slot.progress;
            if row.samples && p.num_output_placeholders > 0 {
                p.num_output_placeholders -= 1;
            }
            if req.status == RequestStatus::WaitingForStreamingReq {
                // S15: its segment ended while this step, scheduled ahead
                // (async), was in flight: the token lies past the stop.
                continue;
            }
            if p.prefill_only {
                // S20: the step that computed its last prompt token ends it,
                // length-capped with no token (even if preempted since: its
                // positions were all computed).
                debug_assert!(sampled(j).is_empty(), "a prefill-only row samples nothing");
                if (row.num_computed_before + row.num_tokens) as usize >= req.num_tokens() {
                    outs.handles.push(h);
                    outs.token_offsets.push(outs.token_ids.len() as u32);
                    outs.num_cached_tokens
                        .push(req.num_cached_tokens.map_or(-1, |c| c as i64));
                    ended.push((outs.handles.len() - 1, FinishReason::Length as u8, false));
                    self.finish_from_output(h, RequestStatus::FinishedLengthCapped);
                }
                continue;
            }
            let sampled = sampled(j);
            let num_spec = row.num_spec as usize;
            if num_spec > 0 && p.num_computed_tokens > 0 && !sampled.is_empty() {
                let accepted = sampled.len() - 1;
                p.num_computed_tokens -= num_spec.saturating_sub(accepted);
            }
            let mut stop = None;
            for (kept, &t) in sampled.iter().enumerate() {
                req.append_output_token(t, &hasher);
                p.num_tokens += 1;
                outs.token_ids.push(t);
                stop = req.check_stop_after(t, max_model_len);
                if stop.is_some() {
                    // S8/S17, vLLM 0.33: the tokens dropped after a stop inside
                    // accepted drafts leave the computed count too, which keeps
                    // it at `num_tokens - 1`, as after any step (a request
                    // preempted meanwhile stays at 0).
                    let dropped = sampled.len() - (kept + 1);
                    p.num_computed_tokens = p.num_computed_tokens.saturating_sub(dropped);
                    break;
                }
            }
            if spec_decoding && !sampled.is_empty() && req.status == RequestStatus::Running {
                // vLLM 0.33 with speculative decoding: the blocks completed by
                // accepted tokens are cached now (one step before the next
                // schedule would), even when the request has just stopped, so
                // that freeing it sends them to the back of the free queue.
                // Only within the computed tokens: a stop that leaves the
                // sequence a whole number of blocks long leaves its last block
                // unhashed, and freeing sends that one to the front.
                let upto = p.num_computed_tokens.min(req.num_tokens());
                self.kv.cache_blocks(req, upto);
            }
            // The drafts of this step's rows were taken when it was scheduled;
            // new ones, for requests still decoding.
            if let Some(mro) = drafts {
                if stop.is_none() && !p.is_prefill_chunk {
                    let drafts = &mro.draft_token_ids
                        [mro.draft_offsets[j] as usize..mro.draft_offsets[j + 1] as usize];
                    set_drafts(req, drafts, self.cfg.num_speculative_tokens, max_model_len);
                }
            }
            if sampled.is_empty() {
                continue; // no token, so no stop either: nothing to report
            }
            outs.handles.push(h);
            outs.token_offsets.push(outs.token_ids.len() as u32);
            let prefill_done = !p.is_prefill_chunk;
            outs.num_cached_tokens.push(match req.num_cached_tokens {
                Some(c) if prefill_done => c as i64,
                _ => -1,
            });
            if let Some(mut status) = stop {
                let row = outs.handles.len() - 1;
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
                    let reason = status.finish_reason().map_or(0, |r| r as u8);
                    ended.push((row, reason, false));
                    self.finish_from_output(h, status);
                } else {
                    ended.push((row, 0, true));
                    self.end_segment(h);
                }
            }
        }
        outs.finish_reasons = vec![0; outs.handles.len()];
        outs.segment_ended = vec![false; outs.handles.len()];
        for (row, reason, segment_ended) in ended {
            outs.finish_reasons[row] = reason;
            outs.segment_ended[row] = segment_ended;
        }
        if !self.bufs.stopped.is_empty() {
            // A few stops among many running requests: flag them rather than
            // re-read every running request (or search the list per request).
            let flags = &mut self.bufs.stopped_flags;
            flags.resize(self.requests.len(), false);
            for &h in &self.bufs.stopped {
                flags[h as usize] = true;
            }
            self.running.retain(|&h| !flags[h as usize]);
            for &h in &self.bufs.stopped {
                flags[h as usize] = false;
            }
        }
        self.bufs.spare_step = Some(step);
        for (h, reason) in std::mem::take(&mut self.pending_finished) {
            outs.handles.push(h);
            outs.token_offsets.push(outs.token_ids.len() as u32);
            outs.num_cached_tokens.push(-1);
            outs.finish_reasons.push(reason as u8);
            outs.segment_ended.push(false);
        }
        outs
    }

    /// S2 spec decode: the drafts proposed for the next step, as vLLM's
    /// `update_draft_token_ids` (`EngineCore.post_step`): CSR rows aligned
    /// with `handles`. A running request whose prefill is done takes its
    /// row (at most `num_speculative_tokens`, and no position past
    /// `max_model_len - 1`), replacing any drafts it held; a request still in
    /// prefill drops its drafts; unknown, finished or waiting requests are
    /// ignored. Without speculative decoding every row is ignored.
    pub fn update_draft_token_ids(
        &mut self,
        handles: &[Handle],
        draft_offsets: &[u32],
        draft_token_ids: &[u32],
    ) -> Result<()> {
        if draft_offsets.len() != handles.len() + 1 {
            return Err(Error::OutputMismatch(format!(
                "draft_offsets has {} entries, expected {} (one more than handles)",
                draft_offsets.len(),
                handles.len() + 1
            )));
        }
        check_csr("draft", draft_offsets, draft_token_ids.len())?;
        let k = self.cfg.num_speculative_tokens;
        if k == 0 {
            return Ok(());
        }
        let max_model_len = self.cfg.max_model_len;
        for (j, &h) in handles.iter().enumerate() {
            let Some(slot) = self.requests.get_mut(h as usize) else {
                continue;
            };
            let Some(req) = slot.req.as_deref_mut() else {
                continue;
            };
            if req.status != RequestStatus::Running {
                continue;
            }
            if slot.progress.is_prefill_chunk {
                req.spec_token_ids.clear();
                continue;
            }
            let drafts = &draft_token_ids[draft_offsets[j] as usize..draft_offsets[j + 1] as usize];
            set_drafts(req, drafts, k, max_model_len);
        }
        Ok(())
    }

    /// A request stopped by the model: off `running` (or its queue, when it
    /// was preempted while the step was in flight) and freed now.
    fn finish_from_output(&mut self, h: Handle, status: RequestStatus) {
        match self.req(h).status {
            RequestStatus::Running => self.bufs.stopped.push(h),
            _ => {
                if !self.waiting.remove(h) {
                    self.kv_holding.remove(h);
                }
            }
        }
        self.finish(h, status);
    }
}

/// Reads the lines `update_from_output` writes for each row (its slab entry,
/// the request's two hot lines and the end of its tokens) in a loop short
/// enough for the CPU to have many of those cache misses in flight at once;
/// the update loop, whose loads and stores would otherwise wait on them one
/// row at a time, then finds them in cache. Called a chunk of rows ahead of
/// the loop (`warm_range`), so that they are still in the first-level cache
/// when it reaches them. Only a performance hint.
fn warm_rows(requests: &[Slot], rows: &[Scheduled]) {
    let mut sink = 0u64;
    for row in rows {
        if let Some(r) = requests[row.handle as usize].req.as_deref() {
            let last = r.token_ids.last().copied().unwrap_or(0);
            sink ^= u64::from(last) ^ r.spec_token_ids.len() as u64;
        }
    }
    std::hint::black_box(sink);
}

/// Replaces a request's drafts with at most `k` of `drafts`, and none whose
/// position would pass `max_model_len - 1` (the running phase could not
/// schedule them).
fn set_drafts(req: &mut Request, drafts: &[u32], k: usize, max_model_len: usize) {
    let room = max_model_len.saturating_sub(req.num_tokens() + 1);
    req.spec_token_ids.clear();
    req.spec_token_ids
        .extend_from_slice(&drafts[..drafts.len().min(k).min(room)]);
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
