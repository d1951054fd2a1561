//! `fastsched._core`: a thin PyO3 binding of fastsched-core. Modules mirror
//! the core's; no scheduling logic lives here.

mod admission;
mod config;
mod decoder;
mod dlpack;
mod errors;
mod kernels;
mod kv;
mod ops;
mod output;
mod scheduler;

use fastsched_core::output::ScheduledKind;
use fastsched_core::request::FinishReason;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// fastsched's per-step scheduler (Rust), as used by the engine.
///
/// One step: `so = sched.schedule()`, run the model on it, then
/// `sched.update_from_output(...)` (or `update_from_tokens(...)`). Requests are
/// named by integer handles; per-step data is numpy arrays indexed by row.
///
/// Speculative decoding (`SchedulerConfig(num_speculative_tokens=k)`):
///
/// - Drafts in: after a step's update, hand each request that sampled (and is
///   still running) its drafts for the next step with
///   `update_draft_token_ids(handles, draft_offsets, draft_token_ids)`, CSR rows
///   aligned with `handles` (uint32), at most `k` each; or pass the same rows
///   aligned with the step's `req_handles` as the `draft_offsets` and
///   `draft_token_ids` of `update_from_output`. Rows of requests still in
///   prefill, finished or not running are ignored.
/// - Drafts out: `so.num_spec_tokens[i]` drafts of row `i` are scheduled for
///   verification, their ids in `so.spec_token_ids` (int64, row after row);
///   `-1` is padding of a one-token admission padded to a uniform decode,
///   which the model never accepts. A scheduled request gives its drafts up.
/// - Verification back: row `i` of `update_from_output`'s sampled tokens holds
///   the accepted drafts and then the model's own token (`a + 1` tokens for
///   `a` accepted); the scheduler rolls back the `num_spec_tokens[i] - a`
///   rejected ones and applies the stop checks token by token.
/// - `num_lookahead_tokens` (default 0, as vLLM's n-gram method) reserves KV
///   and input slots for a drafter that writes KV for its drafts (EAGLE: `k`).
///
/// LoRA (`SchedulerConfig(max_loras=n)`): `add_request(..., lora_id=id)` with
/// `id >= 1` (None: the base model). At most `max_loras` adapters run in one
/// batch, counting every running request; a waiting request whose adapter
/// would be one too many is skipped for the step, not stopped at, and is
/// listed in `so.skipped` with `so.skip_reasons` 0 (`lora_slots`). Prefix-cache
/// blocks are never shared across adapters.
///
/// Pause states: `set_pause_state("paused_new")` keeps running requests (and
/// sessions holding KV) going and admits nobody; `"paused_all"` schedules
/// nothing; `"unpaused"` resumes. Nothing is lost. `has_requests()` follows
/// the state, so an engine that steps only while it is true stays idle while
/// paused, except for one step to report a finish or abort.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<config::PySchedulerConfig>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyEngineCoreOutputs>()?;
    m.add_class::<admission::PySharedAdmissionStats>()?;
    m.add_class::<kv::PyBlockHasher>()?;
    m.add_function(wrap_pyfunction!(kernels::set_kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::kernel_isa, m)?)?;
    m.add_class::<kernels::PyQuantWeight>()?;
    m.add_function(wrap_pyfunction!(kernels::quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_dequantize_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_gemm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_gemm_simd, m)?)?;
    // CPU attention and elementwise kernels.
    m.add_function(wrap_pyfunction!(ops::paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(ops::add_rms_norm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(ops::rope, m)?)?;
    m.add_function(wrap_pyfunction!(ops::silu_mul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gelu_tanh_mul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(ops::rms_norm_heads_bf16, m)?)?;
    m.add_class::<decoder::PyCpuDecoder>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The codes of `SchedulerOutput.kinds` and `EngineCoreOutputs.finish_reasons`,
    // taken from the core's enums so Python never writes them down again.
    m.add("KIND_CACHED", ScheduledKind::Cached as u8)?;
    m.add("KIND_NEW", ScheduledKind::New as u8)?;
    m.add("KIND_RESUMED", ScheduledKind::Resumed as u8)?;
    let finish_reasons = PyDict::new(m.py());
    for reason in [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Abort,
        FinishReason::Ignored,
    ] {
        finish_reasons.set_item(reason as u8, reason.as_str())?;
    }
    m.add("FINISH_REASONS", finish_reasons)?;
    Ok(())
}
