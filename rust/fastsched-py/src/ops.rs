//! Binding of fastsched-kernels' paged attention and elementwise ops for
//! `fastsched.kernels.cpu_ops`.
//!
//! As in `kernels`: tensors cross as DLPack capsules ([`crate::dlpack`]), their dtype,
//! layout and alignment checked here and that a written one aliases nothing else of the call,
//! their lengths and ranges (slots, blocks, positions, rows) by the crate; the GIL is
//! released while a kernel runs. Sizes come from the tensors' shapes, never from Python ints.

use fastsched_kernels::attention::{self, CacheShape, Floats, FloatsMut, Scores, Step};
use fastsched_kernels::elementwise;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::dlpack::{check_no_aliasing, Tensor};
use crate::kernels::pool;

fn mismatch(what: String) -> PyErr {
    PyValueError::new_err(what)
}

/// Fails (TypeError) unless every tensor has the first one's dtype.
fn same_dtype(tensors: &[&Tensor]) -> PyResult<()> {
    let first = tensors[0];
    match tensors.iter().find(|t| t.dtype() != first.dtype()) {
        Some(t) => Err(PyTypeError::new_err(format!(
            "{} is {}, {} {}: they must match",
            t.name(),
            t.dtype().name(),
            first.name(),
            first.dtype().name()
        ))),
        None => Ok(()),
    }
}

/// The step's metadata: slot_mapping `[T]` int64, then int32 query_start_loc `[B + 1]`,
/// seq_lens `[B]`, block_tables `[B, max_blocks]` and the requests attended `[S]`.
pub(crate) struct StepTensors {
    pub slots: Tensor,
    pub qsl: Tensor,
    pub seq_lens: Tensor,
    pub tables: Tensor,
    pub reqs: Tensor,
}

impl StepTensors {
    pub(crate) fn take(objs: [&Bound<'_, PyAny>; 5]) -> PyResult<StepTensors> {
        let [slots, qsl, seq_lens, tables, reqs] = objs;
        let step = StepTensors {
            slots: Tensor::take("slot_mapping", slots)?,
            qsl: Tensor::take("query_start_loc", qsl)?,
            seq_lens: Tensor::take("seq_lens", seq_lens)?,
            tables: Tensor::take("block_tables", tables)?,
            reqs: Tensor::take("reqs", reqs)?,
        };
        for t in [&step.slots, &step.qsl, &step.seq_lens, &step.reqs] {
            t.expect_ndim(1)?;
        }
        step.tables.expect_ndim(2)?;
        Ok(step)
    }

    /// The crate's view (lengths checked by the kernels), and the slot mapping.
    pub(crate) fn views(&self) -> PyResult<(Step<'_>, &[i64], &[i32])> {
        let step = Step {
            query_start_loc: self.qsl.slice()?,
            seq_lens: self.seq_lens.slice()?,
            block_tables: self.tables.slice()?,
            max_blocks: self.tables.dim(1),
        };
        Ok((step, self.slots.slice()?, self.reqs.slice()?))
    }

    pub(crate) fn spans(&self) -> [fastsched_kernels::checks::Span<'_>; 5] {
        [
            &self.slots,
            &self.qsl,
            &self.seq_lens,
            &self.tables,
            &self.reqs,
        ]
        .map(|t| t.span(false, false))
    }
}

/// Writes a step's keys and values into one layer's paged cache at `slot_mapping`, then
/// attends for the requests listed in `reqs` (their query rows of `out`).
///
/// query `[T, H, D]`, key and value `[T, H_kv, D]` (rows compact, any distance apart; key's
/// and value's the same), out `[T, H, D]` compact, all float32 or all bfloat16; kv_cache
/// `[2, num_blocks, block_size, H_kv, D]` compact, float32 or bfloat16; the step's tensors as
/// [`StepTensors`]. `scale`, `softcap` and `window`: the layer's scores (the crate's `Scores`).
#[pyfunction]
#[pyo3(signature = (query, key, value, out, kv_cache, slot_mapping, query_start_loc, seq_lens,
                    block_tables, reqs, scale, softcap=None, window=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    py: Python<'_>,
    query: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    kv_cache: &Bound<'_, PyAny>,
    slot_mapping: &Bound<'_, PyAny>,
    query_start_loc: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    reqs: &Bound<'_, PyAny>,
    scale: f32,
    softcap: Option<f32>,
    window: Option<usize>,
) -> PyResult<()> {
    let q = Tensor::take("query", query)?;
    let k = Tensor::take("key", key)?;
    let v = Tensor::take("value", value)?;
    let o = Tensor::take("out", out)?;
    let cache = Tensor::take("kv_cache", kv_cache)?;
    let step = StepTensors::take([slot_mapping, query_start_loc, seq_lens, block_tables, reqs])?;
    for t in [&q, &k, &v, &o] {
        t.expect_ndim(3)?;
    }
    cache.expect_ndim(5)?;
    same_dtype(&[&q, &k, &v, &o])?;
    let shape = CacheShape {
        num_blocks: cache.dim(1),
        block_size: cache.dim(2),
        num_kv_heads: cache.dim(3),
        head_dim: cache.dim(4),
    };
    let tokens = q.dim(0);
    let rows = [&k, &v, &o].map(|t| t.dim(0));
    let heads = [&k, &v].map(|t| (t.dim(1), t.dim(2)));
    if cache.dim(0) != 2
        || rows.iter().any(|&r| r != tokens)
        || step.slots.dim(0) != tokens
        || heads
            .iter()
            .any(|&h| h != (shape.num_kv_heads, shape.head_dim))
        || (o.dim(1), o.dim(2), q.dim(2)) != (q.dim(1), q.dim(2), shape.head_dim)
    {
        return Err(mismatch(format!(
            "query {:?}, key {:?}, value {:?}, out {:?}, slot_mapping {:?} and kv_cache {:?} \
             do not agree",
            q.shape(),
            k.shape(),
            v.shape(),
            o.shape(),
            step.slots.shape(),
            cache.shape()
        )));
    }
    let (qf, q_stride) = q.float_rows()?;
    let (kf, kv_stride) = k.float_rows()?;
    let (vf, v_stride) = v.float_rows()?;
    if tokens > 1 && v_stride != kv_stride {
        return Err(mismatch(format!(
            "key's rows are {kv_stride} elements apart, value's {v_stride}: they must match"
        )));
    }
    let mut of = o.floats_mut()?;
    let mut cf = cache.floats_mut()?;
    let (view, slots, reqs) = step.views()?;
    let mut spans = vec![
        q.span(true, false),
        k.span(true, false),
        v.span(true, false),
        o.span(false, true),
        cache.span(false, true),
    ];
    spans.extend(step.spans());
    check_no_aliasing(&spans)?;
    let scores = Scores {
        scale,
        softcap,
        window,
    };
    let num_heads = q.dim(1);
    let pool = pool();
    py.detach(|| -> Result<(), String> {
        attention::write_cache(kf, vf, kv_stride, slots, &mut cf, shape)?;
        let cache = match &cf {
            FloatsMut::F32(c) => Floats::F32(c),
            FloatsMut::Bf16(c) => Floats::Bf16(c),
        };
        attention::paged_attention(
            qf,
            q_stride,
            &mut of,
            num_heads,
            cache,
            shape,
            view,
            reqs,
            scores,
            &pool,
            attention::best_isa(),
        )
    })
    .map_err(PyValueError::new_err)
}

