//! Binding of fastsched-kernels' decoder stack for `fastsched.models.llama_cpu`.
//!
//! As in `kernels`, tensors cross as addresses: the Python owner checks dtypes, shapes and
//! contiguity once, keeps every weight tensor alive as long as this object, and the step's
//! tensors for the call. The GIL is released while the stack runs.

use fastsched_kernels::attention::{CacheShape, FloatsMut, Step};
use fastsched_kernels::decoder::{self, Attention, Dims, Kernels, Layer, Rope};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{pool, weight, WeightSpec};

/// The decoder layers of a Llama-family model with quantized linears, run as one call a
/// step (`fastsched_kernels::decoder`).
#[pyclass(name = "CpuDecoder", module = "fastsched._core", frozen)]
pub struct PyCpuDecoder {
    dims: Dims,
    /// Per layer: the input and post-attention RMSNorm weights (bfloat16 `[hidden]`).
    norms: Vec<[usize; 2]>,
    /// Per layer: q/k/v, o, gate/up, down.
    weights: Vec<[WeightSpec; 4]>,
    /// Per layer: the bfloat16 biases of the same four (0: none).
    biases: Vec<[usize; 4]>,
    final_norm: usize,
}

impl PyCpuDecoder {
    /// # Safety
    /// The addresses are live for `'a` (the owner's contract, module docs).
    unsafe fn layers<'a>(&self) -> PyResult<Vec<Layer<'a>>> {
        let h = self.dims.hidden;
        let norm = |addr: usize| std::slice::from_raw_parts(addr as *const u16, h);
        let w = |spec: WeightSpec| weight(spec);
        let bias = |addr: usize, (_, _, n, _, _): WeightSpec| {
            (addr != 0).then(|| std::slice::from_raw_parts(addr as *const u16, n))
        };
        self.norms
            .iter()
            .zip(&self.weights)
            .zip(&self.biases)
            .map(
                |((&[input, post], &[qkv, o, gate_up, down]), &[bq, bo, bg, bd])| {
                    Ok(Layer {
                        input_norm: norm(input),
                        post_norm: norm(post),
                        qkv: w(qkv)?,
                        o: w(o)?,
                        gate_up: w(gate_up)?,
                        down: w(down)?,
                        biases: [
                            bias(bq, qkv),
                            bias(bo, o),
                            bias(bg, gate_up),
                            bias(bd, down),
                        ],
                    })
                },
            )
            .collect()
    }
}

#[pymethods]
impl PyCpuDecoder {
    /// `sizes`: hidden, num_heads, num_kv_heads, head_dim, intermediate; `dense_min_rows`:
    /// activation rows from which a linear layer runs the many-row GEMM; `biases`: per layer
    /// the addresses of the four projections' bfloat16 biases (0: none). Fails naming the
    /// layer and projection whose shape does not fit.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        sizes: [usize; 5],
        eps: f32,
        dense_min_rows: usize,
        norms: Vec<[usize; 2]>,
        weights: Vec<[WeightSpec; 4]>,
        biases: Vec<[usize; 4]>,
        final_norm: usize,
    ) -> PyResult<Self> {
        let [hidden, num_heads, num_kv_heads, head_dim, intermediate] = sizes;
        if norms.len() != weights.len() || biases.len() != weights.len() {
            return Err(PyValueError::new_err(format!(
                "{} layers of norms, {} of weights and {} of biases",
                norms.len(),
                weights.len(),
                biases.len()
            )));
        }
        let this = PyCpuDecoder {
            dims: Dims {
                hidden,
                num_heads,
                num_kv_heads,
                head_dim,
                intermediate,
                eps,
                dense_min_rows,
            },
            norms,
            weights,
            biases,
            final_norm,
        };
        // SAFETY: the owner's contract (module docs).
        unsafe {
            let layers = this.layers()?;
            let final_norm = std::slice::from_raw_parts(final_norm as *const u16, hidden);
            decoder::validate(&this.dims, &layers, final_norm).map_err(PyValueError::new_err)?;
        }
        Ok(this)
    }

    /// Runs every layer on the bfloat16 residual stream `hidden [rows, hidden]` (updated in
    /// place) and writes the final-normed `out [rows, hidden]`.
    ///
    /// `positions [rows]` int64 index the bfloat16 RoPE `tables` (cos, sin: `[table_len,
    /// head_dim]`); `caches`: each layer's `[2, num_blocks, block_size, H_kv, D]` cache
    /// (bfloat16 if `cache_bf16`, else float32); `step`: slot_mapping `[rows]` int64, then
    /// int32 query_start_loc `[num_reqs + 1]`, seq_lens `[num_reqs]`, block_tables
    /// `[num_reqs, max_blocks]` and the requests to attend for `[num_selected]`, which own
    /// every row below `num_rows` (the rest are padding).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        hidden: usize,
        out: usize,
        rows: usize,
        positions: usize,
        tables: [usize; 2],
        table_len: usize,
        caches: Vec<usize>,
        cache_bf16: bool,
        cache_blocks: [usize; 2],
        step: [usize; 5],
        num_reqs: usize,
        max_blocks: usize,
        num_selected: usize,
        num_rows: usize,
        scale: f32,
    ) -> PyResult<()> {
        let pool = pool();
        let dims = self.dims;
        let [num_blocks, block_size] = cache_blocks;
        let cache_shape = CacheShape {
            num_blocks,
            block_size,
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
        };
        let cache_len = 2 * num_blocks * block_size * dims.num_kv_heads * dims.head_dim;
        py.detach(|| -> PyResult<()> {
            // SAFETY: the owner's and the caller's contracts (module docs).
            unsafe {
                let layers = self.layers()?;
                let mut caches: Vec<FloatsMut> = caches
                    .iter()
                    .map(|&c| {
                        if cache_bf16 {
                            FloatsMut::Bf16(std::slice::from_raw_parts_mut(
                                c as *mut u16,
                                cache_len,
                            ))
                        } else {
                            FloatsMut::F32(std::slice::from_raw_parts_mut(c as *mut f32, cache_len))
                        }
                    })
                    .collect();
                let table = |a: usize| {
                    std::slice::from_raw_parts(a as *const u16, table_len * dims.head_dim)
                };
                let [slots, qsl, seq_lens, block_tables, reqs] = step;
                let n = rows * dims.hidden;
                decoder::forward(
                    &dims,
                    &layers,
                    std::slice::from_raw_parts(self.final_norm as *const u16, dims.hidden),
                    &mut caches,
                    std::slice::from_raw_parts_mut(hidden as *mut u16, n),
                    std::slice::from_raw_parts_mut(out as *mut u16, n),
                    Rope {
                        positions: std::slice::from_raw_parts(positions as *const i64, rows),
                        cos: table(tables[0]),
                        sin: table(tables[1]),
                    },
                    Attention {
                        slot_mapping: std::slice::from_raw_parts(slots as *const i64, rows),
                        step: Step {
                            query_start_loc: std::slice::from_raw_parts(
                                qsl as *const i32,
                                num_reqs + 1,
                            ),
                            seq_lens: std::slice::from_raw_parts(seq_lens as *const i32, num_reqs),
                            block_tables: std::slice::from_raw_parts(
                                block_tables as *const i32,
                                num_reqs * max_blocks,
                            ),
                            max_blocks,
                        },
                        reqs: std::slice::from_raw_parts(reqs as *const i32, num_selected),
                        num_rows,
                        cache_shape,
                        scale,
                    },
                    &pool,
                    Kernels::best(),
                )
                .map_err(PyValueError::new_err)
            }
        })
    }

    /// The number of decoder layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.norms.len()
    }
}
