//! Per-step data handed to the model runner and back, as flat arrays.
//!
//! `schedule()` describes a step with parallel arrays indexed by scheduled
//! position; block ids travel as CSR (`block_offsets[i]..block_offsets[i+1]`).
//! `update_from_output()` takes sampled tokens the same way and answers with
//! the new tokens and finish reasons of the requests that progressed.

use crate::request::Handle;

/// How a scheduled request relates to the runner's persistent state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ScheduledKind {
    /// Already known to the runner: only new block ids are sent.
    Cached = 0,
    /// Scheduled for the first time: the whole block table is sent.
    New = 1,
    /// Re-admitted after a preemption: the whole block table is sent again.
    Resumed = 2,
}

#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    /// Increases by one per `schedule()`; `update_from_output` consumes steps in order.
    pub step_id: u64,
    pub req_handles: Vec<Handle>,
    pub num_scheduled_tokens: Vec<u32>,
    /// Tokens already computed before this step: the position of the first
    /// scheduled token.
    pub num_computed_tokens: Vec<u32>,
    pub kinds: Vec<u8>,
    /// For new and resumed requests, the prefix-cache (and remote) hit counted
    /// as computed at admission; 0 for the others.
    pub num_cached_tokens: Vec<u32>,
    /// Draft tokens scheduled for verification, per request.
    pub num_spec_tokens: Vec<u32>,
    /// The draft tokens themselves, row after row (`num_spec_tokens[i]` for
    /// row `i`): a prefix of the drafts the request carried, or `-1`
    /// padding for an admission padded to a uniform decode (never accepted).
    pub spec_token_ids: Vec<i64>,
    pub block_offsets: Vec<u32>,
    pub block_ids: Vec<u32>,
    /// Preempted during this call.
    pub preempted: Vec<Handle>,
    /// Waiting requests skipped during this call (S7), each at most once,
    /// in the order they were skipped; they still wait.
    pub skipped: Vec<Handle>,
    /// Why each of `skipped` was skipped (`SkipReason` codes).
    pub skip_reasons: Vec<u8>,
    /// Finished, aborted or ignored since the previous call: the runner drops
    /// their state; their handles may be reused after this step completes.
    pub finished: Vec<Handle>,
    pub total_num_scheduled_tokens: usize,
}

impl SchedulerOutput {
    pub fn len(&self) -> usize {
        self.req_handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.req_handles.is_empty()
    }

    pub fn block_ids_of(&self, i: usize) -> &[u32] {
        &self.block_ids[self.block_offsets[i] as usize..self.block_offsets[i + 1] as usize]
    }

    /// The draft tokens of row `i` (O(i): for tests and diagnostics).
    pub fn spec_token_ids_of(&self, i: usize) -> &[i64] {
        let start: usize = self.num_spec_tokens[..i].iter().map(|&n| n as usize).sum();
        &self.spec_token_ids[start..start + self.num_spec_tokens[i] as usize]
    }
}

/// What the model produced for one step, aligned with that step's `req_handles`.
#[derive(Debug, Default, Clone)]
pub struct ModelRunnerOutput {
    /// CSR offsets into `sampled_token_ids`; empty rows for partial prefills.
    pub sampled_offsets: Vec<u32>,
    pub sampled_token_ids: Vec<u32>,
    /// Draft proposals for the next step (speculative decoding); empty when unused.
    pub draft_offsets: Vec<u32>,
    pub draft_token_ids: Vec<u32>,
}

impl ModelRunnerOutput {
    /// One sampled token (or none, `None`) per scheduled request.
    pub fn from_tokens(tokens: &[Option<u32>]) -> Self {
        let mut out = ModelRunnerOutput {
            sampled_offsets: Vec::with_capacity(tokens.len() + 1),
            ..Default::default()
        };
        out.sampled_offsets.push(0);
        for t in tokens {
            if let Some(t) = t {
                out.sampled_token_ids.push(*t);
            }
            out.sampled_offsets.push(out.sampled_token_ids.len() as u32);
        }
        out
    }
}

/// Requests that progressed in one `update_from_output`.
#[derive(Debug, Default, Clone)]
pub struct EngineCoreOutputs {
    pub handles: Vec<Handle>,
    pub token_offsets: Vec<u32>,
    pub token_ids: Vec<u32>,
    /// 0 = still running, else a `FinishReason` code.
    pub finish_reasons: Vec<u8>,
    /// A streaming-input session finished a segment and waits for more input.
    pub segment_ended: Vec<bool>,
    /// Prefix-cache hit of the first admission, or -1 before the prompt is done.
    pub num_cached_tokens: Vec<i64>,
}

impl EngineCoreOutputs {
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    pub fn tokens_of(&self, i: usize) -> &[u32] {
        &self.token_ids[self.token_offsets[i] as usize..self.token_offsets[i + 1] as usize]
    }
}
