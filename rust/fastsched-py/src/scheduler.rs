//! `Scheduler` for Python: owns one core scheduler, used through `&mut self`;
//! `schedule()` and `update_from_output()` run with the GIL released.

use fastsched_core::connector::TestConnector;
use fastsched_core::{
    Handle, ModelRunnerOutput, NewRequest, PauseState, ScanStop, Scheduler, SkipReason, StreamInput,
};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::config::PySchedulerConfig;
use crate::errors::{non_negative, to_id, to_py, token_id};
use crate::output::{PyEngineCoreOutputs, PySchedulerOutput};

#[pyclass(name = "Scheduler", module = "fastsched._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

fn token_ids(field: &str, ids: Vec<i64>) -> PyResult<Vec<u32>> {
    ids.into_iter().map(|t| token_id(field, t)).collect()
}

fn slice<'a>(name: &str, a: &'a PyReadonlyArray1<'_, u32>) -> PyResult<&'a [u32]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be a contiguous uint32 array")))
}

/// `cached_block_contents`' answer: each block's parent hash, and their token ids (flat).
type BlockContents<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u32>>);

impl PyScheduler {
    fn live(&self, handle: Handle) -> PyResult<&fastsched_core::Request> {
        self.inner
            .request(handle)
            .ok_or_else(|| PyKeyError::new_err(format!("no request with handle {handle}")))
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(config: &PySchedulerConfig) -> PyResult<Self> {
        Ok(PyScheduler {
            inner: Scheduler::new(config.inner.clone()).map_err(to_py)?,
        })
    }

    #[getter]
    fn config(&self) -> PySchedulerConfig {
        PySchedulerConfig {
            inner: self.inner.config().clone(),
        }
    }

    #[pyo3(signature = (
        request_id, prompt_token_ids, max_tokens, *, min_tokens = 0, eos_token_id = None,
        stop_token_ids = None, ignore_eos = false, priority = 0, arrival_time = 0.0,
        lora_id = None, streaming = false, cache_salt = None, skip_reading_prefix_cache = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: String,
        prompt_token_ids: Vec<i64>,
        max_tokens: i64,
        min_tokens: i64,
        eos_token_id: Option<i64>,
        stop_token_ids: Option<Vec<i64>>,
        ignore_eos: bool,
        priority: i64,
        arrival_time: f64,
        lora_id: Option<i64>,
        streaming: bool,
        cache_salt: Option<String>,
        skip_reading_prefix_cache: bool,
    ) -> PyResult<Handle> {
        let new = NewRequest {
            request_id,
            prompt_token_ids: token_ids("prompt_token_ids", prompt_token_ids)?,
            max_tokens: non_negative("max_tokens", max_tokens)?,
            min_tokens: non_negative("min_tokens", min_tokens)?,
            eos_token_id: eos_token_id
                .map(|t| token_id("eos_token_id", t))
                .transpose()?,
            stop_token_ids: token_ids("stop_token_ids", stop_token_ids.unwrap_or_default())?,
            ignore_eos,
            priority,
            arrival_time,
            lora_id: lora_id.map(|l| to_id("lora_id", l)).transpose()?,
            cache_salt,
            streaming,
            skip_reading_prefix_cache,
        };
        self.inner.add_request(new).map_err(to_py)
    }

