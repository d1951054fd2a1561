//! Binding of fastsched-kernels' quantized matmuls for `fastsched.kernels.quant_matmul_cpu`.
//!
//! Tensors cross as raw addresses (`tensor.data_ptr()`) with their shapes: the Python
//! caller owns the checks of dtype, contiguity and size that make them valid (it is the
//! only caller), and holds the tensors alive for the call. The GIL is released meanwhile.

use std::sync::{Arc, Mutex};

use fastsched_kernels::pool::Pool;
use fastsched_kernels::quant::{self, Act, Int4, Int8, Weight};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

static POOL: Mutex<Option<Arc<Pool>>> = Mutex::new(None);

fn pool() -> Arc<Pool> {
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

/// # Safety (of the callers' contract)
/// Every address points at a live, contiguous buffer of the size the shapes imply.
unsafe fn weight<'a>(n: usize, k: usize, bits: u8, w: [usize; 3]) -> PyResult<Weight<'a>> {
    let kb = k / fastsched_kernels::GROUP;
    Ok(match bits {
        4 => Weight::Int4(Int4 {
            n,
            k,
            packed: std::slice::from_raw_parts(w[0] as *const u8, n * k / 2),
            scale: std::slice::from_raw_parts(w[1] as *const f32, n * kb),
            zero: std::slice::from_raw_parts(w[2] as *const f32, n * kb),
        }),
        8 => Weight::Int8(Int8 {
            n,
            k,
            codes: std::slice::from_raw_parts(w[0] as *const i8, n * k),
            scale: std::slice::from_raw_parts(w[1] as *const f32, n * kb),
        }),
        _ => {
            return Err(PyValueError::new_err(format!(
                "bits must be 4 or 8, got {bits}"
            )))
        }
    })
}

/// `out[M, N] (float32) = x[M, K] · Wᵀ` for a `bits`-bit weight at addresses `w` (int4:
/// packed, scale, zero; int8: codes, scale, 0); `x` float32, or bfloat16 if `x_bf16`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn quant_matmul(
    py: Python<'_>,
    bits: u8,
    n: usize,
    k: usize,
    w: [usize; 3],
    x: usize,
    x_bf16: bool,
    m: usize,
    out: usize,
) -> PyResult<()> {
    let pool = pool();
    let result = py.detach(|| -> PyResult<()> {
        // SAFETY: the caller's contract (module docs).
        let (w, x, out) = unsafe {
            let w = weight(n, k, bits, w)?;
            let x = if x_bf16 {
                Act::Bf16(std::slice::from_raw_parts(x as *const u16, m * k))
            } else {
                Act::F32(std::slice::from_raw_parts(x as *const f32, m * k))
            };
            (w, x, std::slice::from_raw_parts_mut(out as *mut f32, m * n))
        };
        quant::matmul(&w, x, m, out, &pool, quant::best_kernel()).map_err(PyValueError::new_err)
    });
    result
}

/// Writes the whole `bits`-bit weight at `w` as bfloat16 `[N, K]` to `out`.
#[pyfunction]
pub fn quant_dequantize_bf16(
    py: Python<'_>,
    bits: u8,
    n: usize,
    k: usize,
    w: [usize; 3],
    out: usize,
) -> PyResult<()> {
    let pool = pool();
    py.detach(|| -> PyResult<()> {
        // SAFETY: the caller's contract (module docs).
        let (w, out) = unsafe {
            (
                weight(n, k, bits, w)?,
                std::slice::from_raw_parts_mut(out as *mut u16, n * k),
            )
        };
        quant::dequantize_bf16(&w, out, &pool, quant::best_kernel()).map_err(PyValueError::new_err)
    })
}

/// Whether the many-row bf16 GEMM has its SIMD kernel (AVX-512 BF16) on this CPU; without
/// it a dense GEMM after dequantizing is the faster path.
#[pyfunction]
pub fn quant_gemm_simd() -> bool {
    quant::gemm::gemm_kernel() != quant::Kernel::Scalar
}

/// `out[M, N] (float32) = x[M, K] (bfloat16) · Wᵀ` by the many-row bf16 GEMM (the weight
/// decoded once a call into cache-sized blocks, no `[N, K]` temporary).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn quant_gemm_bf16(
    py: Python<'_>,
    bits: u8,
    n: usize,
    k: usize,
    w: [usize; 3],
    x: usize,
    m: usize,
    out: usize,
) -> PyResult<()> {
    let pool = pool();
    py.detach(|| -> PyResult<()> {
        // SAFETY: the caller's contract (module docs).
        let (w, x, out) = unsafe {
            (
                weight(n, k, bits, w)?,
                std::slice::from_raw_parts(x as *const u16, m * k),
                std::slice::from_raw_parts_mut(out as *mut f32, m * n),
            )
        };
        quant::gemm::gemm_bf16(&w, x, m, out, &pool, quant::gemm::gemm_kernel())
            .map_err(PyValueError::new_err)
    })
}
