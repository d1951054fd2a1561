//! Binding of fastsched-kernels' decoder stack for `fastsched.models.llama_cpu`.
//!
//! As in `kernels`, tensors cross as addresses: the Python owner checks dtypes, shapes and
//! contiguity once, keeps every weight tensor alive as long as this object, and the step's
//! tensors for the call. The GIL is released while the stack runs.

use fastsched_kernels::attention::{CacheShape, FloatsMut, Scores, Step};
use fastsched_kernels::decoder::{
    self, Activation, Attention, Dims, Kernels, Layer, Rope, RopeTable,
};
use fastsched_kernels::elementwise::NormWeight;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{pool, weight, WeightSpec};

/// A layer's options as Python gives them: activation ("silu" or "gelu_tanh"), sliding
/// window, RoPE table, logit soft-cap, attention scale.
type LayerOptions = (String, Option<usize>, usize, Option<f32>, f32);

/// Per layer: the options the kernels take, checked once.
#[derive(Clone, Copy)]
struct Options {
    activation: Activation,
    scores: Scores,
    rope_table: usize,
}

impl Options {
    fn parse(
        l: usize,
        (activation, window, rope_table, softcap, scale): LayerOptions,
    ) -> PyResult<Self> {
        let activation = match activation.as_str() {
            "silu" => Activation::Silu,
            "gelu_tanh" => Activation::GeluTanh,
            other => {
                return Err(PyValueError::new_err(format!(
                    "layer {l}: activation must be 'silu' or 'gelu_tanh', got {other:?}"
                )))
            }
        };
        Ok(Options {
            activation,
            scores: Scores {
                scale,
                softcap,
                window,
            },
            rope_table,
        })
    }
}

/// The decoder layers of a Llama-family model with quantized linears, run as one call a
/// step (`fastsched_kernels::decoder`).
#[pyclass(name = "CpuDecoder", module = "fastsched._core", frozen)]
pub struct PyCpuDecoder {
    dims: Dims,
    /// Per layer: the RMSNorm weights' addresses, input, post (before the MLP), q, k, attn_out,
    /// mlp_out (0: none), bfloat16 or (`norms_f32`) float32.
    norms: Vec<[usize; 6]>,
    norms_f32: bool,
    options: Vec<Options>,
    /// Per layer: q/k/v, o, gate/up, down.
    weights: Vec<[WeightSpec; 4]>,
    /// Per layer: the bfloat16 biases of the same four (0: none).
    biases: Vec<[usize; 4]>,
    final_norm: usize,
}

impl PyCpuDecoder {
    /// # Safety
    /// As [`Self::layers`].
    unsafe fn final_norm<'a>(&self) -> NormWeight<'a> {
        let (addr, h) = (self.final_norm, self.dims.hidden);
        if self.norms_f32 {
            NormWeight::F32(std::slice::from_raw_parts(addr as *const f32, h))
        } else {
            NormWeight::Bf16(std::slice::from_raw_parts(addr as *const u16, h))
        }
    }

    /// # Safety
    /// The addresses are live for `'a` (the owner's contract, module docs).
    unsafe fn layers<'a>(&self) -> PyResult<Vec<Layer<'a>>> {
        let (h, d) = (self.dims.hidden, self.dims.head_dim);
        let f32_weights = self.norms_f32;
        let norm = |addr: usize, len: usize| {
            (addr != 0).then(|| {
                if f32_weights {
                    NormWeight::F32(std::slice::from_raw_parts(addr as *const f32, len))
                } else {
                    NormWeight::Bf16(std::slice::from_raw_parts(addr as *const u16, len))
                }
            })
        };
        let w = |spec: WeightSpec| weight(spec);
        let bias = |addr: usize, (_, _, n, _, _): WeightSpec| {
            (addr != 0).then(|| std::slice::from_raw_parts(addr as *const u16, n))
        };
        self.norms
            .iter()
            .zip(&self.weights)
            .zip(&self.biases)
            .zip(&self.options)
            .enumerate()
            .map(
                |(
                    l,
                    (
                        (
                            (&[input, post, qn, kn, an, mn], &[qkv, o, gate_up, down]),
                            &[bq, bo, bg, bd],
                        ),
                        opt,
                    ),
                )| {
                    let qk_norms = match (norm(qn, d), norm(kn, d)) {
                        (Some(q), Some(k)) => Some([q, k]),
                        (None, None) => None,
                        _ => {
                            return Err(PyValueError::new_err(format!(
                                "layer {l}: a q norm and a k norm come together, got one"
                            )))
                        }
                    };
                    let required = |addr: usize, name: &str| {
                        norm(addr, h).ok_or_else(|| {
                            PyValueError::new_err(format!("layer {l}: {name} is required"))
                        })
                    };
                    Ok(Layer {
                        input_norm: required(input, "input_norm")?,
                        post_norm: required(post, "post_norm")?,
                        qk_norms,
                        out_norms: [norm(an, h), norm(mn, h)],
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
                        activation: opt.activation,
                        scores: opt.scores,
                        rope_table: opt.rope_table,
                    })
                },
            )
            .collect()
    }
}