    /// Aborts a live request; returns its status before the abort
    /// ("waiting", "running", "preempted", ...) or None if unknown/finished.
    fn abort_request(&mut self, request_id: &str) -> Option<&'static str> {
        self.inner.abort_request(request_id).map(|s| s.as_str())
    }

    fn schedule(&mut self, py: Python<'_>) -> PySchedulerOutput {
        let inner = &mut self.inner;
        let out = py.detach(|| inner.schedule());
        PySchedulerOutput::new(py, out)
    }

    /// Sampled tokens of the oldest step in flight, as CSR aligned with that
    /// step's `req_handles` (an empty row for a partial prefill).
    #[pyo3(signature = (sampled_offsets, sampled_token_ids, draft_offsets = None, draft_token_ids = None))]
    fn update_from_output(
        &mut self,
        py: Python<'_>,
        sampled_offsets: PyReadonlyArray1<'_, u32>,
        sampled_token_ids: PyReadonlyArray1<'_, u32>,
        draft_offsets: Option<PyReadonlyArray1<'_, u32>>,
        draft_token_ids: Option<PyReadonlyArray1<'_, u32>>,
    ) -> PyResult<PyEngineCoreOutputs> {
        let mro = ModelRunnerOutput {
            sampled_offsets: slice("sampled_offsets", &sampled_offsets)?.to_vec(),
            sampled_token_ids: slice("sampled_token_ids", &sampled_token_ids)?.to_vec(),
            draft_offsets: match &draft_offsets {
                Some(a) => slice("draft_offsets", a)?.to_vec(),
                None => Vec::new(),
            },
            draft_token_ids: match &draft_token_ids {
                Some(a) => slice("draft_token_ids", a)?.to_vec(),
                None => Vec::new(),
            },
        };
        let inner = &mut self.inner;
        let out = py
            .detach(|| inner.update_from_output(&mro))
            .map_err(to_py)?;
        Ok(PyEngineCoreOutputs::new(py, out))
    }

    /// Drafts for the next step (speculative decoding), as CSR rows aligned
    /// with `handles`: what a drafter proposed after the step's update.
    fn update_draft_token_ids(
        &mut self,
        handles: PyReadonlyArray1<'_, u32>,
        draft_offsets: PyReadonlyArray1<'_, u32>,
        draft_token_ids: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<()> {
        self.inner
            .update_draft_token_ids(
                slice("handles", &handles)?,
                slice("draft_offsets", &draft_offsets)?,
                slice("draft_token_ids", &draft_token_ids)?,
            )
            .map_err(to_py)
    }

    /// The common case: at most one token per scheduled request, `-1` for
    /// none (a partial prefill).
    fn update_from_tokens(
        &mut self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, i64>,
    ) -> PyResult<PyEngineCoreOutputs> {
        let tokens = tokens
            .as_slice()
            .map_err(|_| PyValueError::new_err("tokens must be a contiguous int64 array"))?;
        if let Some(t) = tokens.iter().find(|&&t| t > i64::from(u32::MAX)) {
            return Err(PyValueError::new_err(format!(
                "tokens contains {t}, which is not a valid token id"
            )));
        }
        let tokens: Vec<Option<u32>> = tokens
            .iter()
            .map(|&t| (t >= 0).then_some(t as u32))
            .collect();
        let inner = &mut self.inner;
        let out = py
            .detach(|| inner.update_from_tokens(&tokens))
            .map_err(to_py)?;
        Ok(PyEngineCoreOutputs::new(py, out))
    }

    fn has_requests(&self) -> bool {
        self.inner.has_requests()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    #[getter]
    fn num_waiting_for_streaming_input(&self) -> usize {
        self.inner.num_waiting_for_streaming_input()
    }

    /// Counters and gauges for metrics, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item(
            "num_waiting_for_streaming_input",
            s.num_waiting_for_streaming_input,
        )?;
        d.set_item("kv_cache_usage", s.kv_cache_usage)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("num_preemptions_total", s.num_preemptions_total)?;
        d.set_item("prefix_cache_requests", s.prefix_cache.requests)?;
        d.set_item("prefix_cache_queries", s.prefix_cache.queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache.hits)?;
        d.set_item(
            "prefix_cache_preempted_queries",
            s.prefix_cache.preempted_queries,
        )?;
        d.set_item("prefix_cache_preempted_hits", s.prefix_cache.preempted_hits)?;
        d.set_item("num_steps", s.num_steps)?;
        let stops = PyDict::new(py);
        for gate in ScanStop::ALL {
            stops.set_item(gate.as_str(), s.gates.scan_stops(gate))?;
        }
        d.set_item("scan_stops_total", stops)?;
        let skips = PyDict::new(py);
        for reason in SkipReason::ALL {
            skips.set_item(reason.as_str(), s.gates.skips(reason))?;
        }
        d.set_item("skips_total", skips)?;
        d.set_item(
            "last_scan_stop",
            s.gates.last_scan_stop.map(ScanStop::as_str),
        )?;
        Ok(d)
    }

    fn request_id(&self, handle: Handle) -> PyResult<String> {
        Ok(self.live(handle)?.request_id.clone())
    }

    /// Request ids for an array of handles (diagnostics; the engine keeps
    /// its own handle -> request map on the hot path).
    fn request_ids(&self, handles: PyReadonlyArray1<'_, u32>) -> PyResult<Vec<String>> {
        slice("handles", &handles)?
            .iter()
            .map(|&h| Ok(self.live(h)?.request_id.clone()))
            .collect()
    }

    fn handle_of(&self, request_id: &str) -> Option<Handle> {
        self.inner.handle_of(request_id)
    }

    /// Whether a request will still run once the steps in flight land (see
    /// the core's `runs_after_in_flight`): async scheduling schedules a step
    /// ahead only then.
    fn runs_after_in_flight(&self) -> bool {
        self.inner.runs_after_in_flight()
    }

    /// The prompt lengths of `handles` (live requests, or finished ones not
    /// yet reported by `schedule()`), as int64.
    fn num_prompt_tokens<'py>(
        &self,
        py: Python<'py>,
        handles: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let v = slice("handles", &handles)?
            .iter()
            .map(|&h| Ok(self.live(h)?.num_prompt_tokens as i64))
            .collect::<PyResult<Vec<i64>>>()?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// The `arrival_time`s given to `add_request` for `handles` (live requests,
    /// or finished ones not yet reported by `schedule()`).
    fn arrival_times<'py>(
        &self,
        py: Python<'py>,
        handles: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let v = slice("handles", &handles)?
            .iter()
            .map(|&h| Ok(self.live(h)?.arrival_time))
            .collect::<PyResult<Vec<f64>>>()?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// A request's state as a dict (diagnostics).
    fn request_info<'py>(&self, py: Python<'py>, handle: Handle) -> PyResult<Bound<'py, PyDict>> {
        let r = self.live(handle)?;
        let d = PyDict::new(py);
        d.set_item("request_id", &r.request_id)?;
        d.set_item("status", r.status.as_str())?;
        d.set_item("num_tokens", r.num_tokens())?;
        d.set_item("num_prompt_tokens", r.num_prompt_tokens)?;
        d.set_item("num_output_tokens", r.num_output_tokens)?;
        let progress = self.inner.progress(handle).copied().unwrap_or_default();
        d.set_item("num_computed_tokens", progress.num_computed_tokens)?;
        d.set_item("is_prefill_chunk", progress.is_prefill_chunk)?;
        d.set_item("num_cached_tokens", r.num_cached_tokens)?;
        d.set_item("num_preemptions", r.num_preemptions)?;
        d.set_item("priority", r.priority)?;
        d.set_item("blocks", self.inner.blocks_of(handle).to_vec())?;
        d.set_item("ignore_reason", r.ignore_reason.as_deref())?;
        Ok(d)
    }

    /// Prompt and output tokens of a request.
    fn token_ids<'py>(
        &self,
        py: Python<'py>,
        handle: Handle,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        Ok(PyArray1::from_slice(py, &self.live(handle)?.token_ids))
    }

    fn ignore_reason(&self, handle: Handle) -> Option<String> {
        self.inner.ignore_reason(handle).map(str::to_owned)
    }

    fn running_handles(&self) -> Vec<Handle> {
        self.inner.running().to_vec()
    }

    fn waiting_handles(&self) -> Vec<Handle> {
        self.inner.waiting_order()
    }

    /// "unpaused", "paused_new" (running and KV-holding only) or "paused_all".
    fn set_pause_state(&mut self, state: &str) -> PyResult<()> {
        let s = match state {
            "unpaused" => PauseState::Unpaused,
            "paused_new" => PauseState::PausedNew,
            "paused_all" => PauseState::PausedAll,
            other => {
                return Err(PyValueError::new_err(format!(
                    "pause state ({other:?}) must be \"unpaused\", \"paused_new\" or \"paused_all\""
                )))
            }
        };
        self.inner.set_pause_state(s);
        Ok(())
    }

    /// The pause state in force (S13), as `set_pause_state` takes it.
    #[getter]
    fn pause_state(&self) -> &'static str {
        match self.inner.pause_state() {
            PauseState::Unpaused => "unpaused",
            PauseState::PausedNew => "paused_new",
            PauseState::PausedAll => "paused_all",
        }
    }

    /// Drops the prefix cache (after a weight reload); requests keep their blocks.
    fn reset_prefix_cache(&mut self) {
        self.inner.reset_prefix_cache();
    }

    /// Starts (or stops) recording the hashes that enter and leave the prefix cache.
    fn record_kv_events(&mut self, on: bool) {
        self.inner.record_kv_events(on);
    }

    /// The hashes cached and evicted since the last call: (stored, removed).
    fn take_kv_events<'py>(
        &mut self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u64>>) {
        let events = self.inner.take_kv_events();
        (
            PyArray1::from_vec(py, events.stored),
            PyArray1::from_vec(py, events.removed),
        )
    }

    #[pyo3(signature = (request_id, token_ids, max_tokens, is_last = false))]
    fn add_stream_input(
        &mut self,
        request_id: &str,
        token_ids: Vec<i64>,
        max_tokens: i64,
        is_last: bool,
    ) -> PyResult<()> {
        let input = StreamInput {
            token_ids: self::token_ids("token_ids", token_ids)?,
            max_tokens: non_negative("max_tokens", max_tokens)?,
            is_last,
        };
        self.inner
            .add_stream_input(request_id, input)
            .map_err(to_py)
    }

    fn close_stream(&mut self, request_id: &str) -> PyResult<()> {
        self.inner.close_stream(request_id).map_err(to_py)
    }

    /// Installs the test KV connector (remote KV ready after N steps).
    fn use_test_connector(&mut self, num_external_tokens: usize, ready_after_steps: u32) {
        let bs = self.inner.config().block_size;
        self.inner.set_connector(Box::new(TestConnector::new(
            num_external_tokens,
            ready_after_steps,
            bs,
        )));
    }

    /// Installs the engine-driven KV connector (S7 `remote_kv`): the engine
    /// says what its store holds, runs the loads, reports them, saves blocks.
    fn use_engine_connector(&mut self) {
        self.inner.use_engine_connector();
    }

    /// Prefix-cache hashes of the full blocks of a request's tokens.
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        handle: Handle,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        Ok(PyArray1::from_slice(py, &self.live(handle)?.block_hashes))
    }

    /// The engine's store holds the KV of the first `num_tokens` prompt tokens.
    fn set_external_tokens(&mut self, handle: Handle, num_tokens: usize) -> PyResult<()> {
        self.inner
            .set_external_tokens(handle, num_tokens)
            .map_err(to_py)
    }

    /// Loads started since the last call: (load_id, handle, block_ids, block_hashes).
    #[allow(clippy::type_complexity)]
    fn take_kv_loads<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            u64,
            Handle,
            Bound<'py, PyArray1<u32>>,
            Bound<'py, PyArray1<u64>>,
        )>,
    > {
        Ok(self
            .inner
            .take_kv_loads()
            .map_err(to_py)?
            .into_iter()
            .map(|l| {
                (
                    l.load_id,
                    l.handle,
                    PyArray1::from_vec(py, l.block_ids),
                    PyArray1::from_vec(py, l.block_hashes),
                )
            })
            .collect())
    }

    /// Blocks that became full and cached since the last call: (block_ids, block_hashes).
    /// What the cached blocks `block_ids` hold, for a KV connector to store
    /// beside their KV: each one's parent hash, and their token ids
    /// (`block_size` per block, flat). ValueError for a block not cached.
    fn cached_block_contents<'py>(
        &self,
        py: Python<'py>,
        block_ids: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<BlockContents<'py>> {
        let ids = slice("block_ids", &block_ids)?;
        let pool = &self.inner.kv().pool;
        let mut parents = Vec::with_capacity(ids.len());
        let mut tokens = Vec::with_capacity(ids.len() * self.inner.config().block_size);
        for &b in ids {
            let Some((parent, held)) = pool.cached_content(b) else {
                return Err(PyValueError::new_err(format!("block {b} is not cached")));
            };
            parents.push(parent);
            tokens.extend_from_slice(held);
        }
        Ok((
            PyArray1::from_vec(py, parents),
            PyArray1::from_vec(py, tokens),
        ))
    }

    fn take_cached_blocks<'py>(
        &mut self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray1<u64>>) {
        let (ids, hashes): (Vec<u32>, Vec<u64>) =
            self.inner.take_cached_blocks().into_iter().unzip();
        (PyArray1::from_vec(py, ids), PyArray1::from_vec(py, hashes))
    }

    /// Ends a load with its first `num_loaded_blocks` blocks filled (fewer:
    /// the rest is computed). False: the load is no longer live (aborted), so
    /// its blocks must not be written.
    fn finish_kv_load(
        &mut self,
        handle: Handle,
        load_id: u64,
        num_loaded_blocks: usize,
    ) -> PyResult<bool> {
        self.inner
            .finish_kv_load(handle, load_id, num_loaded_blocks)
            .map_err(to_py)
    }

    fn set_async_scheduling(&mut self, on: bool) {
        self.inner.set_async_scheduling(on);
    }
}
