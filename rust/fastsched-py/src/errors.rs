//! The one place core errors become Python exceptions.

use fastsched_core::Error;
use pyo3::exceptions::{PyKeyError, PyOSError, PyValueError};
use pyo3::PyErr;

pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::UnknownRequest(m) => PyKeyError::new_err(m),
        Error::SharedMemory(m) => PyOSError::new_err(m),
        other => PyValueError::new_err(other.to_string()),
    }
}

/// Python ints arrive as i64 so a negative value is a ValueError naming the
/// field, not an OverflowError from the conversion.
pub fn non_negative(field: &str, value: i64) -> pyo3::PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("{field} ({value}) must be non-negative")))
}

pub fn token_id(field: &str, value: i64) -> pyo3::PyResult<u32> {
    u32::try_from(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{field} contains {value}, which is not a valid token id"
        ))
    })
}

pub fn to_id(field: &str, value: i64) -> pyo3::PyResult<u32> {
    u32::try_from(value).map_err(|_| {
        PyValueError::new_err(format!("{field} ({value}) must be in [0, {}]", u32::MAX))
    })
}
