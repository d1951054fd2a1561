//! One error type for the whole core; the binding converts it to Python
//! exceptions in one place.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A scheduler setting is out of range or inconsistent with another (§3).
    InvalidConfig(String),
    /// A request's fields are unusable (empty prompt, zero `max_tokens`, ...).
    InvalidRequest(String),
    /// A request id is added twice while the first is still live.
    DuplicateRequest(String),
    /// An output or call names a request the scheduler does not hold.
    UnknownRequest(String),
    /// `update_from_output` arrays do not match the last `schedule()`.
    OutputMismatch(String),
    /// A shared admission segment (A6) cannot be created, opened or used.
    SharedMemory(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidConfig(m)
            | Error::InvalidRequest(m)
            | Error::UnknownRequest(m)
            | Error::OutputMismatch(m)
            | Error::SharedMemory(m) => f.write_str(m),
            Error::DuplicateRequest(id) => write!(f, "request id {id:?} is already in use"),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
