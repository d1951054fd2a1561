//! KV connectors: where prompt KV can come from besides the local prefix
//! cache (a remote store, another instance). The scheduler asks a connector
//! at admission and skips requests whose load is still in flight (S7).

use std::collections::HashMap;

use crate::request::{Handle, Request};

pub trait KvConnector: Send + Sync {
    /// Tokens beyond the local hit (`num_computed_tokens`) that can be
    /// loaded, and whether the load completes asynchronously.
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed_tokens: usize,
    ) -> (usize, bool);
    /// Called when an asynchronous load for `handle` has been given its blocks.
    fn start_load(&mut self, handle: Handle);
    /// Called once at the start of every `schedule()`.
    fn on_step(&mut self);
    /// Whether the asynchronous load of `handle` has completed.
    fn is_load_done(&self, handle: Handle) -> bool;
    /// The request is gone (finished, aborted); forget it.
    fn request_finished(&mut self, handle: Handle);
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

    fn start_load(&mut self, handle: Handle) {
        self.loads.insert(handle, 0);
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
}
