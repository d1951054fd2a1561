//! Per-step outputs as numpy arrays, built once when the step ends.

use fastsched_core::{EngineCoreOutputs, SchedulerOutput};
use numpy::PyArray1;
use pyo3::prelude::*;

type U32Array = Py<PyArray1<u32>>;

fn arr<'py, T: numpy::Element>(py: Python<'py>, v: Vec<T>) -> Py<PyArray1<T>> {
    PyArray1::from_vec(py, v).unbind()
}

/// One step's decisions. Arrays are indexed by scheduled position; block ids
/// are CSR: request `i` owns `block_ids[block_offsets[i]:block_offsets[i+1]]`
/// (its whole table when `kinds[i]` is 1 = new or 2 = resumed, only the blocks
/// added this step when it is 0 = cached).
#[pyclass(name = "SchedulerOutput", module = "fastsched._core", frozen, get_all)]
pub struct PySchedulerOutput {
    pub step_id: u64,
    pub num_reqs: usize,
    pub total_num_scheduled_tokens: usize,
    pub req_handles: U32Array,
    pub num_scheduled_tokens: U32Array,
    pub num_computed_tokens: U32Array,
    pub kinds: Py<PyArray1<u8>>,
    pub num_cached_tokens: U32Array,
    pub num_spec_tokens: U32Array,
    pub spec_token_ids: Py<PyArray1<i64>>,
    pub block_offsets: U32Array,
    pub block_ids: U32Array,
    pub preempted: U32Array,
    pub skipped: U32Array,
    pub skip_reasons: Py<PyArray1<u8>>,
    pub finished: U32Array,
}

impl PySchedulerOutput {
    pub fn new(py: Python<'_>, o: SchedulerOutput) -> Self {
        PySchedulerOutput {
            step_id: o.step_id,
            num_reqs: o.req_handles.len(),
            total_num_scheduled_tokens: o.total_num_scheduled_tokens,
            req_handles: arr(py, o.req_handles),
            num_scheduled_tokens: arr(py, o.num_scheduled_tokens),
            num_computed_tokens: arr(py, o.num_computed_tokens),
            kinds: arr(py, o.kinds),
            num_cached_tokens: arr(py, o.num_cached_tokens),
            num_spec_tokens: arr(py, o.num_spec_tokens),
            spec_token_ids: arr(py, o.spec_token_ids),
            block_offsets: arr(py, o.block_offsets),
            block_ids: arr(py, o.block_ids),
            preempted: arr(py, o.preempted),
            skipped: arr(py, o.skipped),
            skip_reasons: arr(py, o.skip_reasons),
            finished: arr(py, o.finished),
        }
    }
}

#[pymethods]
impl PySchedulerOutput {
    fn __len__(&self) -> usize {
        self.num_reqs
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_reqs={}, total_num_scheduled_tokens={})",
            self.step_id, self.num_reqs, self.total_num_scheduled_tokens
        )
    }
}

/// Requests that progressed in one update: new tokens as CSR
/// (`token_ids[token_offsets[i]:token_offsets[i+1]]`), finish reason codes
/// (0 running, 1 stop, 2 length, 3 abort, 4 ignored).
#[pyclass(
    name = "EngineCoreOutputs",
    module = "fastsched._core",
    frozen,
    get_all
)]
pub struct PyEngineCoreOutputs {
    pub num_reqs: usize,
    pub handles: U32Array,
    pub token_offsets: U32Array,
    pub token_ids: U32Array,
    pub finish_reasons: Py<PyArray1<u8>>,
    pub segment_ended: Py<PyArray1<bool>>,
    pub num_cached_tokens: Py<PyArray1<i64>>,
}

impl PyEngineCoreOutputs {
    pub fn new(py: Python<'_>, o: EngineCoreOutputs) -> Self {
        PyEngineCoreOutputs {
            num_reqs: o.handles.len(),
            handles: arr(py, o.handles),
            token_offsets: arr(py, o.token_offsets),
            token_ids: arr(py, o.token_ids),
            finish_reasons: arr(py, o.finish_reasons),
            segment_ended: arr(py, o.segment_ended),
            num_cached_tokens: arr(py, o.num_cached_tokens),
        }
    }
}

#[pymethods]
impl PyEngineCoreOutputs {
    fn __len__(&self) -> usize {
        self.num_reqs
    }
}
