//! `SchedulerConfig` for Python: keyword arguments, each optional with the
//! core's default, validated at construction.

use fastsched_core::config::{HashAlgo, Policy, SchedulerConfig};
use pyo3::prelude::*;

use crate::errors::{non_negative, to_id, to_py};

#[pyclass(name = "SchedulerConfig", module = "fastsched._core", frozen)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    pub inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    /// Every argument is optional: `None` (or leaving it out) takes the core's
    /// default (`SchedulerConfig::default()` in Rust, the one place defaults
    /// are defined). `max_num_active_seqs` and `max_num_scheduled_tokens`
    /// default to unset, which resolves to `max_num_seqs` and
    /// `max_num_batched_tokens`.
    #[new]
    #[pyo3(signature = (
        *,
        max_num_seqs = None,
        max_num_active_seqs = None,
        max_num_batched_tokens = None,
        max_num_scheduled_tokens = None,
        max_model_len = None,
        long_prefill_token_threshold = None,
        long_prefill_token_threshold_adaptive = None,
        prefill_schedule_interval = None,
        enable_chunked_prefill = None,
        policy = None,
        max_loras = None,
        num_speculative_tokens = None,
        num_lookahead_tokens = None,
        block_size = None,
        num_gpu_blocks = None,
        enable_prefix_caching = None,
        prefix_caching_hash_algo = None,
        scheduler_reserve_full_isl = None,
        watermark = None,
        priority_preemption = None,
        max_preemptions_per_request = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_num_seqs: Option<i64>,
        max_num_active_seqs: Option<i64>,
        max_num_batched_tokens: Option<i64>,
        max_num_scheduled_tokens: Option<i64>,
        max_model_len: Option<i64>,
        long_prefill_token_threshold: Option<i64>,
        long_prefill_token_threshold_adaptive: Option<bool>,
        prefill_schedule_interval: Option<i64>,
        enable_chunked_prefill: Option<bool>,
        policy: Option<&str>,
        max_loras: Option<i64>,
        num_speculative_tokens: Option<i64>,
        num_lookahead_tokens: Option<i64>,
        block_size: Option<i64>,
        num_gpu_blocks: Option<i64>,
        enable_prefix_caching: Option<bool>,
        prefix_caching_hash_algo: Option<&str>,
        scheduler_reserve_full_isl: Option<bool>,
        watermark: Option<f64>,
        priority_preemption: Option<bool>,
        max_preemptions_per_request: Option<i64>,
    ) -> PyResult<Self> {
        let d = SchedulerConfig::default();
        let size = |name: &str, v: Option<i64>, default: usize| {
            v.map_or(Ok(default), |v| non_negative(name, v))
        };
        let unset = |name: &str, v: Option<i64>, default: Option<usize>| {
            v.map_or(Ok(default), |v| non_negative(name, v).map(Some))
        };
        let inner = SchedulerConfig {
            max_num_seqs: size("max_num_seqs", max_num_seqs, d.max_num_seqs)?,
            max_num_active_seqs: unset(
                "max_num_active_seqs",
                max_num_active_seqs,
                d.max_num_active_seqs,
            )?,
            max_num_batched_tokens: size(
                "max_num_batched_tokens",
                max_num_batched_tokens,
                d.max_num_batched_tokens,
            )?,
            max_num_scheduled_tokens: unset(
                "max_num_scheduled_tokens",
                max_num_scheduled_tokens,
                d.max_num_scheduled_tokens,
            )?,
            max_model_len: size("max_model_len", max_model_len, d.max_model_len)?,
            long_prefill_token_threshold: size(
                "long_prefill_token_threshold",
                long_prefill_token_threshold,
                d.long_prefill_token_threshold,
            )?,
            long_prefill_token_threshold_adaptive: long_prefill_token_threshold_adaptive
                .unwrap_or(d.long_prefill_token_threshold_adaptive),
            prefill_schedule_interval: size(
                "prefill_schedule_interval",
                prefill_schedule_interval,
                d.prefill_schedule_interval,
            )?,
            enable_chunked_prefill: enable_chunked_prefill.unwrap_or(d.enable_chunked_prefill),
            policy: match policy {
                Some(p) => p.parse::<Policy>().map_err(to_py)?,
                None => d.policy,
            },
            max_loras: size("max_loras", max_loras, d.max_loras)?,
            num_speculative_tokens: size(
                "num_speculative_tokens",
                num_speculative_tokens,
                d.num_speculative_tokens,
            )?,
            num_lookahead_tokens: size(
                "num_lookahead_tokens",
                num_lookahead_tokens,
                d.num_lookahead_tokens,
            )?,
            block_size: size("block_size", block_size, d.block_size)?,
            num_gpu_blocks: size("num_gpu_blocks", num_gpu_blocks, d.num_gpu_blocks)?,
            enable_prefix_caching: enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
            prefix_caching_hash_algo: match prefix_caching_hash_algo {
                Some(a) => a.parse::<HashAlgo>().map_err(to_py)?,
                None => d.prefix_caching_hash_algo,
            },
            scheduler_reserve_full_isl: scheduler_reserve_full_isl
                .unwrap_or(d.scheduler_reserve_full_isl),
            watermark: watermark.unwrap_or(d.watermark),
            priority_preemption: priority_preemption.unwrap_or(d.priority_preemption),
            max_preemptions_per_request: match max_preemptions_per_request {
                Some(v) => to_id("max_preemptions_per_request", v)?,
                None => d.max_preemptions_per_request,
            },
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
    fn long_prefill_token_threshold(&self) -> usize {
        self.inner.long_prefill_token_threshold
    }
    #[getter]
    fn long_prefill_token_threshold_adaptive(&self) -> bool {
        self.inner.long_prefill_token_threshold_adaptive
    }
    #[getter]
    fn prefill_schedule_interval(&self) -> usize {
        self.inner.prefill_schedule_interval
    }
    #[getter]
    fn enable_chunked_prefill(&self) -> bool {
        self.inner.enable_chunked_prefill
    }
    #[getter]
    fn scheduler_reserve_full_isl(&self) -> bool {
        self.inner.scheduler_reserve_full_isl
    }
    #[getter]
    fn watermark(&self) -> f64 {
        self.inner.watermark
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
    fn prefix_caching_hash_algo(&self) -> &'static str {
        self.inner.prefix_caching_hash_algo.as_str()
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
