//! Binding of fastsched-kernels' decoder stack for `fastsched.models.llama_cpu`.
//!
//! As in `kernels`, tensors cross as DLPack capsules ([`crate::dlpack`]): the decoder owns its
//! norms and biases as [`Tensor`]s and its projections as [`PyQuantWeight`]s, so they live as
//! long as it does, and re-reads their views each step; the step's tensors are checked as
//! the ops' are, and no written one may alias anything else of the call (the weights
//! included). The GIL is released while the stack runs.

use fastsched_kernels::attention::Scores;
use fastsched_kernels::attention::{CacheShape, FloatsMut};
use fastsched_kernels::checks::Span;
use fastsched_kernels::decoder::{
    self, Activation, Attention, Dims, Kernels, Layer, Rope, RopeTable,
};
use fastsched_kernels::elementwise::NormWeight;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::{check_no_aliasing, Tensor};
use crate::kernels::{pool, PyQuantWeight};
use crate::ops::StepTensors;

const NORMS: [&str; 6] = [
    "input_norm",
    "post_norm",
    "q_norm",
    "k_norm",
    "attn_out_norm",
    "mlp_out_norm",
];
const BIASES: [&str; 4] = ["qkv_bias", "o_bias", "gate_up_bias", "down_bias"];

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
    /// Per layer: the RMSNorm weights ([`NORMS`]; None: none), bfloat16 or float32.
    norms: Vec<[Option<Tensor>; 6]>,
    options: Vec<Options>,
    /// Per layer: q/k/v, o, gate/up, down.
    weights: Vec<[Py<PyQuantWeight>; 4]>,
    /// Per layer: the bfloat16 biases of the same four (None: none).
    biases: Vec<[Option<Tensor>; 4]>,
    final_norm: Tensor,
}

/// Takes a layer's optional tensors, named `layers[l].name`.
fn take_layer<const N: usize>(
    l: usize,
    names: [&str; N],
    objs: [Option<Bound<'_, PyAny>>; N],
) -> PyResult<[Option<Tensor>; N]> {
    let mut out = [const { None }; N];
    for (i, obj) in objs.into_iter().enumerate() {
        out[i] = Tensor::take_opt(format!("layers[{l}].{}", names[i]), obj.as_ref())?;
    }
    Ok(out)
}

impl PyCpuDecoder {
    /// The crate's view of the layers.
    fn layers<'a>(&'a self) -> PyResult<Vec<Layer<'a>>> {
        fn norm(t: &Option<Tensor>) -> PyResult<Option<NormWeight<'_>>> {
            t.as_ref().map(|t| t.norm_weight()).transpose()
        }
        let mut layers = Vec::with_capacity(self.norms.len());
        for (l, ((norms, weights), (biases, opt))) in self
            .norms
            .iter()
            .zip(&self.weights)
            .zip(self.biases.iter().zip(&self.options))
            .enumerate()
        {
            let [input, post, qn, kn, an, mn] = norms;
            let qk_norms = match (norm(qn)?, norm(kn)?) {
                (Some(q), Some(k)) => Some([q, k]),
                (None, None) => None,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "layer {l}: a q norm and a k norm come together, got one"
                    )))
                }
            };
            let required = |norm: Option<NormWeight<'a>>, name: &str| {
                norm.ok_or_else(|| PyValueError::new_err(format!("layer {l}: {name} is required")))
            };
            let [qkv, o, gate_up, down] = weights.each_ref().map(|w| w.get().weight());
            let mut bias = [None; 4];
            for (b, t) in bias.iter_mut().zip(biases) {
                *b = t.as_ref().map(|t| t.slice::<u16>()).transpose()?;
            }
            layers.push(Layer {
                input_norm: required(norm(input)?, "input_norm")?,
                post_norm: required(norm(post)?, "post_norm")?,
                qk_norms,
                out_norms: [norm(an)?, norm(mn)?],
                qkv: qkv?,
                o: o?,
                gate_up: gate_up?,
                down: down?,
                biases: bias,
                activation: opt.activation,
                scores: opt.scores,
                rope_table: opt.rope_table,
            });
        }
        Ok(layers)
    }

    /// The bytes every weight, norm and bias spans (read by every step).
    fn spans(&self) -> impl Iterator<Item = Span<'_>> {
        let tensors = self
            .norms
            .iter()
            .flatten()
            .chain(self.biases.iter().flatten())
            .flatten();
        tensors
            .chain(std::iter::once(&self.final_norm))
            .map(|t| t.span(false, false))
            .chain(self.weights.iter().flatten().flat_map(|w| w.get().spans()))
    }
}

#[pymethods]
impl PyCpuDecoder {
    /// `sizes`: hidden, num_heads, num_kv_heads, head_dim, intermediate; `dense_min_rows`:
    /// activation rows from which a linear layer runs the many-row GEMM; `norms`: per layer
    /// the input, post (before the MLP), q, k, attn_out and mlp_out RMSNorm weights (None:
    /// none; the first two required), bfloat16, or float32 (Gemma's `1 + w`), as the final
    /// norm; `weights`: per layer the q/k/v, o, gate/up and down [`PyQuantWeight`]s;
    /// `biases`: per layer their bfloat16 biases (None: none); `options`: per layer the
    /// activation ("silu", "gelu_tanh"), sliding window, RoPE table, logit soft-cap and
    /// attention scale. Tensors are DLPack capsules or objects with `__dlpack__`, compact,
    /// on the CPU. Fails naming the layer and part whose shape or option does not fit.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        sizes: [usize; 5],
        eps: f32,
        dense_min_rows: usize,
        norms: Vec<[Option<Bound<'_, PyAny>>; 6]>,
        weights: Vec<[Py<PyQuantWeight>; 4]>,
        biases: Vec<[Option<Bound<'_, PyAny>>; 4]>,
        final_norm: &Bound<'_, PyAny>,
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
        let options = options
            .into_iter()
            .enumerate()
            .map(|(l, o)| Options::parse(l, o))
            .collect::<PyResult<Vec<_>>>()?;
        let norms = norms
            .into_iter()
            .enumerate()
            .map(|(l, n)| take_layer(l, NORMS, n))
            .collect::<PyResult<Vec<_>>>()?;
        let biases = biases
            .into_iter()
            .enumerate()
            .map(|(l, b)| take_layer(l, BIASES, b))
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
            options,
            weights,
            biases,
            final_norm: Tensor::take("final_norm", final_norm)?,
        };
        decoder::validate(&this.dims, &this.layers()?, this.final_norm.norm_weight()?)
            .map_err(PyValueError::new_err)?;
        Ok(this)
    }

