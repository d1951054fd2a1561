//! `fastsched._core`: a thin PyO3 binding of fastsched-core. Modules mirror
//! the core's; no scheduling logic lives here.

mod admission;
mod config;
mod errors;
mod output;
mod scheduler;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<config::PySchedulerConfig>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<output::PySchedulerOutput>()?;
    m.add_class::<output::PyEngineCoreOutputs>()?;
    m.add_class::<admission::PySharedAdmissionStats>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