#[pymethods]
impl PyCpuDecoder {
    /// `sizes`: hidden, num_heads, num_kv_heads, head_dim, intermediate; `dense_min_rows`:
    /// activation rows from which a linear layer runs the many-row GEMM; `norms`: per layer
    /// the addresses of the input, post (before the MLP), q, k, attn_out and mlp_out RMSNorm
    /// weights (0: none; the first two required), all bfloat16, or all float32 if `norms_f32`
    /// (Gemma's `1 + w`), the final norm too; `biases`: per layer the addresses of the four
    /// projections' bfloat16 biases (0: none); `options`: per layer the activation ("silu",
    /// "gelu_tanh"), sliding window, RoPE table, logit soft-cap and attention scale. Fails
    /// naming the layer and part whose shape or option does not fit.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        sizes: [usize; 5],
        eps: f32,
        dense_min_rows: usize,
        norms: Vec<[usize; 6]>,
        norms_f32: bool,
        weights: Vec<[WeightSpec; 4]>,
        biases: Vec<[usize; 4]>,
        final_norm: usize,
        options: Vec<LayerOptions>,
    ) -> PyResult<Self> {
        let [hidden, num_heads, num_kv_heads, head_dim, intermediate] = sizes;
        if norms.len() != weights.len()
            || biases.len() != weights.len()
            || options.len() != weights.len()
        {
            return Err(PyValueError::new_err(format!(
                "{} layers of norms, {} of weights, {} of biases and {} of options",
                norms.len(),
                weights.len(),
                biases.len(),
                options.len()
            )));
        }
        if final_norm == 0 {
            return Err(PyValueError::new_err("final_norm is required"));
        }
        let options = options
            .into_iter()
            .enumerate()
            .map(|(l, o)| Options::parse(l, o))
            .collect::<PyResult<Vec<_>>>()?;
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
            norms_f32,
            options,
            weights,
            biases,
            final_norm,
        };
        // SAFETY: the owner's contract (module docs).
        unsafe {
            let layers = this.layers()?;
            decoder::validate(&this.dims, &layers, this.final_norm())
                .map_err(PyValueError::new_err)?;
        }
        Ok(this)
    }

    /// Runs every layer on the bfloat16 residual stream `hidden [rows, hidden]` (updated in
    /// place) and writes the final-normed `out [rows, hidden]`.
    ///
    /// `positions [rows]` int64 index the bfloat16 RoPE `tables`, per RoPE (cos, sin, len:
    /// `[len, head_dim]` each; the layers' options name theirs); `caches`: each layer's `[2, num_blocks, block_size, H_kv, D]` cache
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
        tables: Vec<(usize, usize, usize)>,
        caches: Vec<usize>,
        cache_bf16: bool,
        cache_blocks: [usize; 2],
        step: [usize; 5],
        num_reqs: usize,
        max_blocks: usize,
        num_selected: usize,
        num_rows: usize,
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
                let table = |a: usize, len: usize| {
                    std::slice::from_raw_parts(a as *const u16, len * dims.head_dim)
                };
                let tables: Vec<RopeTable> = tables
                    .iter()
                    .map(|&(cos, sin, len)| RopeTable {
                        cos: table(cos, len),
                        sin: table(sin, len),
                    })
                    .collect();
                let [slots, qsl, seq_lens, block_tables, reqs] = step;
                let n = rows * dims.hidden;
                decoder::forward(
                    &dims,
                    &layers,
                    self.final_norm(),
                    &mut caches,
                    std::slice::from_raw_parts_mut(hidden as *mut u16, n),
                    std::slice::from_raw_parts_mut(out as *mut u16, n),
                    Rope {
                        positions: std::slice::from_raw_parts(positions as *const i64, rows),
                        tables: &tables,
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