    /// Runs every layer on the bfloat16 residual stream `hidden [rows, hidden]` (updated in
    /// place) and writes the final-normed `out [rows, hidden]`.
    ///
    /// `positions [rows]` int64 index the bfloat16 RoPE `tables`, a `(cos, sin)` pair of
    /// `[len, head_dim]` tables per RoPE (the layers' options name theirs); `caches`: each
    /// layer's `[2, num_blocks, block_size, H_kv, D]` cache, all alike (bfloat16 or float32);
    /// the step's tensors as `paged_attention`'s, the requests attended owning every row
    /// below `num_rows` (the rest are padding).
    #[pyo3(signature = (hidden, out, positions, tables, caches, slot_mapping, query_start_loc,
                        seq_lens, block_tables, reqs, num_rows))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        hidden: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        positions: &Bound<'_, PyAny>,
        tables: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        caches: Vec<Bound<'_, PyAny>>,
        slot_mapping: &Bound<'_, PyAny>,
        query_start_loc: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        reqs: &Bound<'_, PyAny>,
        num_rows: usize,
    ) -> PyResult<()> {
        let dims = self.dims;
        let h = Tensor::take("hidden", hidden)?;
        let o = Tensor::take("out", out)?;
        let p = Tensor::take("positions", positions)?;
        let step =
            StepTensors::take([slot_mapping, query_start_loc, seq_lens, block_tables, reqs])?;
        let tables = tables
            .iter()
            .enumerate()
            .map(|(i, (c, s))| {
                Ok((
                    Tensor::take(format!("tables[{i}].cos"), c)?,
                    Tensor::take(format!("tables[{i}].sin"), s)?,
                ))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let caches = caches
            .iter()
            .enumerate()
            .map(|(l, c)| Tensor::take(format!("caches[{l}]"), c))
            .collect::<PyResult<Vec<_>>>()?;
        h.expect_ndim(2)?;
        p.expect_ndim(1)?;
        let shape = caches.first().map_or(&[][..], |c| c.shape());
        if let Some(c) = caches
            .iter()
            .find(|c| c.shape() != shape || c.dtype() != caches[0].dtype())
        {
            return Err(PyValueError::new_err(format!(
                "{} is {} {:?}, caches[0] {} {shape:?}: the caches must be alike",
                c.name(),
                c.dtype().name(),
                c.shape(),
                caches[0].dtype().name()
            )));
        }
        if caches.first().is_some_and(|c| {
            c.shape().len() != 5
                || (c.dim(0), c.dim(3), c.dim(4)) != (2, dims.num_kv_heads, dims.head_dim)
        }) || h.dim(1) != dims.hidden
            || o.shape() != h.shape()
        {
            return Err(PyValueError::new_err(format!(
                "hidden {:?}, out {:?} and caches[0] {shape:?}: not [rows, {}] twice and \
                 [2, blocks, block_size, {}, {}]",
                h.shape(),
                o.shape(),
                dims.hidden,
                dims.num_kv_heads,
                dims.head_dim
            )));
        }
        let c0 = caches.first();
        let cache_shape = CacheShape {
            num_blocks: c0.map_or(0, |c| c.dim(1)),
            block_size: c0.map_or(0, |c| c.dim(2)),
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
        };
        let layers = self.layers()?;
        let final_norm = self.final_norm.norm_weight()?;
        let mut cache_views = caches
            .iter()
            .map(|c| c.floats_mut())
            .collect::<PyResult<Vec<FloatsMut>>>()?;
        let table_views = tables
            .iter()
            .map(|(c, s)| {
                Ok(RopeTable {
                    cos: c.slice()?,
                    sin: s.slice()?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let hs = h.slice_mut::<u16>()?;
        let os = o.slice_mut::<u16>()?;
        let ps = p.slice::<i64>()?;
        let (view, slots, reqs) = step.views()?;
        let mut spans: Vec<Span> = self.spans().collect();
        spans.extend(caches.iter().map(|c| c.span(false, true)));
        spans.extend(
            tables
                .iter()
                .flat_map(|(c, s)| [c.span(false, false), s.span(false, false)]),
        );
        spans.extend([
            h.span(false, true),
            o.span(false, true),
            p.span(false, false),
        ]);
        spans.extend(step.spans());
        check_no_aliasing(&spans)?;
        let pool = pool();
        py.detach(|| {
            decoder::forward(
                &dims,
                &layers,
                final_norm,
                &mut cache_views,
                hs,
                os,
                Rope {
                    positions: ps,
                    tables: &table_views,
                },
                Attention {
                    slot_mapping: slots,
                    step: view,
                    reqs,
                    num_rows,
                    cache_shape,
                },
                &pool,
                Kernels::best(),
            )
        })
        .map_err(PyValueError::new_err)
    }

    /// The number of decoder layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.norms.len()
    }
}
