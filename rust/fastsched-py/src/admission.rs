//! `SharedAdmissionStats` for Python (A6). Every method is a few atomic
//! operations (nanoseconds), so none releases the GIL.

use fastsched_core::admission::{SharedAdmissionStats, DEFAULT_DIR};
use pyo3::prelude::*;

use crate::errors::{non_negative, to_py};

#[pyclass(name = "SharedAdmissionStats", module = "fastsched._core", frozen)]
pub struct PySharedAdmissionStats {
    inner: SharedAdmissionStats,
}

#[pymethods]
impl PySharedAdmissionStats {
    #[staticmethod]
    #[pyo3(signature = (name, num_slots, dir = None))]
    fn create(name: &str, num_slots: i64, dir: Option<&str>) -> PyResult<Self> {
        let num_slots = non_negative("num_slots", num_slots)?;
        SharedAdmissionStats::create_in(dir.unwrap_or(DEFAULT_DIR), name, num_slots)
            .map(|inner| Self { inner })
            .map_err(to_py)
    }

    #[staticmethod]
    #[pyo3(signature = (name, slot, dir = None))]
    fn open(name: &str, slot: i64, dir: Option<&str>) -> PyResult<Self> {
        let slot = non_negative("slot", slot)?;
        SharedAdmissionStats::open_in(dir.unwrap_or(DEFAULT_DIR), name, slot)
            .map(|inner| Self { inner })
            .map_err(to_py)
    }

    fn add(&self, delta: i64) -> PyResult<()> {
        self.inner.add(delta).map_err(to_py)
    }

    fn set(&self, value: i64) -> PyResult<()> {
        self.inner.set(value).map_err(to_py)
    }

    fn own(&self) -> PyResult<i64> {
        self.inner.own().map_err(to_py)
    }

    fn total(&self) -> i64 {
        self.inner.total()
    }

    fn unlink(&self) -> PyResult<()> {
        self.inner.unlink().map_err(to_py)
    }

    #[getter]
    fn num_slots(&self) -> usize {
        self.inner.num_slots()
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    #[getter]
    fn slot(&self) -> Option<usize> {
        self.inner.slot()
    }

    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }

    fn __repr__(&self) -> String {
        match self.inner.slot() {
            Some(slot) => format!(
                "SharedAdmissionStats(name={:?}, slot={slot}, num_slots={})",
                self.inner.name(),
                self.inner.num_slots()
            ),
            None => format!(
                "SharedAdmissionStats(name={:?}, creator, num_slots={})",
                self.inner.name(),
                self.inner.num_slots()
            ),
        }
    }
}
