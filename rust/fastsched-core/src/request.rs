//! A request as the scheduler sees it (docs/design.md §4): tokens, progress, status.

use crate::error::{Error, Result};
use crate::kv::prefix_cache::BlockHasher;

/// Index of a live request in the scheduler's slab; handed to callers so
/// per-step data can be arrays of integers instead of strings.
pub type Handle = u32;

/// Lifecycle states. Finished states sort after every live one so "is
/// finished" is one comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RequestStatus {
    Waiting,
    WaitingForRemoteKvs,
    WaitingForStreamingReq,
    Running,
    Preempted,
    FinishedStopped,
    FinishedLengthCapped,
    FinishedAborted,
    FinishedIgnored,
}

impl RequestStatus {
    pub fn is_finished(self) -> bool {
        self >= RequestStatus::FinishedStopped
    }

    pub fn finish_reason(self) -> Option<FinishReason> {
        match self {
            RequestStatus::FinishedStopped => Some(FinishReason::Stop),
            RequestStatus::FinishedLengthCapped => Some(FinishReason::Length),
            RequestStatus::FinishedAborted => Some(FinishReason::Abort),
            RequestStatus::FinishedIgnored => Some(FinishReason::Ignored),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Waiting => "waiting",
            RequestStatus::WaitingForRemoteKvs => "waiting_for_remote_kvs",
            RequestStatus::WaitingForStreamingReq => "waiting_for_streaming_req",
            RequestStatus::Running => "running",
            RequestStatus::Preempted => "preempted",
            RequestStatus::FinishedStopped => "finished_stopped",
            RequestStatus::FinishedLengthCapped => "finished_length_capped",
            RequestStatus::FinishedAborted => "finished_aborted",
            RequestStatus::FinishedIgnored => "finished_ignored",
        }
    }
}

/// Why a request ended, as reported to the frontend. The numeric values are
/// the codes used in per-step output arrays (0 = not finished).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    Stop = 1,
    Length = 2,
    Abort = 3,
    Ignored = 4,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Ignored => "ignored",
        }
    }
}

/// What a caller supplies to add a request.
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub eos_token_id: Option<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub priority: i64,
    pub arrival_time: f64,
    pub lora_id: Option<u32>,
    /// vLLM's `cache_salt`: mixed into the root of the request's block
    /// hashes, so that requests with different salts never share cached KV.
    pub cache_salt: Option<String>,
    /// A streaming-input session (S15): more input may arrive after each
    /// generation segment; it ends when the client closes it.
    pub streaming: bool,
    /// S19, vLLM's `skip_reading_prefix_cache`: no prefix-cache hit and no
    /// KV-connector tokens, so every position is computed (prompt logprobs
    /// need them all); what it computes is still cached for others.
    pub skip_reading_prefix_cache: bool,
}

impl NewRequest {
    pub fn new(
        request_id: impl Into<String>,
        prompt_token_ids: Vec<u32>,
        max_tokens: usize,
    ) -> Self {
        NewRequest {
            request_id: request_id.into(),
            prompt_token_ids,
            max_tokens,
            min_tokens: 0,
            eos_token_id: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            arrival_time: 0.0,
            lora_id: None,
            cache_salt: None,
            streaming: false,
            skip_reading_prefix_cache: false,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidRequest(m));
        if self.prompt_token_ids.is_empty() {
            return bad(format!(
                "request {:?}: prompt_token_ids must not be empty",
                self.request_id
            ));
        }
        if self.max_tokens == 0 && self.streaming {
            // S20: a prefill-only request ends with its prompt; a session's
            // segments each generate.
            return bad(format!(
                "request {:?}: max_tokens (0) must be at least 1 for a streaming session",
                self.request_id
            ));
        }
        if self.min_tokens > self.max_tokens {
            return bad(format!(
                "request {:?}: min_tokens ({}) must be less than or equal to max_tokens ({})",
                self.request_id, self.min_tokens, self.max_tokens
            ));
        }
        if !self.arrival_time.is_finite() {
            return bad(format!(
                "request {:?}: arrival_time ({}) must be finite",
                self.request_id, self.arrival_time
            ));
        }
        Ok(())
    }
}

