//! KV connectors: where prompt KV can come from besides the local prefix
//! cache (a remote store, another instance). The scheduler asks a connector
//! at admission and skips requests whose load is still in flight (S7).
//!
//! [`TestConnector`] simulates a store inside the scheduler (tests,
//! conformance). [`EngineConnector`] is driven by the engine, which owns the
//! real store: it says which prompt prefixes the store holds, receives the
//! loads the scheduler starts (blocks to fill, with their prefix-cache
//! hashes), and reports each load finished or failed before the next step.

use std::any::Any;
use std::collections::HashMap;

use crate::request::{Handle, Request};

/// An asynchronous load the scheduler started: fill `block_ids` (the
/// request's blocks `first_block..`) with the KV cached under `block_hashes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLoad {
    /// Names this load in [`EngineConnector::finish_load`]; never reused, so
    /// a late report about an aborted request's load cannot hit a new one.
    pub load_id: u64,
    pub handle: Handle,
    /// Index of the first loaded block in the request's block table.
    pub first_block: usize,
    pub block_ids: Vec<u32>,
    pub block_hashes: Vec<u64>,
}

pub trait KvConnector: Any + Send + Sync {
    /// Tokens beyond the local hit (`num_computed_tokens`) that can be
    /// loaded, and whether the load completes asynchronously.
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed_tokens: usize,
    ) -> (usize, bool);
    /// Called when an asynchronous load has been given its blocks.
    fn start_load(&mut self, load: KvLoad);
    /// Called once at the start of every `schedule()`.
    fn on_step(&mut self);
    /// Whether the asynchronous load of `handle` has completed.
    fn is_load_done(&self, handle: Handle) -> bool;
    /// The request is gone (finished, aborted), or gave its KV back while
    /// loading; forget it and its load.
    fn request_finished(&mut self, handle: Handle);
    /// For [`crate::Scheduler::engine_connector_mut`].
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A connector for tests: every request has up to `num_external_tokens`
/// tokens "remotely" available (whole blocks, never the last token), loaded
/// asynchronously in `ready_after_steps` scheduler steps.
#[derive(Debug)]
pub struct TestConnector {
    pub num_external_tokens: usize,
    pub ready_after_steps: u32,
    block_size: usize,
    loads: HashMap<Handle, u32>,
}

impl TestConnector {
    pub fn new(num_external_tokens: usize, ready_after_steps: u32, block_size: usize) -> Self {
        TestConnector {
            num_external_tokens,
            ready_after_steps,
            block_size,
            loads: HashMap::new(),
        }
    }
}

impl KvConnector for TestConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed_tokens: usize,
    ) -> (usize, bool) {
        let available = self.num_external_tokens.min(req.num_tokens() - 1);
        let whole = available / self.block_size * self.block_size;
        let n = whole.saturating_sub(num_computed_tokens);
        (n, n > 0)
    }

    fn start_load(&mut self, load: KvLoad) {
        self.loads.insert(load.handle, 0);
    }

    fn on_step(&mut self) {
        for steps in self.loads.values_mut() {
            *steps += 1;
        }
    }

    fn is_load_done(&self, handle: Handle) -> bool {
        self.loads
            .get(&handle)
            .is_some_and(|&s| s >= self.ready_after_steps)
    }

    fn request_finished(&mut self, handle: Handle) {
        self.loads.remove(&handle);
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Where one engine-driven load stands.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LoadState {
    load_id: u64,
    /// The blocks it fills, as indices into the request's block table.
    blocks: std::ops::Range<usize>,
    done: bool,
}

/// A connector whose store lives in the engine. The engine tells it, per
/// request, how many prompt tokens its store holds from the start
/// ([`Self::set_external_tokens`]); at admission the scheduler takes the
/// whole blocks of that past the local prefix-cache hit (never the last
/// token) and starts an asynchronous load ([`Self::take_started_loads`]);
/// the engine reports each load back ([`Self::finish_load`]).
#[derive(Debug)]
pub struct EngineConnector {
    block_size: usize,
    external: HashMap<Handle, usize>,
    loads: HashMap<Handle, LoadState>,
    started: Vec<KvLoad>,
}

impl EngineConnector {
    pub fn new(block_size: usize) -> Self {
        EngineConnector {
            block_size,
            external: HashMap::new(),
            loads: HashMap::new(),
            started: Vec::new(),
        }
    }

    /// The engine's store holds the KV of the first `num_tokens` prompt
    /// tokens of `handle` (rounded down to whole blocks when used).
    pub fn set_external_tokens(&mut self, handle: Handle, num_tokens: usize) {
        if num_tokens == 0 {
            self.external.remove(&handle);
        } else {
            self.external.insert(handle, num_tokens);
        }
    }

    /// Loads started since the last call, for the engine to run.
    pub fn take_started_loads(&mut self) -> Vec<KvLoad> {
        std::mem::take(&mut self.started)
    }

    /// If `load_id` is the unfinished load of `handle`: the blocks it fills
    /// (indices into the request's block table).
    pub fn live_load(&self, handle: Handle, load_id: u64) -> Option<std::ops::Range<usize>> {
        self.loads
            .get(&handle)
            .filter(|l| l.load_id == load_id && !l.done)
            .map(|l| l.blocks.clone())
    }

    /// Marks the load of `handle` done.
    pub(crate) fn mark_done(&mut self, handle: Handle) {
        if let Some(l) = self.loads.get_mut(&handle) {
            l.done = true;
        }
    }
}

impl KvConnector for EngineConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed_tokens: usize,
    ) -> (usize, bool) {
        let Some(&external) = self.external.get(&req.handle) else {
            return (0, false);
        };
        let available = external.min(req.num_tokens() - 1);
        let whole = available / self.block_size * self.block_size;
        let n = whole.saturating_sub(num_computed_tokens);
        (n, n > 0)
    }

    fn start_load(&mut self, load: KvLoad) {
        let state = LoadState {
            load_id: load.load_id,
            blocks: load.first_block..load.first_block + load.block_ids.len(),
            done: false,
        };
        self.loads.insert(load.handle, state);
        self.started.push(load);
    }

    fn on_step(&mut self) {}

    fn is_load_done(&self, handle: Handle) -> bool {
        self.loads.get(&handle).is_some_and(|l| l.done)
    }

    fn request_finished(&mut self, handle: Handle) {
        self.external.remove(&handle);
        self.loads.remove(&handle);
        self.started.retain(|l| l.handle != handle);
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
