//! `BlockHasher` for Python: the core's prefix-cache block hash, so that a
//! frontend routing by prefix computes exactly the hashes an engine caches.

use fastsched_core::config::HashAlgo;
use fastsched_core::kv::BlockHasher;
use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{to_id, to_py, token_id};

#[pyclass(name = "BlockHasher", module = "fastsched._core", frozen)]
pub struct PyBlockHasher {
    inner: BlockHasher,
}

#[pymethods]
impl PyBlockHasher {
    #[new]
    #[pyo3(signature = (block_size, hash_algo = "builtin"))]
    fn new(block_size: i64, hash_algo: &str) -> PyResult<Self> {
        if block_size < 1 {
            return Err(PyValueError::new_err(format!(
                "block_size must be at least 1, got {block_size}"
            )));
        }
        let algo = hash_algo.parse::<HashAlgo>().map_err(to_py)?;
        Ok(PyBlockHasher {
            inner: BlockHasher::with_algo(block_size as usize, algo),
        })
    }

    /// The chained hashes of the full blocks of `token_ids`, as the
    /// scheduler computes them for a request with this adapter id and salt.
    #[pyo3(signature = (token_ids, lora_id = None, cache_salt = None))]
    fn prompt_hashes<'py>(
        &self,
        py: Python<'py>,
        token_ids: Vec<i64>,
        lora_id: Option<i64>,
        cache_salt: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let tokens = token_ids
            .into_iter()
            .map(|t| token_id("token_ids", t))
            .collect::<PyResult<Vec<u32>>>()?;
        let lora = lora_id.map(|id| to_id("lora_id", id)).transpose()?;
        Ok(PyArray1::from_vec(
            py,
            self.inner.prompt_hashes(&tokens, lora, cache_salt),
        ))
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
}
