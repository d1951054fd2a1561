//! The engine side of an [`EngineConnector`] (S7 `remote_kv`): what the
//! engine's store holds, the loads to run, their outcome, and the newly full
//! blocks to save.

use super::Scheduler;
use crate::connector::{EngineConnector, KvLoad};
use crate::error::{Error, Result};
use crate::request::{Handle, RequestStatus};

impl Scheduler {
    /// Installs an [`EngineConnector`] and records every block that becomes
    /// full and cached, so that the engine can save it.
    pub fn use_engine_connector(&mut self) {
        self.set_connector(Box::new(EngineConnector::new(self.cfg.block_size)));
        self.kv.record_cached_blocks(true);
    }

    fn engine_connector(&mut self) -> Result<&mut EngineConnector> {
        self.connector
            .as_mut()
            .and_then(|c| c.as_any_mut().downcast_mut::<EngineConnector>())
            .ok_or_else(|| {
                Error::InvalidConfig(
                    "no engine KV connector is installed (use_engine_connector)".into(),
                )
            })
    }

    /// The engine's store holds the KV of the first `num_tokens` prompt
    /// tokens of `handle`; used when the request is next admitted. A request
    /// that has already ended (a prompt ignored at once) is left alone.
    pub fn set_external_tokens(&mut self, handle: Handle, num_tokens: usize) -> Result<()> {
        let Some(req) = self.request(handle) else {
            return Err(Error::UnknownRequest(format!(
                "no request with handle {handle}"
            )));
        };
        if !req.is_finished() {
            self.engine_connector()?
                .set_external_tokens(handle, num_tokens);
        }
        Ok(())
    }

    /// Loads started by the `schedule()` calls since the last call.
    pub fn take_kv_loads(&mut self) -> Result<Vec<KvLoad>> {
        Ok(self.engine_connector()?.take_started_loads())
    }

    /// Blocks that became full and cached since the last call, with their
    /// prefix-cache hashes. Their KV is computed by the step whose
    /// `schedule()` (or an earlier one) registered them; loaded blocks are
    /// not listed, nor blocks that were reused since (their request gave
    /// them back and another took them).
    pub fn take_cached_blocks(&mut self) -> Vec<(u32, u64)> {
        let mut blocks = self.kv.take_recorded();
        blocks.retain(|&(b, h)| self.kv.pool.block_hash(b) == Some(h));
        blocks
    }

    /// Ends the load `load_id` of `handle`: its first `num_loaded_blocks`
    /// blocks hold their KV, the rest (a failed or partial load) will be
    /// computed. Returns false, changing nothing, when the load is no longer
    /// live (its request was aborted or gave its KV back): the engine must
    /// then not write its blocks.
    pub fn finish_kv_load(
        &mut self,
        handle: Handle,
        load_id: u64,
        num_loaded_blocks: usize,
    ) -> Result<bool> {
        let Some(blocks) = self.engine_connector()?.live_load(handle, load_id) else {
            return Ok(false);
        };
        if num_loaded_blocks > blocks.len() {
            return Err(Error::InvalidRequest(format!(
                "num_loaded_blocks ({num_loaded_blocks}) exceeds the {} blocks of load {load_id}",
                blocks.len()
            )));
        }
        debug_assert_eq!(self.req(handle).status, RequestStatus::WaitingForRemoteKvs);
        if num_loaded_blocks == blocks.len() {
            self.engine_connector()?.mark_done(handle);
            return Ok(true);
        }
        // A failed block and those after it are computed; the store is not
        // asked for them again.
        let loaded = (blocks.start + num_loaded_blocks) * self.cfg.block_size;
        self.engine_connector()?.set_external_tokens(handle, loaded);
        if loaded == 0 {
            // Nothing counts as computed: the request starts over without KV,
            // as a new request would (its admission looks up the prefix cache).
            self.return_loading_kv(handle);
        } else {
            self.req_mut(handle).num_loaded_tokens = loaded;
            self.engine_connector()?.mark_done(handle);
        }
        Ok(true)
    }
}
