//! `fastsched._core`: a thin PyO3 binding of fastsched-core. Modules mirror
//! the core's; no scheduling logic lives here.

mod admission;
mod config;
mod errors;
mod output;
mod scheduler;

use fastsched_core::output::ScheduledKind;
use fastsched_core::request::FinishReason;
use pyo3::prelude::*;
use pyo3::types::PyDict;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<config::PySchedulerConfig>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyEngineCoreOutputs>()?;
    m.add_class::<admission::PySharedAdmissionStats>()?;
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
