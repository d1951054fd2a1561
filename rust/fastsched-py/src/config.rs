//! `SchedulerConfig` for Python: keyword arguments, validated at construction.

use fastsched_core::config::{Policy, SchedulerConfig};
use pyo3::prelude::*;

use crate::errors::{non_negative, to_py};

#[pyclass(name = "SchedulerConfig", module = "fastsched._core", frozen)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    pub inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (
        *,
        max_num_seqs = 256,
        max_num_active_seqs = None,
        max_num_batched_tokens = 8192,
        max_num_scheduled_tokens = None,
        max_model_len = 8192,
        long_prefill_token_threshold = 0,
        long_prefill_token_threshold_adaptive = false,
        prefill_schedule_interval = 1,
        enable_chunked_prefill = true,
        policy = "fcfs",
        max_loras = 0,
        num_speculative_tokens = 0,
        num_lookahead_tokens = 0,
        block_size = 16,
        num_gpu_blocks = 4096,
        enable_prefix_caching = true,
        scheduler_reserve_full_isl = true,
        watermark = 0.0,
        priority_preemption = false,
        max_preemptions_per_request = 3,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_num_seqs: i64,
        max_num_active_seqs: Option<i64>,
        max_num_batched_tokens: i64,
        max_num_scheduled_tokens: Option<i64>,
        max_model_len: i64,
        long_prefill_token_threshold: i64,
        long_prefill_token_threshold_adaptive: bool,
        prefill_schedule_interval: i64,
        enable_chunked_prefill: bool,
        policy: &str,
        max_loras: i64,
        num_speculative_tokens: i64,
        num_lookahead_tokens: i64,
        block_size: i64,
        num_gpu_blocks: i64,
        enable_prefix_caching: bool,
        scheduler_reserve_full_isl: bool,
        watermark: f64,
        priority_preemption: bool,
        max_preemptions_per_request: u32,
    ) -> PyResult<Self> {
        let opt = |name: &str, v: Option<i64>| v.map(|v| non_negative(name, v)).transpose();
        let inner = SchedulerConfig {
            max_num_seqs: non_negative("max_num_seqs", max_num_seqs)?,
            max_num_active_seqs: opt("max_num_active_seqs", max_num_active_seqs)?,
            max_num_batched_tokens: non_negative("max_num_batched_tokens", max_num_batched_tokens)?,
            max_num_scheduled_tokens: opt("max_num_scheduled_tokens", max_num_scheduled_tokens)?,
            max_model_len: non_negative("max_model_len", max_model_len)?,
            long_prefill_token_threshold: non_negative(
                "long_prefill_token_threshold",
                long_prefill_token_threshold,
            )?,
            long_prefill_token_threshold_adaptive,
            prefill_schedule_interval: non_negative(
                "prefill_schedule_interval",
                prefill_schedule_interval,
            )?,
            enable_chunked_prefill,
            policy: policy.parse::<Policy>().map_err(to_py)?,
            max_loras: non_negative("max_loras", max_loras)?,
            num_speculative_tokens: non_negative("num_speculative_tokens", num_speculative_tokens)?,
            num_lookahead_tokens: non_negative("num_lookahead_tokens", num_lookahead_tokens)?,
            block_size: non_negative("block_size", block_size)?,
            num_gpu_blocks: non_negative("num_gpu_blocks", num_gpu_blocks)?,
            enable_prefix_caching,
            scheduler_reserve_full_isl,
            watermark,
            priority_preemption,
            max_preemptions_per_request,
        };
        inner.validate().map_err(to_py)?;
        Ok(PySchedulerConfig { inner })
    }

    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    #[getter]
    fn max_num_active_seqs(&self) -> usize {
        self.inner.max_num_active_seqs()
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.max_num_batched_tokens
    }
    #[getter]
    fn max_num_scheduled_tokens(&self) -> usize {
        self.inner.max_num_scheduled_tokens()
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }
    #[getter]
    fn max_loras(&self) -> usize {
        self.inner.max_loras
    }
    #[getter]
    fn num_speculative_tokens(&self) -> usize {
        self.inner.num_speculative_tokens
    }
    #[getter]
    fn num_lookahead_tokens(&self) -> usize {
        self.inner.num_lookahead_tokens
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn num_gpu_blocks(&self) -> usize {
        self.inner.num_gpu_blocks
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }
    #[getter]
    fn priority_preemption(&self) -> bool {
        self.inner.priority_preemption
    }
    #[getter]
    fn max_preemptions_per_request(&self) -> u32 {
        self.inner.max_preemptions_per_request
    }
    #[getter]
    fn policy(&self) -> &'static str {
        match self.inner.policy {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }

    fn __repr__(&self) -> String {
        format!("SchedulerConfig({:?})", self.inner)
    }
}