/// RMSNorm of the bfloat16 residual stream `hidden [M, N]` into `out [M, N]`, after adding
/// `delta [M, N]` to `hidden` in place (None: no add); all compact. `weight [N]` bfloat16,
/// or float32 (Gemma's `1 + w`, one rounding).
#[pyfunction]
#[pyo3(signature = (hidden, delta, weight, out, eps))]
pub fn add_rms_norm_bf16(
    py: Python<'_>,
    hidden: &Bound<'_, PyAny>,
    delta: Option<&Bound<'_, PyAny>>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let h = Tensor::take("hidden", hidden)?;
    let d = Tensor::take_opt("delta", delta)?;
    let w = Tensor::take("weight", weight)?;
    let o = Tensor::take("out", out)?;
    h.expect_ndim(2)?;
    w.expect_ndim(1)?;
    if h.dim(1) != w.dim(0)
        || o.shape() != h.shape()
        || d.as_ref().is_some_and(|d| d.shape() != h.shape())
    {
        return Err(mismatch(format!(
            "hidden {:?}, delta {:?}, weight {:?} and out {:?}: not [M, N], [M, N], [N], [M, N]",
            h.shape(),
            d.as_ref().map(|d| d.shape()),
            w.shape(),
            o.shape()
        )));
    }
    let hs = h.slice_mut::<u16>()?;
    let ds = d.as_ref().map(|d| d.slice::<u16>()).transpose()?;
    let ws = w.norm_weight()?;
    let os = o.slice_mut::<u16>()?;
    let mut spans = vec![
        h.span(false, true),
        w.span(false, false),
        o.span(false, true),
    ];
    spans.extend(d.as_ref().map(|d| d.span(false, false)));
    check_no_aliasing(&spans)?;
    py.detach(|| elementwise::add_rms_norm_bf16(hs, ds, ws, eps, os))
        .map_err(PyValueError::new_err)
}

