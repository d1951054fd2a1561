//! Binding of fastsched-kernels' quantized matmuls for `fastsched.kernels.quant_matmul_cpu`.
//!
//! Tensors cross as DLPack capsules ([`crate::dlpack`]), checked here for dtype, layout and
//! alignment, their lengths by the crate; the GIL is released while a kernel runs. A weight
//! is a [`PyQuantWeight`], which owns its buffers for as long as it lives.

use std::sync::{Arc, Mutex};

use fastsched_kernels::checks::Span;
use fastsched_kernels::pool::Pool;
use fastsched_kernels::quant::{self, Act, Int4, Int8, Weight};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::dlpack::{check_no_aliasing, DType, Tensor};

static POOL: Mutex<Option<Arc<Pool>>> = Mutex::new(None);

pub(crate) fn pool() -> Arc<Pool> {
    let mut p = POOL.lock().unwrap();
    Arc::clone(p.get_or_insert_with(|| Arc::new(Pool::new(1))))
}

/// Sets the cores a kernel call uses (the caller plus `threads − 1` pool workers).
#[pyfunction]
pub fn set_kernel_threads(threads: usize) {
    let mut p = POOL.lock().unwrap();
    if p.as_ref().map(|p| p.threads()) != Some(threads.max(1)) {
        *p = Some(Arc::new(Pool::new(threads.max(1))));
    }
}

/// The cores a kernel call uses.
#[pyfunction]
pub fn kernel_threads() -> usize {
    pool().threads()
}

/// The instruction set the kernels run with on this CPU: "avx512_vnni" or "scalar".
#[pyfunction]
pub fn kernel_isa() -> &'static str {
    match quant::best_kernel() {
        quant::Kernel::Avx512Vnni => "avx512_vnni",
        quant::Kernel::Scalar => "scalar",
    }
}

/// An int4 or int8 weight's buffers, checked once against its shape and kept alive with it.
#[pyclass(name = "QuantWeight", module = "fastsched._core", frozen)]
pub struct PyQuantWeight {
    bits: u8,
    scale_group: usize,
    n: usize,
    k: usize,
    /// int4: packed `[N, K/2]` uint8; int8: codes `[N, K]` int8.
    data: Tensor,
    scale: Tensor,
    zero: Option<Tensor>,
}

impl PyQuantWeight {
    /// The crate's view of the weight (its buffers re-read, so nothing is trusted from `new`).
    pub(crate) fn weight(&self) -> PyResult<Weight<'_>> {
        let (n, k) = (self.n, self.k);
        Ok(match &self.zero {
            Some(zero) if self.bits == 4 => Weight::Int4(Int4 {
                n,
                k,
                packed: self.data.slice()?,
                scale: self.scale.slice()?,
                zero: zero.slice()?,
            }),
            zero => Weight::Int8(Int8 {
                n,
                k,
                codes: self.data.slice()?,
                scale: self.scale.slice()?,
                zero: zero.as_ref().map(|z| z.slice()).transpose()?,
                scale_group: self.scale_group,
            }),
        })
    }

    /// The bytes its buffers span (read by every call).
    pub(crate) fn spans(&self) -> impl Iterator<Item = Span<'_>> {
        [Some(&self.data), Some(&self.scale), self.zero.as_ref()]
            .into_iter()
            .flatten()
            .map(|t| t.span(false, false))
    }
}

#[pymethods]
impl PyQuantWeight {
    /// `W [N, K]`: int4 (`bits` 4) from `data` = packed `[N, K/2]` uint8 (the crate's layout)
    /// and `scale`, `zero` `[N, K/32]` float32; int8 from `data` = codes `[N, K]` int8,
    /// `scale` `[N, K/scale_group]` float32 (`scale_group` 32, or 16 as GGUF Q6_K) and
    /// optionally `zero` `[N, K/32]` float32. Buffers are DLPack capsules or objects with
    /// `__dlpack__`, compact, on the CPU. Fails naming the buffer that does not fit.
    #[new]
    #[pyo3(signature = (bits, scale_group, n, k, data, scale, zero=None))]
    fn new(
        bits: u8,
        scale_group: usize,
        n: usize,
        k: usize,
        data: &Bound<'_, PyAny>,
        scale: &Bound<'_, PyAny>,
        zero: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if !(bits == 4 && scale_group == fastsched_kernels::GROUP
            || bits == 8 && quant::SCALE_GROUPS.contains(&scale_group))
        {
            return Err(PyValueError::new_err(format!(
                "bits {bits} with scale_group {scale_group}: int4 takes 32, int8 {:?}",
                quant::SCALE_GROUPS
            )));
        }
        let this = PyQuantWeight {
            bits,
            scale_group,
            n,
            k,
            data: Tensor::take(if bits == 4 { "packed" } else { "codes" }, data)?,
            scale: Tensor::take("scale", scale)?,
            zero: Tensor::take_opt("zero", zero)?,
        };
        if bits == 4 && this.zero.is_none() {
            return Err(PyValueError::new_err("an int4 weight needs its zero"));
        }
        this.weight()?.validate().map_err(PyValueError::new_err)?;
        Ok(this)
    }