/// How far a request has got: what the running phase of every step reads,
/// and (with the token appended) what `update_from_output` changes. The
/// scheduler keeps it in its slab entry beside the boxed [`Request`] rather
/// than in it (24 bytes; with the box pointer, half a cache line): the
/// running loop of a step then never reads the request itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// `Request::num_tokens()`: prompt, outputs and streamed input. Kept
    /// equal by the scheduler wherever it appends tokens (checked by S16).
    pub num_tokens: usize,
    pub num_computed_tokens: usize,
    /// Sampled token outputs not yet returned (async scheduling
    /// placeholders): at most one per step in flight.
    pub num_output_placeholders: u32,
    /// `num_computed_tokens < num_tokens` as of the last time it was scheduled.
    pub is_prefill_chunk: bool,
    /// S20: `max_tokens == 0`, a request that ends once its prompt is
    /// computed and never samples.
    pub prefill_only: bool,
}

impl Progress {
    /// A request that has computed nothing yet.
    pub fn new(num_tokens: usize, prefill_only: bool) -> Self {
        Progress {
            num_tokens,
            prefill_only,
            ..Default::default()
        }
    }
}

/// Fields are laid out by temperature (`repr(C)`, cache-line aligned): the
/// first two 64-byte lines hold everything `update_from_output()` reads for a
/// running request in an ordinary step (line 1: the token array and the
/// length and EOS checks; line 2: stop tokens, the reported prefix hit,
/// drafts). What the running phase reads is the request's [`Progress`], kept
/// beside it in the scheduler's slab. The scheduler keeps requests boxed so
/// that its slab's `Option` test reads the pointer, not a field of a cold
/// line.
/// `hot_fields_fit_in_two_cache_lines` guards the layout.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Request {
    // --- line 1: the token array and the length and EOS checks ---
    /// Prompt followed by outputs; a streaming session appends new input too.
    pub token_ids: Vec<u32>,
    /// Outputs of the current generation segment (the whole request unless streaming).
    pub num_output_tokens: usize,
    pub max_tokens: usize,
    /// Read only when a stop token matches.
    pub min_tokens: usize,
    pub eos_token_id: Option<u32>,
    pub handle: Handle,
    pub status: RequestStatus,
    pub ignore_eos: bool,
    /// Set while a streaming session accepts more input (S15).
    pub streaming: bool,
    // --- line 2: stop tokens, the reported prefix hit, drafts ---
    pub stop_token_ids: Box<[u32]>,
    /// Prefix-cache hit of the first admission; `None` until admitted.
    pub num_cached_tokens: Option<usize>,
    /// Draft tokens proposed for the next step (speculative decoding);
    /// always empty when `num_speculative_tokens` is 0.
    pub spec_token_ids: Vec<u32>,
    // --- read when a block fills, or at admission ---
    /// Chained hashes of every full block of `token_ids` (S8).
    pub block_hashes: Vec<u64>,
    /// The parent hash of the first block (per LoRA adapter).
    pub hash_root: u64,
    pub priority: i64,
    pub arrival_time: f64,
    pub num_prompt_tokens: usize,
    pub lora_id: Option<u32>,
    pub num_preemptions: u32,
    /// Tokens that count as computed once an asynchronous remote KV load
    /// completes (local prefix hit + remote tokens).
    pub num_loaded_tokens: usize,
    pub first_scheduled: bool,
    /// Skipped by the waiting phase (S7) and not admitted since (vLLM's
    /// `deferred_waiting` set; S12 does not count it as capacity-bound).
    pub deferred: bool,
    /// S19: admissions take no prefix-cache hit and no connector tokens.
    pub skip_reading_prefix_cache: bool,
    // --- cold ---
    pub request_id: String,
    /// Input that arrived for a streaming session while it was still generating.
    pub pending_stream_inputs: std::collections::VecDeque<StreamInput>,
    pub ignore_reason: Option<String>,
}

/// One more piece of input for a streaming session.
#[derive(Debug, Clone)]
pub struct StreamInput {
    pub token_ids: Vec<u32>,
    pub max_tokens: usize,
    /// The session ends after this segment.
    pub is_last: bool,
}

/// The arrays a request owns besides its tokens: empty for a new request,
/// cleared ones of a finished request when its box is recycled.
#[derive(Default)]
struct Buffers {
    block_hashes: Vec<u64>,
    spec_token_ids: Vec<u32>,
    pending_stream_inputs: std::collections::VecDeque<StreamInput>,
}

impl Request {
    pub fn from_new(new: NewRequest, handle: Handle, hasher: &BlockHasher) -> Self {
        Request::build(new, handle, hasher, Buffers::default())
    }

