//! The one place core errors become Python exceptions.

use fastsched_core::Error;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::PyErr;

pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::UnknownRequest(m) => PyKeyError::new_err(m),
        other => PyValueError::new_err(other.to_string()),
    }
}