/// Fails unless `x [T, W]` has room for `heads` heads of `head_dim` in a row.
fn check_heads(x: &Tensor, heads: usize, head_dim: usize) -> PyResult<()> {
    x.expect_ndim(2)?;
    if heads.saturating_mul(head_dim) > x.dim(1) {
        return Err(mismatch(format!(
            "x {:?} has no room for {heads} heads of {head_dim} a row",
            x.shape()
        )));
    }
    Ok(())
}

/// Rotate-half RoPE in place on the first `heads` heads of `head_dim` of each row of
/// `x [T, W]` (rows compact, any distance apart), row `t` by row `positions[t]` (int64 `[T]`)
/// of the `[len, head_dim]` tables `cos` and `sin`, all of `x`'s dtype.
#[pyfunction]
pub fn rope(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    heads: usize,
    head_dim: usize,
    positions: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = Tensor::take("x", x)?;
    let p = Tensor::take("positions", positions)?;
    let cos = Tensor::take("cos", cos)?;
    let sin = Tensor::take("sin", sin)?;
    check_heads(&x, heads, head_dim)?;
    p.expect_ndim(1)?;
    same_dtype(&[&x, &cos, &sin])?;
    if p.dim(0) != x.dim(0) || cos.expect_ndim(2)?.dim(1) != head_dim || sin.shape() != cos.shape()
    {
        return Err(mismatch(format!(
            "x {:?}, positions {:?}, cos {:?} and sin {:?}: not [T, >= {heads} x {head_dim}], [T], \
             [len, {head_dim}] twice",
            x.shape(),
            p.shape(),
            cos.shape(),
            sin.shape()
        )));
    }
    let (mut xs, stride) = x.float_rows_mut()?;
    let ps = p.slice::<i64>()?;
    let (cs, ss) = (cos.floats()?, sin.floats()?);
    check_no_aliasing(&[
        x.span(true, true),
        p.span(false, false),
        cos.span(false, false),
        sin.span(false, false),
    ])?;
    py.detach(|| elementwise::rope(&mut xs, stride, heads, head_dim, ps, cs, ss))
        .map_err(PyValueError::new_err)
}

/// RMSNorm in place on the first `heads` heads of `weight`'s length of each row of the
/// bfloat16 `x [T, W]` (rows compact, any distance apart), one `weight` (as
/// [`add_rms_norm_bf16`]'s).
#[pyfunction]
pub fn rms_norm_heads_bf16(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    heads: usize,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let x = Tensor::take("x", x)?;
    let w = Tensor::take("weight", weight)?;
    w.expect_ndim(1)?;
    check_heads(&x, heads, w.dim(0))?;
    let (xs, stride) = x.rows_mut::<u16>()?;
    let ws = w.norm_weight()?;
    check_no_aliasing(&[x.span(true, true), w.span(false, false)])?;
    let rows = x.dim(0);
    py.detach(|| elementwise::rms_norm_heads_bf16(xs, stride, rows, heads, ws, eps))
        .map_err(PyValueError::new_err)
}

type ActMul = fn(&[u16], &mut [u16], usize) -> Result<(), String>;

/// `out [M, I] = act(gate) · up` of a compact bfloat16 `gate_up [M, 2I]` (gate first).
fn act_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    kernel: ActMul,
) -> PyResult<()> {
    let g = Tensor::take("gate_up", gate_up)?;
    let o = Tensor::take("out", out)?;
    g.expect_ndim(2)?;
    o.expect_ndim(2)?;
    if g.dim(0) != o.dim(0) || g.dim(1) != 2 * o.dim(1) {
        return Err(mismatch(format!(
            "gate_up {:?} and out {:?}: not [M, 2I] and [M, I]",
            g.shape(),
            o.shape()
        )));
    }
    let gs = g.slice::<u16>()?;
    let os = o.slice_mut::<u16>()?;
    check_no_aliasing(&[g.span(false, false), o.span(false, true)])?;
    let inner = o.dim(1);
    if os.is_empty() {
        return Ok(()); // no rows (the crate takes `inner` > 0)
    }
    py.detach(|| kernel(gs, os, inner))
        .map_err(PyValueError::new_err)
}

/// `out [M, I] = silu(gate) · up` for bfloat16 `gate_up [M, 2I]`.
#[pyfunction]
pub fn silu_mul_bf16(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    act_mul(py, gate_up, out, elementwise::silu_mul_bf16)
}

/// `out [M, I] = gelu_tanh(gate) · up` for bfloat16 `gate_up [M, 2I]`.
#[pyfunction]
pub fn gelu_tanh_mul_bf16(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    act_mul(py, gate_up, out, elementwise::gelu_tanh_mul_bf16)
}