    /// Turns a request that has left the scheduler into `new`, as
    /// [`Self::from_new`] would build it, but in its allocations: its token
    /// and hash arrays are refilled instead of freed and allocated again.
    pub fn recycle(&mut self, new: NewRequest, handle: Handle, hasher: &BlockHasher) {
        let mut token_ids = std::mem::take(&mut self.token_ids);
        token_ids.clear();
        token_ids.extend_from_slice(&new.prompt_token_ids);
        let mut buffers = Buffers {
            block_hashes: std::mem::take(&mut self.block_hashes),
            spec_token_ids: std::mem::take(&mut self.spec_token_ids),
            pending_stream_inputs: std::mem::take(&mut self.pending_stream_inputs),
        };
        buffers.block_hashes.clear();
        buffers.spec_token_ids.clear();
        buffers.pending_stream_inputs.clear();
        let new = NewRequest {
            prompt_token_ids: token_ids,
            ..new
        };
        *self = Request::build(new, handle, hasher, buffers);
    }

    fn build(new: NewRequest, handle: Handle, hasher: &BlockHasher, buffers: Buffers) -> Self {
        let mut req = Request {
            request_id: new.request_id,
            handle,
            status: RequestStatus::Waiting,
            priority: new.priority,
            arrival_time: new.arrival_time,
            num_prompt_tokens: new.prompt_token_ids.len(),
            token_ids: new.prompt_token_ids,
            num_output_tokens: 0,
            spec_token_ids: buffers.spec_token_ids,
            max_tokens: new.max_tokens,
            min_tokens: new.min_tokens,
            eos_token_id: new.eos_token_id,
            stop_token_ids: new.stop_token_ids.into_boxed_slice(),
            ignore_eos: new.ignore_eos,
            lora_id: new.lora_id,
            block_hashes: buffers.block_hashes,
            hash_root: hasher.root(new.lora_id, new.cache_salt.as_deref()),
            num_preemptions: 0,
            num_cached_tokens: None,
            streaming: new.streaming,
            pending_stream_inputs: buffers.pending_stream_inputs,
            num_loaded_tokens: 0,
            first_scheduled: false,
            deferred: false,
            skip_reading_prefix_cache: new.skip_reading_prefix_cache,
            ignore_reason: None,
        };
        req.update_block_hashes(hasher);
        req
    }

    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    #[inline]
    pub fn num_tokens_with_spec(&self) -> usize {
        self.token_ids.len() + self.spec_token_ids.len()
    }

    #[inline]
    pub fn is_finished(&self) -> bool {
        self.status.is_finished()
    }

    /// Appends a sampled token and hashes the block it completes, if any.
    #[inline]
    pub fn append_output_token(&mut self, token: u32, hasher: &BlockHasher) {
        self.token_ids.push(token);
        self.num_output_tokens += 1;
        // Every full block is hashed as soon as it fills, so only a token that
        // ends a block can add one: the common case never reads `block_hashes`.
        if hasher.ends_block(self.token_ids.len()) {
            self.update_block_hashes(hasher);
        }
    }

    /// Appends new streaming input (S15) as a fresh generation segment.
    pub fn append_stream_input(&mut self, input: StreamInput, hasher: &BlockHasher) {
        self.token_ids.extend_from_slice(&input.token_ids);
        self.max_tokens = input.max_tokens;
        self.num_output_tokens = 0;
        if input.is_last {
            self.streaming = false;
        }
        self.update_block_hashes(hasher);
    }

    pub fn update_block_hashes(&mut self, hasher: &BlockHasher) {
        let bs = hasher.block_size();
        while (self.block_hashes.len() + 1) * bs <= self.token_ids.len() {
            let i = self.block_hashes.len();
            let parent = if i == 0 {
                self.hash_root
            } else {
                self.block_hashes[i - 1]
            };
            let h = hasher.hash_block(parent, &self.token_ids[i * bs..(i + 1) * bs]);
            self.block_hashes.push(h);
        }
    }

    /// S17 stop conditions for the token just appended, in vLLM's order:
    /// EOS and stop tokens (once `min_tokens` are out), then the length limits.
    #[inline]
    pub fn check_stop(&self, max_model_len: usize) -> Option<RequestStatus> {
        let last = *self.token_ids.last()?;
        self.check_stop_after(last, max_model_len)
    }

