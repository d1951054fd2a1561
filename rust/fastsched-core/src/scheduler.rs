//! The per-step scheduler (DESIGN §5): one `schedule()` per forward pass,
//! `update_from_output()` with what the model sampled.
//!
//! Requests live in a slab indexed by [`Handle`]; queues and the running
//! list hold handles. A step first extends running requests (preempting on
//! KV shortage), then admits waiting ones while slots, budget and KV last.

use std::collections::{HashMap, VecDeque};

use crate::config::{Policy, SchedulerConfig};
use crate::connector::KvConnector;
use crate::error::{Error, Result};
use crate::kv::manager::AllocRequest;
use crate::kv::{BlockHasher, CacheHit, KvCacheManager, PrefixCacheStats};
use crate::output::{EngineCoreOutputs, ModelRunnerOutput, ScheduledKind, SchedulerOutput};
use crate::queue::{new_queue, QueueEntry, RequestQueue};
use crate::request::{FinishReason, Handle, NewRequest, Request, RequestStatus, StreamInput};
use crate::telemetry::{GateCounters, ScanStop, SkipReason};

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

/// What `update_from_output` needs to remember of a step, one row per
/// scheduled request (read together, so kept together).
#[derive(Debug)]
struct InFlightStep {
    step_id: u64,
    rows: Vec<InFlightRow>,
}

