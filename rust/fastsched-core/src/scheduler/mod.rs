//! The per-step scheduler (docs/design.md §5): one `schedule()` per forward pass,
//! `update_from_output()` with what the model sampled.
//!
//! Requests live in a slab indexed by [`Handle`]; queues and the running
//! list hold handles. A step first extends running requests (preempting on
//! KV shortage), then admits waiting ones while slots, budget and KV last.

mod ahead;
mod invariants;
mod kv_transfer;
mod running;
mod step;
mod streaming;
mod update;
mod waiting;

#[cfg(test)]
mod prefill_tests;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};

use crate::config::SchedulerConfig;
use crate::connector::KvConnector;
use crate::error::{Error, Result};
use crate::kv::{BlockHasher, KvCacheManager, KvEvents, PrefixCacheStats};
use crate::output::ScheduledKind;
use crate::queue::{new_queue, QueueEntry, RequestQueue};
use crate::request::{FinishReason, Handle, NewRequest, Progress, Request, RequestStatus};
use crate::telemetry::{GateCounters, SkipReason};

/// S13: what the engine is allowed to schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseState {
    Unpaused,
    /// Running and KV-holding waiting requests only.
    PausedNew,
    /// Nothing.
    PausedAll,
}

/// Counters and gauges for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_waiting_for_streaming_input: usize,
    pub kv_cache_usage: f64,
    pub num_free_blocks: usize,
    pub num_preemptions_total: u64,
    pub prefix_cache: PrefixCacheStats,
    pub num_steps: u64,
    /// Why each step's waiting scan stopped, why requests were skipped.
    pub gates: GateCounters,
}

/// One row of the step being built. The request itself is advanced when the
/// row is pushed (see `advance`), so building the output arrays at the end
/// of the step reads only these rows, never the requests again.
#[derive(Debug, Clone, Copy)]
struct Scheduled {
    handle: Handle,
    num_tokens: u32,
    num_computed_before: u32,
    num_cached_tokens: u32,
    num_spec: u32,
    /// Block ids this row appended to the step's `block_ids`: the new ones
    /// of a running request, the whole table of a new or resumed one.
    num_blocks: u32,
    kind: ScheduledKind,
    /// S12: a prefill chunk, or an admission with prefill work.
    carries_prefill: bool,
    /// The request samples a token this step (its prefill completes).
    samples: bool,
}

/// One handle's entry in the slab: the request's [`Progress`] beside the
/// box holding the rest of it, 32 bytes. The running loop reads only the
/// progress (half a cache line per request, never the request); the update
/// loop finds it in the line it reads the box pointer from. The request is
/// boxed: `Option<Request>` would keep its tag in a cold line of the request
/// (its largest niche), costing a cache miss per lookup. `progress` means
/// something only while `req` is `Some`.
#[derive(Debug, Default)]
struct Slot {
    progress: Progress,
    req: Option<Box<Request>>,
}

/// Released requests kept for reuse (see `Scheduler::spare_requests`): more
/// than a step's worth of finishes at large batch sizes.
const MAX_SPARE_REQUESTS: usize = 64;

/// Requests per warm-up pass of the running and update loops (see
/// `warm_rows`): enough for their cache misses to overlap, few enough that
/// the lines they bring in are still in the first-level cache when the loop
/// reaches them.
const WARM_CHUNK: usize = 32;

/// The part of a batch of `len` requests to warm when its loop reaches
/// position `i`: the first two chunks at the start, then at the start of
/// each chunk the one after it, so that its lines arrive while the loop
/// works on the current chunk.
fn warm_range(i: usize, len: usize) -> Option<std::ops::Range<usize>> {
    if i % WARM_CHUNK != 0 {
        return None;
    }
    let start = if i == 0 { 0 } else { i + WARM_CHUNK };
    let end = len.min(i + 2 * WARM_CHUNK);
    (start < end).then_some(start..end)
}