    /// [`Self::check_stop`] given the token just appended, which the caller
    /// has at hand (reading it back from `token_ids` waits on the store).
    #[inline]
    pub fn check_stop_after(&self, last: u32, max_model_len: usize) -> Option<RequestStatus> {
        debug_assert_eq!(self.token_ids.last(), Some(&last));
        // Cheapest tests first: most requests have no stop tokens (a scan
        // costs its setup even when empty), and `min_tokens` only matters
        // when the token is a stop token.
        let is_stop_token = (!self.ignore_eos && Some(last) == self.eos_token_id)
            || (!self.stop_token_ids.is_empty() && self.stop_token_ids.contains(&last));
        if is_stop_token && self.num_output_tokens >= self.min_tokens {
            return Some(RequestStatus::FinishedStopped);
        }
        if self.num_tokens() >= max_model_len || self.num_output_tokens >= self.max_tokens {
            return Some(RequestStatus::FinishedLengthCapped);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: Vec<u32>, max_tokens: usize) -> Request {
        let mut n = NewRequest::new("r", prompt, max_tokens);
        n.eos_token_id = Some(2);
        Request::from_new(n, 0, &BlockHasher::new(4))
    }

    #[test]
    fn s17_eos_on_last_allowed_token_reports_stop() {
        let mut r = req(vec![5, 6, 7], 1);
        r.append_output_token(2, &BlockHasher::new(4));
        assert_eq!(r.check_stop(100), Some(RequestStatus::FinishedStopped));
    }

    #[test]
    fn s17_max_tokens_and_max_model_len_report_length() {
        let h = BlockHasher::new(4);
        let mut r = req(vec![5, 6, 7], 2);
        r.append_output_token(9, &h);
        assert_eq!(r.check_stop(100), None);
        r.append_output_token(9, &h);
        assert_eq!(r.check_stop(100), Some(RequestStatus::FinishedLengthCapped));
        let mut r = req(vec![5, 6, 7], 10);
        r.append_output_token(9, &h);
        assert_eq!(r.check_stop(4), Some(RequestStatus::FinishedLengthCapped));
    }

    #[test]
    fn s17_min_tokens_defers_eos_and_ignore_eos_disables_it() {
        let h = BlockHasher::new(4);
        let mut r = req(vec![5], 10);
        r.min_tokens = 2;
        r.append_output_token(2, &h);
        assert_eq!(r.check_stop(100), None);
        r.append_output_token(2, &h);
        assert_eq!(r.check_stop(100), Some(RequestStatus::FinishedStopped));
        let mut r = req(vec![5], 10);
        r.ignore_eos = true;
        r.stop_token_ids = vec![8].into();
        r.append_output_token(2, &h);
        assert_eq!(r.check_stop(100), None);
        r.append_output_token(8, &h);
        assert_eq!(r.check_stop(100), Some(RequestStatus::FinishedStopped));
    }

    #[test]
    fn s8_block_hashes_cover_full_blocks_of_prompt_and_outputs() {
        let h = BlockHasher::new(4);
        let mut r = req(vec![1, 2, 3, 4, 5, 6, 7], 10);
        assert_eq!(r.block_hashes.len(), 1);
        r.append_output_token(8, &h);
        assert_eq!(r.block_hashes.len(), 2);
        assert_eq!(
            r.block_hashes[1],
            h.hash_block(r.block_hashes[0], &[5, 6, 7, 8])
        );
    }

    #[test]
    fn a_recycled_request_is_the_new_request_built_afresh() {
        let h = BlockHasher::new(4);
        let mut old = req(vec![1, 2, 3, 4, 5, 6, 7, 8, 9], 10);
        old.append_output_token(2, &h);
        old.spec_token_ids = vec![5];
        old.ignore_reason = Some("x".into());
        let mut new = NewRequest::new("b", vec![4, 3, 2, 1, 0], 3);
        new.stop_token_ids = vec![9];
        new.lora_id = Some(1);
        old.recycle(new.clone(), 7, &h);
        assert_eq!(
            format!("{old:?}"),
            format!("{:?}", Request::from_new(new, 7, &h))
        );
    }

    #[test]
    fn s4_finished_states_sort_after_live_ones() {
        assert!(!RequestStatus::Preempted.is_finished());
        assert!(RequestStatus::FinishedIgnored.is_finished());
        assert!(RequestStatus::FinishedStopped > RequestStatus::Running);
    }

    #[test]
    fn hot_fields_fit_in_two_cache_lines() {
        use std::mem::{offset_of, size_of};
        let end_of_line_2 = offset_of!(Request, spec_token_ids) + size_of::<Vec<u32>>();
        assert!(end_of_line_2 <= 128, "line 2 ends at byte {end_of_line_2}");
        assert_eq!(offset_of!(Request, stop_token_ids), 64, "line 1 is full");
    }

    #[test]
    fn progress_leaves_room_for_a_box_pointer_in_half_a_cache_line() {
        assert_eq!(std::mem::size_of::<Progress>(), 24);
    }
}