#[derive(Debug, Clone, Copy)]
struct InFlightRow {
    handle: Handle,
    num_spec: u32,
    samples: bool,
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

pub struct Scheduler {
    cfg: SchedulerConfig,
    hasher: BlockHasher,
    kv: KvCacheManager,
    /// Boxed: `Option<Request>` would keep its tag in a cold line of the
    /// request (its largest niche), costing a cache miss per lookup.
    requests: Vec<Option<Box<Request>>>,
    free_handles: Vec<Handle>,
    ids: HashMap<String, Handle>,
    waiting: Box<dyn RequestQueue>,
    /// Waiting requests that already hold KV blocks (remote loads, streaming
    /// sessions with new input); served before `waiting` (S6).
    kv_holding: Box<dyn RequestQueue>,
    running: Vec<Handle>,
    num_waiting_for_streaming_input: usize,
    /// Finished, aborted or ignored since the last `schedule()`.
    finished_since_schedule: Vec<Handle>,
    /// Reported finished by the `schedule()` of the given step; released once
    /// that step and every earlier one has been consumed.
    to_release: Vec<(u64, Handle)>,
    /// Requests finished by the scheduler itself (ignored, or unable to
    /// ever grow again), whose output the next update emits.
    pending_finished: Vec<(Handle, FinishReason)>,
    in_flight: VecDeque<InFlightStep>,
    /// A consumed step's buffers, reused by the next one.
    spare_step: Option<InFlightStep>,
    pause: PauseState,
    connector: Option<Box<dyn KvConnector>>,
    async_scheduling: bool,
    interval: PrefillInterval,
    next_step_id: u64,
    num_preemptions_total: u64,
    gates: GateCounters,
    // Reused per-step buffers.
    scheduled: Vec<Scheduled>,
    block_scratch: Vec<u32>,
    /// Running requests that stopped in this update; they leave `running`
    /// in one pass at its end.
    stopped: Vec<Handle>,
    /// Running requests of this step with newly full blocks to cache, and
    /// up to which token (see `cache_pending_blocks`).
    pending_caching: Vec<(Handle, usize)>,
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
            hasher: BlockHasher::new(cfg.block_size),
            kv: KvCacheManager::new(
                cfg.num_gpu_blocks,
                cfg.block_size,
                cfg.max_model_len,
                cfg.enable_prefix_caching,
            ),
            requests: Vec::new(),
            free_handles: Vec::new(),
            ids: HashMap::new(),
            waiting: new_queue(cfg.policy),
            kv_holding: new_queue(cfg.policy),
            running: Vec::new(),
            num_waiting_for_streaming_input: 0,
            finished_since_schedule: Vec::new(),
            to_release: Vec::new(),
            pending_finished: Vec::new(),
            in_flight: VecDeque::new(),
            spare_step: None,
            pause: PauseState::Unpaused,
            connector: None,
            async_scheduling: false,
            interval,
            next_step_id: 0,
            num_preemptions_total: 0,
            gates: GateCounters::default(),
            scheduled: Vec::new(),
            block_scratch: Vec::new(),
            stopped: Vec::new(),
            pending_caching: Vec::new(),
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
                self.requests.push(None);
                (self.requests.len() - 1) as Handle
            }
        };
        let mut req = Request::from_new(new, handle, &self.hasher);
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
        self.requests[handle as usize] = Some(Box::new(req));
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

    /// Blocks a sequence of `num_tokens` needs to be computed, draft slots included.
    fn kv_blocks_needed(&self, num_tokens: usize) -> usize {
        let slots = (num_tokens + self.cfg.num_speculative_tokens).min(self.cfg.max_model_len);
        self.kv.blocks_for(slots)
    }

    pub fn handle_of(&self, request_id: &str) -> Option<Handle> {
        self.ids.get(request_id).copied()
    }

    pub fn request(&self, handle: Handle) -> Option<&Request> {
        self.requests.get(handle as usize)?.as_deref()
    }

    fn req(&self, h: Handle) -> &Request {
        self.requests[h as usize].as_ref().expect("live handle")
    }

    fn req_mut(&mut self, h: Handle) -> &mut Request {
        self.requests[h as usize].as_mut().expect("live handle")
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
        let req = self.requests[h as usize].as_mut().expect("live handle");
        req.status = status;
        if self.ids.get(&req.request_id) == Some(&h) {
            self.ids.remove(&req.request_id);
        }
        self.kv.free(h);
        if let Some(c) = self.connector.as_mut() {
            c.request_finished(h);
        }
        self.finished_since_schedule.push(h);
    }

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
        let req = self.req_mut(h);
        req.append_stream_input(input, &hasher);
        req.status = RequestStatus::Waiting;
        let entry = QueueEntry::of(req);
        self.kv_holding.push(entry);
    }

    // ----------------------------------------------------------------- queries

    /// S18: whether `schedule()` should be called: any request waiting or
    /// running, or any finish/abort not yet reported.
    pub fn has_requests(&self) -> bool {
        !self.running.is_empty()
            || !self.waiting.is_empty()
            || !self.kv_holding.is_empty()
            || !self.finished_since_schedule.is_empty()
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
            .flatten()
            .map(|r| &**r)
            .filter(|r| !r.is_finished())
    }

    /// S16: every live request is in exactly one place, and the block pool's
    /// accounting holds (free + referenced = pool, held blocks referenced).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.kv.pool.check_invariants()?;
        let mut place: HashMap<Handle, &'static str> = HashMap::new();
        let mut put = |h: Handle, where_: &'static str| match place.insert(h, where_) {
            Some(prev) => Err(format!("request handle {h} is both in {prev} and {where_}")),
            None => Ok(()),
        };
        for &h in &self.running {
            put(h, "running")?;
        }
        for h in self.waiting.ordered() {
            put(h, "waiting")?;
        }
        for h in self.kv_holding.ordered() {
            put(h, "kv_holding")?;
        }
        let mut streaming = 0;
        for r in self.live_requests() {
            let expected = match r.status {
                RequestStatus::Running => "running",
                RequestStatus::Waiting
                | RequestStatus::Preempted
                | RequestStatus::WaitingForRemoteKvs => {
                    if place.get(&r.handle) == Some(&"kv_holding") {
                        "kv_holding"
                    } else {
                        "waiting"
                    }
                }
                RequestStatus::WaitingForStreamingReq => {
                    streaming += 1;
                    "streaming"
                }
                _ => unreachable!("live requests are not finished"),
            };
            let actual = place.get(&r.handle).copied().unwrap_or("streaming");
            if actual != expected {
                return Err(format!(
                    "request {:?} has status {} but sits in {actual}",
                    r.request_id,
                    r.status.as_str()
                ));
            }
            if r.status != RequestStatus::Running
                && r.status != RequestStatus::WaitingForStreamingReq
                && !self.kv.blocks(r.handle).is_empty()
                && actual != "kv_holding"
            {
                return Err(format!("waiting request {:?} holds blocks", r.request_id));
            }
            for &b in self.kv.blocks(r.handle) {
                if self.kv.pool.ref_cnt(b) == 0 {
                    return Err(format!(
                        "request {:?} holds unreferenced block {b}",
                        r.request_id
                    ));
                }
            }
        }
        if place.len() + streaming != self.live_requests().count() {
            return Err("a queued handle is not a live request".into());
        }
        if streaming != self.num_waiting_for_streaming_input {
            return Err(format!(
                "{streaming} sessions wait for input but the counter says {}",
                self.num_waiting_for_streaming_input
            ));
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running requests exceed max_num_seqs ({})",
                self.running.len(),
                self.cfg.max_num_seqs
            ));
        }
        Ok(())
    }

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
            && self.running.iter().any(|&h| !self.req(h).is_prefill_chunk)
    }

    pub fn schedule(&mut self) -> SchedulerOutput {
        let oldest_in_flight = self.in_flight.front().map_or(u64::MAX, |s| s.step_id);
        let (requests, free_handles) = (&mut self.requests, &mut self.free_handles);
        self.to_release.retain(|&(step, h)| {
            let done = step < oldest_in_flight;
            if done {
                requests[h as usize] = None;
                free_handles.push(h);
            }
            !done
        });
        if let Some(c) = self.connector.as_mut() {
            c.on_step();
        }
        let mut out = SchedulerOutput {
            step_id: self.next_step_id,
            ..Default::default()
        };
        self.next_step_id += 1;
        out.finished = std::mem::take(&mut self.finished_since_schedule);
        self.to_release
            .extend(out.finished.iter().map(|&h| (out.step_id, h)));

        let mut token_budget = if self.pause == PauseState::PausedAll {
            0
        } else {
            self.cfg.max_num_scheduled_tokens()
        };
        let mut input_budget = self.cfg.max_num_batched_tokens;
        let threshold = self.effective_long_prefill_threshold();
        let defer = self.prefill_deferred();
        let lookahead = self.cfg.num_speculative_tokens;
        let async_scheduling = self.async_scheduling;
        let mut scheduled = std::mem::take(&mut self.scheduled);
        scheduled.clear();

        // S2/S3: running requests first.
        let mut i = 0;
        'running: while i < self.running.len() && token_budget > 0 {
            let h = self.running[i];
            let req = self.req(h);
            if defer && req.is_prefill_chunk {
                i += 1;
                continue;
            }
            // S1: drafts use compute budget (token_budget) but no input budget.
            let real = req.num_tokens() + req.num_output_placeholders - req.num_computed_tokens;
            let mut n = real + req.spec_token_ids.len();
            if threshold > 0 && n > threshold {
                n = threshold;
            }
            n = n
                .min(token_budget)
                .min((self.cfg.max_model_len - 1).saturating_sub(req.num_computed_tokens));
            if n.min(real) > input_budget {
                n = input_budget;
            }
            if n == 0 {
                i += 1;
                continue;
            }
            // A running request's row sends only its new blocks, which
            // `allocate_slots` appends to the step's block ids.
            let blocks_before = loop {
                let alloc = AllocRequest {
                    num_new_tokens: n,
                    num_lookahead_tokens: lookahead,
                    delay_cache: true,
                    ..Default::default()
                };
                let req = self.requests[h as usize].as_ref().expect("live handle");
                let blocks_before = out.block_ids.len();
                if self
                    .kv
                    .allocate_slots(req, alloc, None, &mut out.block_ids)
                    .is_some()
                {
                    break blocks_before;
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
                        if let Some(j) = scheduled.iter().position(|s| s.handle == victim) {
                            let s = self.unschedule(&mut scheduled, j, &mut out.block_ids);
                            token_budget += s.num_tokens as usize;
                            input_budget += (s.num_tokens - s.num_spec) as usize;
                            i -= 1;
                        }
                        victim
                    }
                };
                // Freeing blocks must not overtake the caching of earlier rows'.
                self.cache_pending_blocks();
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == h {
                    match self.cfg.policy {
                        Policy::Fcfs => break 'running,
                        Policy::Priority => continue 'running,
                    }
                }
            };
            // Preempting others left this request as it was: `real` still holds.
            let num_spec = n.saturating_sub(real);
            let req = self.requests[h as usize]
                .as_deref_mut()
                .expect("live handle");
            // S8 caching at schedule time (Difference 3), batched: see
            // `cache_pending_blocks`.
            let cache_upto = (req.num_computed_tokens + n).min(req.num_tokens());
            if self.kv.has_blocks_to_cache(h, cache_upto) {
                self.pending_caching.push((h, cache_upto));
            }
            let row = Scheduled {
                handle: h,
                num_tokens: n as u32,
                num_computed_before: req.num_computed_tokens as u32,
                num_cached_tokens: 0,
                num_spec: num_spec as u32,
                num_blocks: (out.block_ids.len() - blocks_before) as u32,
                kind: ScheduledKind::Cached,
                carries_prefill: req.is_prefill_chunk,
                samples: false,
            };
            scheduled.push(advance(req, row, async_scheduling));
            token_budget -= n;
            input_budget -= n - num_spec;
            i += 1;
        }

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
            self.schedule_waiting(
                &mut scheduled,
                &mut out.block_ids,
                &mut token_budget,
                &mut input_budget,
                threshold,
                defer,
            )
        };
        self.gates.record_stop(stop);

        self.finish_step(&mut out, &scheduled);
        self.scheduled = scheduled;
        out
    }

    /// Caches the newly full blocks of this step's running rows, in row
    /// order, as `allocate_slots` would have done row by row. Done as one
    /// batch so that the cache misses of all those blocks (their records,
    /// index slots and token copies are cold) overlap instead of being paid
    /// one row at a time. Nothing between a row's allocation and this call
    /// reads or frees those blocks: they are held, lookups happen in the
    /// waiting phase, and a preemption calls this first.
    fn cache_pending_blocks(&mut self) {
        if self.pending_caching.is_empty() {
            return;
        }
        let requests = &self.requests;
        let req = |h: Handle| requests[h as usize].as_deref().expect("live handle");
        self.kv
            .warm_for_caching(self.pending_caching.iter().map(|&(h, upto)| (req(h), upto)));
        for &(h, upto) in &self.pending_caching {
            self.kv.cache_blocks(req(h), upto);
        }
        self.pending_caching.clear();
    }

    /// Takes back row `j` of the step being built (a priority victim that
    /// was already scheduled): undoes `advance` and drops its block ids.
    /// Rare, so the O(n) removals are fine.
    fn unschedule(
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
        let async_scheduling = self.async_scheduling;
        let req = self.req_mut(s.handle);
        req.num_computed_tokens = s.num_computed_before as usize;
        // A running row's `carries_prefill` is the flag as it was before.
        req.is_prefill_chunk = s.carries_prefill;
        if async_scheduling && s.samples {
            req.num_output_placeholders -= 1;
        }
        s
    }

    /// FCFS takes the last running request; priority the max of
    /// `(priority, arrival_time)` over the whole running list (first on ties).
    fn priority_victim_position(&self) -> usize {
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
    fn preempt(&mut self, h: Handle) {
        self.kv.free(h);
        let req = self.req_mut(h);
        debug_assert_eq!(req.status, RequestStatus::Running);
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.spec_token_ids.clear();
        req.num_preemptions += 1;
        let entry = QueueEntry::of(req);
        self.waiting.prepend(entry);
        self.num_preemptions_total += 1;
    }

    /// S6/S7/S10/S11: admits waiting requests; returns the gate that
    /// stopped the scan.
    fn schedule_waiting(
        &mut self,
        scheduled: &mut Vec<Scheduled>,
        block_ids: &mut Vec<u32>,
        token_budget: &mut usize,
        input_budget: &mut usize,
        threshold: usize,
        defer: bool,
    ) -> ScanStop {
        let draft_slots = self.cfg.num_speculative_tokens;
        let max_active = self.cfg.max_num_active_seqs();
        let watermark_blocks =
            (self.cfg.watermark * self.kv.pool.num_usable_blocks() as f64) as usize;
        let mut lora_set: Vec<u32> = if self.cfg.max_loras > 0 {
            let mut v: Vec<u32> = scheduled
                .iter()
                .filter_map(|s| self.req(s.handle).lora_id)
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        } else {
            Vec::new()
        };
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
            let req = self.requests[h as usize].as_ref().expect("live handle");
            if req.num_output_placeholders > 0 {
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
            if req.num_computed_tokens == 0 {
                let req = self.requests[h as usize].as_ref().expect("live handle");
                hit = self.kv.get_computed_blocks(req);
                if let Some(c) = self.connector.as_mut() {
                    (num_external, load_async) = c.get_num_new_matched_tokens(req, hit.num_tokens);
                    // The last token is always computed, whatever the connector offers.
                    num_external = num_external.min(req.num_tokens() - 1 - hit.num_tokens);
                    load_async &= num_external > 0;
                }
            }
            let req = self.requests[h as usize].as_ref().expect("live handle");
            let num_computed = req.num_computed_tokens + hit.num_tokens + num_external;
            let is_prefill_work = num_computed + 1 < req.num_tokens();
            if defer && is_prefill_work {
                break ScanStop::PrefillInterval;
            }
            let mut n = req.num_tokens() - num_computed;
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
            }
            let alloc = AllocRequest {
                num_new_tokens: n + num_external,
                num_lookahead_tokens: self.cfg.num_speculative_tokens,
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
            req.num_computed_tokens = num_computed;
            req.first_scheduled = true;
            if req.num_cached_tokens.is_none() {
                req.num_cached_tokens = Some(num_computed);
            }
            if let Some(lora) = req.lora_id {
                if let Err(pos) = lora_set.binary_search(&lora) {
                    lora_set.insert(pos, lora);
                }
            }
            let row = Scheduled {
                handle: h,
                num_tokens: n as u32,
                num_computed_before: num_computed as u32,
                num_cached_tokens: num_computed as u32,
                num_spec: 0,
                num_blocks,
                kind,
                carries_prefill: is_prefill_work,
                samples: false,
            };
            scheduled.push(advance(req, row, async_scheduling));
            *token_budget -= n;
            *input_budget -= n;
        };

        // S12 capacity escape: a release step that leaves requests waiting
        // (beyond those skipped for their own reasons) turns throttling off.
        if !defer && self.cfg.prefill_schedule_interval > 1 {
            self.interval.capacity_bound = self.num_waiting() > 0;
        }
        // S7: skipped requests go back to the head of their queue in order.
        let (kv_back, wait_back): (Vec<_>, Vec<_>) = deferred
            .into_iter()
            .partition(|(q, _)| *q == WhichQueue::KvHolding);
        self.kv_holding
            .prepend_all(kv_back.into_iter().map(|(_, e)| e).collect());
        self.waiting
            .prepend_all(wait_back.into_iter().map(|(_, e)| e).collect());
        stop
    }

    /// Frees the KV of a waiting request that holds some; it starts over
    /// like a preempted request.
    fn release_waiting_kv(&mut self, h: Handle) {
        self.kv_holding.remove(h);
        self.kv.free(h);
        if let Some(c) = self.connector.as_mut() {
            c.request_finished(h);
        }
        let req = self.req_mut(h);
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
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
        match which {
            WhichQueue::KvHolding => self.kv_holding.pop(),
            WhichQueue::Waiting => self.waiting.pop(),
        };
        deferred.push((which, QueueEntry::of(self.req(h))));
    }

    /// A remote load completed: the hit and the loaded tokens count as
    /// computed (never the last token, which must produce logits).
    fn finish_remote_load(&mut self, h: Handle) {
        let req = self.requests[h as usize].as_mut().expect("live handle");
        let computed = req.num_loaded_tokens.min(req.num_tokens() - 1);
        req.num_computed_tokens = computed;
        req.status = if req.num_preemptions > 0 {
            RequestStatus::Preempted
        } else {
            RequestStatus::Waiting
        };
        self.kv.cache_blocks(req, computed);
    }

    /// Fills the output arrays from the step's rows, does the S12
    /// bookkeeping, and records the step for `update_from_output`.
    fn finish_step(&mut self, out: &mut SchedulerOutput, scheduled: &[Scheduled]) {
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

        if out.total_num_scheduled_tokens > 0 {
            self.interval.executed += 1;
            // A refunded victim's chunk no longer counts as carried prefill.
            if scheduled.iter().any(|s| s.carries_prefill) {
                self.interval.last_prefill = self.interval.executed;
            }
        }
        let mut in_flight = self.spare_step.take().unwrap_or(InFlightStep {
            step_id: 0,
            rows: Vec::new(),
        });
        in_flight.step_id = out.step_id;
        in_flight.rows.clear();
        in_flight.rows.extend(scheduled.iter().map(|s| InFlightRow {
            handle: s.handle,
            num_spec: s.num_spec,
            samples: s.samples,
        }));
        self.in_flight.push_back(in_flight);
    }

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

    /// S15: a streaming session finished a segment. It keeps its blocks and
    /// runner slot; with input already pending it goes straight back to
    /// waiting, otherwise it waits for input.
    fn end_segment(&mut self, h: Handle) {
        match self.req(h).status {
            RequestStatus::Running => self.stopped.push(h),
            // Preempted while its last token was in flight (async scheduling).
            _ => {
                if !self.waiting.remove(h) {
                    self.kv_holding.remove(h);
                }
            }
        }
        let req = self.req_mut(h);
        req.status = RequestStatus::WaitingForStreamingReq;
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

/// vLLM's `_update_after_schedule` for one row, done as the row is pushed:
/// the scheduled tokens count as computed, and a request whose prefill
/// completes samples a token (under async scheduling, a placeholder for it).
/// `Scheduler::unschedule` undoes it.
#[inline]
fn advance(req: &mut Request, mut row: Scheduled, async_scheduling: bool) -> Scheduled {
    req.num_computed_tokens += row.num_tokens as usize;
    req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens() + req.num_output_placeholders;
    row.samples = !req.is_prefill_chunk;
    if async_scheduling && row.samples {
        req.num_output_placeholders += 1;
    }
    row
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

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