/// What `update_from_output` needs to remember of a step: its rows, as
/// built (the buffer moves here rather than being copied).
#[derive(Debug)]
struct InFlightStep {
    step_id: u64,
    rows: Vec<Scheduled>,
}

/// S12 bookkeeping.
#[derive(Debug)]
struct PrefillInterval {
    executed: i64,
    last_prefill: i64,
    capacity_bound: bool,
}

/// Which waiting queue a request was taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WhichQueue {
    KvHolding,
    Waiting,
}

/// What a step may still spend, and its per-step caps: one value both phases
/// of `schedule()` thread through.
#[derive(Debug, Clone, Copy)]
struct StepBudget {
    /// S1: compute tokens left (`max_num_scheduled_tokens`; drafts count).
    tokens: usize,
    /// S1: input tokens left (`max_num_batched_tokens`; drafts do not count).
    inputs: usize,
    /// S9: this step's cap on one request's tokens (0 = none).
    threshold: usize,
    /// S12: prefill work is held this step.
    defer: bool,
    /// S12: the running phase scheduled a prefill chunk this step (vLLM's
    /// `prefill_scheduled`). Never cleared: a chunk whose row a preemption
    /// takes back still counts.
    running_prefill: bool,
}

impl StepBudget {
    /// Charges a row of `n` tokens, `num_spec` of them drafts (or padding).
    #[inline]
    fn spend(&mut self, n: usize, num_spec: usize) {
        self.tokens -= n;
        self.inputs -= n - num_spec;
    }

    /// Gives back what a row taken back (S3) was charged.
    fn refund(&mut self, row: &Scheduled) {
        self.tokens += row.num_tokens as usize;
        self.inputs += (row.num_tokens - row.num_spec) as usize;
    }
}