    #[getter]
    fn bits(&self) -> u8 {
        self.bits
    }

    #[getter]
    fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }
}

/// `out [M, N]` float32 of an activation `x [M, K]` and the weight's `N`, after checking both
/// and that `out` aliases nothing the call reads.
fn rows_out<'a>(
    w: &'a PyQuantWeight,
    x: &'a Tensor,
    out: &'a Tensor,
) -> PyResult<(Weight<'a>, &'a mut [f32], usize)> {
    x.expect_ndim(2)?;
    out.expect_ndim(2)?;
    let weight = w.weight()?;
    let out_slice = out.slice_mut::<f32>()?;
    let mut spans: Vec<Span> = w.spans().collect();
    spans.extend([x.span(false, false), out.span(false, true)]);
    check_no_aliasing(&spans)?;
    Ok((weight, out_slice, x.dim(0)))
}

/// `out [M, N]` (float32) `= x [M, K] · Wᵀ` for the weight `w`; `x` float32 or bfloat16.
#[pyfunction]
pub fn quant_matmul(
    py: Python<'_>,
    w: &PyQuantWeight,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (x, out) = (Tensor::take("x", x)?, Tensor::take("out", out)?);
    let act = match x.dtype() {
        DType::F32 => Act::F32(x.slice()?),
        DType::Bf16 => Act::Bf16(x.slice()?),
        other => {
            return Err(PyTypeError::new_err(format!(
                "x must be float32 or bfloat16; got {}",
                other.name()
            )))
        }
    };
    let (weight, out, m) = rows_out(w, &x, &out)?;
    let pool = pool();
    py.detach(|| quant::matmul(&weight, act, m, out, &pool, quant::best_kernel()))
        .map_err(PyValueError::new_err)
}

/// Writes the whole weight `w` as bfloat16 `out [N, K]`.
#[pyfunction]
pub fn quant_dequantize_bf16(
    py: Python<'_>,
    w: &PyQuantWeight,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let out = Tensor::take("out", out)?;
    let weight = w.weight()?;
    let slice = out.slice_mut::<u16>()?;
    let mut spans: Vec<Span> = w.spans().collect();
    spans.push(out.span(false, true));
    check_no_aliasing(&spans)?;
    let pool = pool();
    py.detach(|| quant::dequantize_bf16(&weight, slice, &pool, quant::best_kernel()))
        .map_err(PyValueError::new_err)
}

/// Whether the many-row bf16 GEMM has its SIMD kernel (AVX-512 BF16) on this CPU; without
/// it a dense GEMM after dequantizing is the faster path.
#[pyfunction]
pub fn quant_gemm_simd() -> bool {
    quant::gemm::gemm_kernel() != quant::Kernel::Scalar
}

/// `out [M, N]` (float32) `= x [M, K]` (bfloat16) `· Wᵀ` by the many-row bf16 GEMM (the
/// weight decoded once a call into cache-sized blocks, no `[N, K]` temporary).
#[pyfunction]
pub fn quant_gemm_bf16(
    py: Python<'_>,
    w: &PyQuantWeight,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (x, out) = (Tensor::take("x", x)?, Tensor::take("out", out)?);
    let act = x.slice::<u16>()?;
    let (weight, out, m) = rows_out(w, &x, &out)?;
    let pool = pool();
    py.detach(|| quant::gemm::gemm_bf16(&weight, act, m, out, &pool, quant::gemm::gemm_kernel()))
        .map_err(PyValueError::new_err)
}
