//! S15: streaming sessions: more input, segment ends, closing.

use super::Scheduler;
use crate::error::{Error, Result};
use crate::queue::QueueEntry;
use crate::request::{Handle, RequestStatus, StreamInput};

impl Scheduler {
    /// S15: more input for a streaming session.
    pub fn add_stream_input(&mut self, request_id: &str, input: StreamInput) -> Result<()> {
        let h = *self
            .ids
            .get(request_id)
            .ok_or_else(|| Error::UnknownRequest(format!("no live request {request_id:?}")))?;
        if !self.req(h).streaming {
            return Err(Error::InvalidRequest(format!(
                "request {request_id:?} is not an open streaming session"
            )));
        }
        if input.max_tokens == 0 {
            return Err(Error::InvalidRequest(format!(
                "request {request_id:?}: max_tokens (0) must be at least 1"
            )));
        }
        let pending: usize = self
            .req(h)
            .pending_stream_inputs
            .iter()
            .map(|i| i.token_ids.len())
            .sum();
        let total = self.req(h).num_tokens() + pending + input.token_ids.len();
        if total >= self.cfg.max_model_len {
            return Err(Error::InvalidRequest(format!(
                "request {request_id:?}: streaming input would grow the session to {total} tokens, beyond max_model_len ({})",
                self.cfg.max_model_len
            )));
        }
        if self.req(h).status == RequestStatus::WaitingForStreamingReq {
            self.num_waiting_for_streaming_input -= 1;
            self.resume_session(h, input);
        } else {
            self.req_mut(h).pending_stream_inputs.push_back(input);
        }
        Ok(())
    }

    /// Moves a session with new input back to waiting; it keeps its blocks.
    fn resume_session(&mut self, h: Handle, input: StreamInput) {
        let hasher = self.hasher.clone();
        let slot = &mut self.requests[h as usize];
        let req = slot.req.as_deref_mut().expect("live handle");
        req.append_stream_input(input, &hasher);
        slot.progress.num_tokens = req.num_tokens();
        req.status = RequestStatus::Waiting;
        let entry = QueueEntry::of(req);
        self.kv_holding.push(entry);
    }

    /// S15: a streaming session finished a segment. It keeps its blocks and
    /// runner slot; with input already pending it goes straight back to
    /// waiting, otherwise it waits for input.
    pub(super) fn end_segment(&mut self, h: Handle) {
        match self.req(h).status {
            RequestStatus::Running => self.bufs.stopped.push(h),
            // Preempted while its last token was in flight (async scheduling).
            _ => {
                if !self.waiting.remove(h) {
                    self.kv_holding.remove(h);
                }
            }
        }
        // The session goes on from its last token. A stop inside accepted
        // drafts has already trimmed the computed count (`apply_outputs`);
        // under async scheduling a step scheduled ahead may still count a
        // token past the segment's end, which is dropped when it lands.
        let p = &mut self.requests[h as usize].progress;
        p.num_computed_tokens = p.num_computed_tokens.min(p.num_tokens - 1);
        let req = self.req_mut(h);
        req.status = RequestStatus::WaitingForStreamingReq;
        if std::mem::take(&mut req.deferred) {
            self.num_deferred_waiting -= 1;
        }
        let req = self.req_mut(h);
        match req.pending_stream_inputs.pop_front() {
            Some(input) => self.resume_session(h, input),
            None => self.num_waiting_for_streaming_input += 1,
        }
    }

    /// Ends an open streaming session: at once if it waits for input,
    /// otherwise after its current segment.
    pub fn close_stream(&mut self, request_id: &str) -> Result<()> {
        let h = *self
            .ids
            .get(request_id)
            .ok_or_else(|| Error::UnknownRequest(format!("no live request {request_id:?}")))?;
        let req = self.req_mut(h);
        if let Some(last) = req.pending_stream_inputs.back_mut() {
            last.is_last = true; // input already sent is still served
            return Ok(());
        }
        req.streaming = false;
        if req.status == RequestStatus::WaitingForStreamingReq {
            self.num_waiting_for_streaming_input -= 1;
            self.finish(h, RequestStatus::FinishedStopped);
        }
        Ok(())
    }
}