/// Buffers a step reuses from one call to the next (cleared, never freed),
/// so that a step allocates little beyond its output arrays.
#[derive(Debug, Default)]
struct StepBuffers {
    /// A consumed step's rows, reused by the next step.
    spare_step: Option<InFlightStep>,
    /// Where a waiting request's allocation puts its new block ids (an
    /// admission sends its whole table instead).
    block_scratch: Vec<u32>,
    /// Block ids the last step sent: how many to make room for in the next.
    last_num_block_ids: usize,
    /// Running requests that stopped in this update; they leave `running`
    /// in one pass at its end.
    stopped: Vec<Handle>,
    /// By handle: set for the handles in `stopped` during that pass (a byte
    /// per handle: the pass tests each running request with one load).
    stopped_flags: Vec<bool>,
    /// Running requests of this step with newly full blocks to cache, and
    /// up to which token (see `cache_pending_blocks`).
    pending_caching: Vec<(Handle, usize)>,
    /// Requests the waiting phase of this step skipped (S7), and why.
    skips: Vec<(Handle, SkipReason)>,
    /// The LoRA adapters in the batch during a waiting phase (sorted).
    lora_set: Vec<u32>,
    /// Requests a waiting phase took out of their queue until its end (S7).
    deferred: Vec<(WhichQueue, QueueEntry)>,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    hasher: BlockHasher,
    kv: KvCacheManager,
    /// The slab, by handle.
    requests: Vec<Slot>,
    free_handles: Vec<Handle>,
    /// Released requests whose boxes and arrays the next `add_request`s
    /// refill (`Request::recycle`) rather than free and allocate again: a
    /// step's finished requests are then released without a call to the
    /// allocator. At most `MAX_SPARE_REQUESTS`. Boxed on purpose: the boxes
    /// move between here and the slab as pointers and are reused too.
    #[allow(clippy::vec_box)]
    spare_requests: Vec<Box<Request>>,
    ids: HashMap<String, Handle>,
    waiting: Box<dyn RequestQueue>,
    /// Waiting requests that already hold KV blocks (remote loads, streaming
    /// sessions with new input); served before `waiting` (S6).
    kv_holding: Box<dyn RequestQueue>,
    running: Vec<Handle>,
    num_waiting_for_streaming_input: usize,
    /// Live requests with `Request::deferred` set (S12 capacity escape).
    num_deferred_waiting: usize,
    /// Finished, aborted or ignored since the last `schedule()`.
    finished_since_schedule: Vec<Handle>,
    /// Reported finished by the `schedule()` of the given step; released once
    /// that step and every earlier one has been consumed.
    to_release: Vec<(u64, Handle)>,
    /// Requests finished by the scheduler itself (ignored, or unable to
    /// ever grow again), whose output the next update emits.
    pending_finished: Vec<(Handle, FinishReason)>,
    in_flight: VecDeque<InFlightStep>,
    pause: PauseState,
    connector: Option<Box<dyn KvConnector>>,
    /// The id of the next remote load started (`KvLoad::load_id`).
    next_load_id: u64,
    async_scheduling: bool,
    interval: PrefillInterval,
    next_step_id: u64,
    num_preemptions_total: u64,
    gates: GateCounters,
    bufs: StepBuffers,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        cfg.validate()?;
        let interval = PrefillInterval {
            executed: 0,
            last_prefill: -(cfg.prefill_schedule_interval as i64),
            capacity_bound: false,
        };
        Ok(Scheduler {
            hasher: BlockHasher::with_algo(cfg.block_size, cfg.prefix_caching_hash_algo),
            kv: KvCacheManager::new(
                cfg.num_gpu_blocks,
                cfg.block_size,
                cfg.max_model_len,
                cfg.enable_prefix_caching,
            ),
            requests: Vec::new(),
            free_handles: Vec::new(),
            spare_requests: Vec::new(),
            ids: HashMap::new(),
            waiting: new_queue(cfg.policy),
            kv_holding: new_queue(cfg.policy),
            running: Vec::new(),
            num_waiting_for_streaming_input: 0,
            num_deferred_waiting: 0,
            finished_since_schedule: Vec::new(),
            to_release: Vec::new(),
            pending_finished: Vec::new(),
            in_flight: VecDeque::new(),
            pause: PauseState::Unpaused,
            connector: None,
            next_load_id: 0,
            async_scheduling: false,
            interval,
            next_step_id: 0,
            num_preemptions_total: 0,
            gates: GateCounters::default(),
            bufs: StepBuffers::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn set_connector(&mut self, connector: Box<dyn KvConnector>) {
        self.connector = Some(connector);
    }

    /// With async scheduling the next step is scheduled before the previous
    /// step's tokens are known: a decode's next token is a placeholder.
    pub fn set_async_scheduling(&mut self, on: bool) {
        self.async_scheduling = on;
    }

    pub fn set_pause_state(&mut self, state: PauseState) {
        self.pause = state;
    }

    pub fn pause_state(&self) -> PauseState {
        self.pause
    }

    /// Drops the prefix cache (S8), e.g. after a weight reload: no block
    /// computed so far is a prefix hit again. Requests keep their blocks.
    pub fn reset_prefix_cache(&mut self) {
        self.kv.pool.reset_prefix_cache();
    }

    /// Starts (or stops) recording the block hashes that enter and leave the
    /// prefix cache (S8), for a frontend that routes by prefix.
    pub fn record_kv_events(&mut self, on: bool) {
        self.kv.pool.record_events(on);
    }

    /// The hashes cached and evicted since the last call.
    pub fn take_kv_events(&mut self) -> KvEvents {
        self.kv.pool.take_events()
    }

    /// The prefix-cache hashes of the full blocks of `token_ids`, as this
    /// scheduler would compute them for a request with this adapter and salt.
    pub fn prompt_block_hashes(
        &self,
        token_ids: &[u32],
        lora_id: Option<u32>,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        self.hasher.prompt_hashes(token_ids, lora_id, cache_salt)
    }

    // ----------------------------------------------------------------- requests

    /// Adds a request to the waiting queue. A prompt that can never run
    /// (S4: longer than `max_model_len` or than the whole KV pool) is
    /// finished as ignored at once, with the reason in [`Self::ignore_reason`].
    pub fn add_request(&mut self, new: NewRequest) -> Result<Handle> {
        new.validate()?;
        if self.ids.contains_key(&new.request_id) {
            return Err(Error::DuplicateRequest(new.request_id));
        }
        let handle = match self.free_handles.pop() {
            Some(h) => h,
            None => {
                self.requests.push(Slot::default());
                (self.requests.len() - 1) as Handle
            }
        };
        let mut req = match self.spare_requests.pop() {
            Some(mut req) => {
                req.recycle(new, handle, &self.hasher);
                req
            }
            None => Box::new(Request::from_new(new, handle, &self.hasher)),
        };
        self.requests[handle as usize].progress =
            Progress::new(req.num_tokens(), req.max_tokens == 0);
        // Room for every output (and its block hash) up front: appending a
        // token never reallocates.
        let room = req
            .max_tokens
            .min(self.cfg.max_model_len.saturating_sub(req.num_prompt_tokens));
        req.token_ids
            .reserve_exact(room + self.cfg.num_speculative_tokens);
        let max_blocks = (req.num_prompt_tokens + room) / self.cfg.block_size;
        req.block_hashes
            .reserve_exact(max_blocks - req.block_hashes.len());
        self.ids.insert(req.request_id.clone(), handle);
        if let Some(reason) = self.never_fits(&req) {
            req.status = RequestStatus::FinishedIgnored;
            req.ignore_reason = Some(reason);
            self.ids.remove(&req.request_id);
            self.finished_since_schedule.push(handle);
            self.pending_finished.push((handle, FinishReason::Ignored));
        } else {
            self.waiting.push(QueueEntry::of(&req));
        }
        self.requests[handle as usize].req = Some(req);
        Ok(handle)
    }

    fn never_fits(&self, req: &Request) -> Option<String> {
        let n = req.num_prompt_tokens;
        if n >= self.cfg.max_model_len {
            return Some(format!(
                "prompt of {n} tokens leaves no room to generate within max_model_len ({})",
                self.cfg.max_model_len
            ));
        }
        let blocks = self.kv_blocks_needed(n);
        let usable = self.kv.pool.num_usable_blocks();
        if blocks > usable {
            return Some(format!(
                "prompt of {n} tokens needs {blocks} KV blocks but the whole pool has {usable} ({} tokens)",
                usable * self.cfg.block_size
            ));
        }
        None
    }

    /// Blocks a sequence of `num_tokens` needs to be computed, with its
    /// drafts and lookahead slots.
    fn kv_blocks_needed(&self, num_tokens: usize) -> usize {
        let slots = (num_tokens + self.cfg.num_speculative_tokens + self.cfg.num_lookahead_tokens)
            .min(self.cfg.max_model_len);
        self.kv.blocks_for(slots)
    }

    pub fn handle_of(&self, request_id: &str) -> Option<Handle> {
        self.ids.get(request_id).copied()
    }

    pub fn request(&self, handle: Handle) -> Option<&Request> {
        self.requests.get(handle as usize)?.req.as_deref()
    }

    fn req(&self, h: Handle) -> &Request {
        self.requests[h as usize].req.as_ref().expect("live handle")
    }

    fn req_mut(&mut self, h: Handle) -> &mut Request {
        self.requests[h as usize].req.as_mut().expect("live handle")
    }

    /// How far a request has got (see [`Progress`]).
    pub fn progress(&self, handle: Handle) -> Option<&Progress> {
        let slot = self.requests.get(handle as usize)?;
        slot.req.as_ref().map(|_| &slot.progress)
    }

    pub fn ignore_reason(&self, handle: Handle) -> Option<&str> {
        self.request(handle)?.ignore_reason.as_deref()
    }

    pub fn blocks_of(&self, handle: Handle) -> &[u32] {
        self.kv.blocks(handle)
    }

    /// S18: aborts a live request, freeing its blocks at once. Returns its
    /// status just before the abort, or `None` for unknown or finished ids.
    pub fn abort_request(&mut self, request_id: &str) -> Option<RequestStatus> {
        let h = *self.ids.get(request_id)?;
        let status = self.req(h).status;
        match status {
            RequestStatus::Running => {
                if let Some(i) = self.running.iter().position(|&x| x == h) {
                    self.running.remove(i);
                }
            }
            RequestStatus::Waiting
            | RequestStatus::Preempted
            | RequestStatus::WaitingForRemoteKvs => {
                if !self.waiting.remove(h) {
                    self.kv_holding.remove(h);
                }
            }
            RequestStatus::WaitingForStreamingReq => self.num_waiting_for_streaming_input -= 1,
            _ => return None,
        }
        self.finish(h, RequestStatus::FinishedAborted);
        Some(status)
    }

    /// Ends a request: frees its blocks now and reports it to the runner at
    /// the next `schedule()`.
    fn finish(&mut self, h: Handle, status: RequestStatus) {
        let req = self.requests[h as usize].req.as_mut().expect("live handle");
        req.status = status;
        if std::mem::take(&mut req.deferred) {
            self.num_deferred_waiting -= 1;
        }
        // One hash of the id, not two: it maps to another handle only if a
        // request with the same id was added after this one left `ids`.
        if let Some((id, other)) = self.ids.remove_entry(&req.request_id) {
            if other != h {
                self.ids.insert(id, other);
            }
        }
        self.kv.free(h);
        if let Some(c) = self.connector.as_mut() {
            c.request_finished(h);
        }
        self.finished_since_schedule.push(h);
    }

    // ----------------------------------------------------------------- queries

    /// S18: whether `schedule()` should be called: any request the pause
    /// state lets run (S13: all of them when unpaused, the running and
    /// KV-holding ones under PAUSED_NEW, none under PAUSED_ALL), or any
    /// finish/abort not yet reported.
    pub fn has_requests(&self) -> bool {
        let schedulable = match self.pause {
            PauseState::Unpaused => {
                !self.running.is_empty() || !self.waiting.is_empty() || !self.kv_holding.is_empty()
            }
            PauseState::PausedNew => !self.running.is_empty() || !self.kv_holding.is_empty(),
            PauseState::PausedAll => false,
        };
        schedulable || !self.finished_since_schedule.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Waiting requests, preempted and KV-holding ones included.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.kv_holding.len()
    }

    pub fn num_waiting_for_streaming_input(&self) -> usize {
        self.num_waiting_for_streaming_input
    }

    pub fn running(&self) -> &[Handle] {
        &self.running
    }

    pub fn waiting_order(&self) -> Vec<Handle> {
        let mut v = self.kv_holding.ordered();
        v.extend(self.waiting.ordered());
        v
    }

    pub fn num_free_blocks(&self) -> usize {
        self.kv.num_free_blocks()
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.num_waiting(),
            num_waiting_for_streaming_input: self.num_waiting_for_streaming_input,
            kv_cache_usage: self.kv.usage(),
            num_free_blocks: self.kv.num_free_blocks(),
            num_preemptions_total: self.num_preemptions_total,
            prefix_cache: self.kv.stats,
            num_steps: self.next_step_id,
            gates: self.gates,
        }
    }

    /// Live requests by handle (tests and invariant checks).
    pub fn live_requests(&self) -> impl Iterator<Item = &Request> {
        self.requests
            .iter()
            .filter_map(|slot| slot.req.as_ref())
            .map(|r| &**r)
            .filter(|r| !r.is_finished())
    }
}
