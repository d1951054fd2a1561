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

/// A weight as `fastsched.kernels.quant_matmul_cpu.CpuQuantWeight.spec` gives it: bits (4 or
/// 8), the columns a scale covers (32, or 16 for int8), N, K, and its buffers' addresses
/// (int4: packed, scale, zero; int8: codes, scale, zero or 0 for none).
pub(crate) type WeightSpec = (u8, usize, usize, usize, [usize; 3]);

/// # Safety (of the callers' contract)
/// Every address points at a live, contiguous buffer of the size the shapes imply.
pub(crate) unsafe fn weight<'a>(
    (bits, scale_group, n, k, w): WeightSpec,
) -> PyResult<Weight<'a>> {
    let kb = k / fastsched_kernels::GROUP;
    if bits == 4 && scale_group != fastsched_kernels::GROUP
        || !quant::SCALE_GROUPS.contains(&scale_group)
    {
        return Err(PyValueError::new_err(format!(
            "scale_group {scale_group} does not fit a {bits}-bit weight"
        )));
    }
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
            scale: std::slice::from_raw_parts(w[1] as *const f32, n * (k / scale_group)),
            zero: (w[2] != 0).then(|| std::slice::from_raw_parts(w[2] as *const f32, n * kb)),
            scale_group,
        }),
        _ => {
            return Err(PyValueError::new_err(format!(
                "bits must be 4 or 8, got {bits}"
            )))
        }
    })
}

/// `out[M, N] (float32) = x[M, K] · Wᵀ` for the weight `w` ([`WeightSpec`]); `x` float32,
/// or bfloat16 if `x_bf16`.
#[pyfunction]
pub fn quant_matmul(
    py: Python<'_>,
    w: WeightSpec,
    x: usize,
    x_bf16: bool,
    m: usize,
    out: usize,
) -> PyResult<()> {
    let pool = pool();
    let result = py.detach(|| -> PyResult<()> {
        // SAFETY: the caller's contract (module docs).
        let (n, k) = (w.2, w.3);
        let (w, x, out) = unsafe {
            let w = weight(w)?;
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

/// Writes the whole weight `w` ([`WeightSpec`]) as bfloat16 `[N, K]` to `out`.
#[pyfunction]
pub fn quant_dequantize_bf16(py: Python<'_>, w: WeightSpec, out: usize) -> PyResult<()> {
    let pool = pool();
    py.detach(|| -> PyResult<()> {
        let (n, k) = (w.2, w.3);
        // SAFETY: the caller's contract (module docs).
        let (w, out) = unsafe {
            (
                weight(w)?,
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
pub fn quant_gemm_bf16(
    py: Python<'_>,
    w: WeightSpec,
    x: usize,
    m: usize,
    out: usize,
) -> PyResult<()> {
    let pool = pool();
    py.detach(|| -> PyResult<()> {
        let (n, k) = (w.2, w.3);
        // SAFETY: the caller's contract (module docs).
        let (w, x, out) = unsafe {
            (
                weight(w)?,
                std::slice::from_raw_parts(x as *const u16, m * k),
                std::slice::from_raw_parts_mut(out as *mut f32, m * n),
            )
        };
        quant::gemm::gemm_bf16(&w, x, m, out, &pool, quant::gemm::gemm_kernel())
            .map_err(PyValueError::new_err)
    })
}

// ---- Paged attention (fastsched_kernels::attention), for fastsched.kernels.cpu_ops ----

use fastsched_kernels::attention::{self, CacheShape, Floats, FloatsMut, Scores, Step};

/// # Safety (of the callers' contract)
/// `addr` points at a live, contiguous buffer of `len` elements of the given dtype.
unsafe fn floats<'a>(addr: usize, bf16: bool, len: usize) -> Floats<'a> {
    if bf16 {
        Floats::Bf16(std::slice::from_raw_parts(addr as *const u16, len))
    } else {
        Floats::F32(std::slice::from_raw_parts(addr as *const f32, len))
    }
}

/// # Safety
/// As [`floats`], and nothing else reads or writes the buffer during the call.
unsafe fn floats_mut<'a>(addr: usize, bf16: bool, len: usize) -> FloatsMut<'a> {
    if bf16 {
        FloatsMut::Bf16(std::slice::from_raw_parts_mut(addr as *mut u16, len))
    } else {
        FloatsMut::F32(std::slice::from_raw_parts_mut(addr as *mut f32, len))
    }
}

/// Writes a step's keys and values into one layer's paged cache at `slot_mapping`, then
/// attends for the requests listed in `reqs` (their query rows of `out`).
///
/// `tensors`: query `[T, H, D]`, key and value `[T, H_kv, D]` (rows `strides` = (query's,
/// key's and value's) elements apart, each row contiguous), out `[T, H, D]` contiguous (all
/// of the query's dtype, bfloat16 if `bf16` else float32), kv_cache `[2, num_blocks,
/// block_size, H_kv, D]` (bfloat16 if `cache_bf16`). `step`: slot_mapping `[T]` int64,
/// query_start_loc `[B + 1]`, seq_lens `[B]`, block_tables `[B, max_blocks]`, reqs
/// `[num_selected]`, all int32. `cache_shape`: num_blocks, block_size, H_kv, D. `scale`,
/// `softcap` and `window`: the layer's scores (the crate's `Scores`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    py: Python<'_>,
    tensors: [usize; 5],
    strides: [usize; 2],
    bf16: bool,
    cache_bf16: bool,
    cache_shape: [usize; 4],
    num_tokens: usize,
    num_heads: usize,
    step: [usize; 5],
    num_reqs: usize,
    max_blocks: usize,
    num_selected: usize,
    scale: f32,
    softcap: Option<f32>,
    window: Option<usize>,
) -> PyResult<()> {
    let pool = pool();
    let scores = Scores {
        scale,
        softcap,
        window,
    };
    let [num_blocks, block_size, num_kv_heads, head_dim] = cache_shape;
    let shape = CacheShape {
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
    };
    let cache_len = 2 * num_blocks * block_size * num_kv_heads * head_dim;
    py.detach(|| -> PyResult<()> {
        // SAFETY: the caller's contract (module docs); the cache is written, then read.
        unsafe {
            let [q_stride, kv_stride] = strides;
            let span = |stride: usize, row: usize| {
                if num_tokens == 0 {
                    0
                } else {
                    (num_tokens - 1) * stride + row
                }
            };
            let q_len = span(q_stride, num_heads * head_dim);
            let kv_len = span(kv_stride, num_kv_heads * head_dim);
            let [q, k, v, out, cache] = tensors;
            let [slots, qsl, seq_lens, tables, reqs] = step;
            attention::write_cache(
                floats(k, bf16, kv_len),
                floats(v, bf16, kv_len),
                kv_stride,
                std::slice::from_raw_parts(slots as *const i64, num_tokens),
                &mut floats_mut(cache, cache_bf16, cache_len),
                shape,
            )
            .map_err(PyValueError::new_err)?;
            let step = Step {
                query_start_loc: std::slice::from_raw_parts(qsl as *const i32, num_reqs + 1),
                seq_lens: std::slice::from_raw_parts(seq_lens as *const i32, num_reqs),
                block_tables: std::slice::from_raw_parts(
                    tables as *const i32,
                    num_reqs * max_blocks,
                ),
                max_blocks,
            };
            attention::paged_attention(
                floats(q, bf16, q_len),
                q_stride,
                &mut floats_mut(out, bf16, num_tokens * num_heads * head_dim),
                num_heads,
                floats(cache, cache_bf16, cache_len),
                shape,
                step,
                std::slice::from_raw_parts(reqs as *const i32, num_selected),
                scores,
                &pool,
                attention::best_isa(),
            )
            .map_err(PyValueError::new_err)
        }
    })
}

// ---- Elementwise ops (fastsched_kernels::elementwise), for fastsched.kernels.cpu_ops ----

use fastsched_kernels::elementwise::{self, NormWeight};

/// # Safety
/// As [`floats`].
unsafe fn norm_weight<'a>(addr: usize, f32_weight: bool, len: usize) -> NormWeight<'a> {
    if f32_weight {
        NormWeight::F32(std::slice::from_raw_parts(addr as *const f32, len))
    } else {
        NormWeight::Bf16(std::slice::from_raw_parts(addr as *const u16, len))
    }
}

/// RMSNorm of the bfloat16 residual stream `hidden [M, N]` into `out`, after adding `delta`
/// to `hidden` in place (`delta` = 0: no add). `weight [N]` bfloat16, or float32 (Gemma's
/// `1 + w`, one rounding) if `weight_f32`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_bf16(
    py: Python<'_>,
    hidden: usize,
    delta: usize,
    weight: usize,
    weight_f32: bool,
    out: usize,
    rows: usize,
    n: usize,
    eps: f32,
) -> PyResult<()> {
    py.detach(|| {
        // SAFETY: the caller's contract (module docs).
        unsafe {
            elementwise::add_rms_norm_bf16(
                std::slice::from_raw_parts_mut(hidden as *mut u16, rows * n),
                (delta != 0).then(|| std::slice::from_raw_parts(delta as *const u16, rows * n)),
                norm_weight(weight, weight_f32, n),
                eps,
                std::slice::from_raw_parts_mut(out as *mut u16, rows * n),
            )
        }
        .map_err(PyValueError::new_err)
    })
}

/// Rotate-half RoPE in place on the first `heads` heads of `head_dim` of each of the
/// `rows` rows of `x` (`stride` elements apart), by `positions [rows]` (int64) into the
/// `[table_len, head_dim]` tables `cos` and `sin`; all of `x`'s dtype.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn rope(
    py: Python<'_>,
    x: usize,
    bf16: bool,
    stride: usize,
    heads: usize,
    head_dim: usize,
    positions: usize,
    rows: usize,
    tables: [usize; 2],
    table_len: usize,
) -> PyResult<()> {
    py.detach(|| {
        // SAFETY: the caller's contract (module docs).
        unsafe {
            let len = if rows == 0 {
                0
            } else {
                (rows - 1) * stride + heads * head_dim
            };
            elementwise::rope(
                &mut floats_mut(x, bf16, len),
                stride,
                heads,
                head_dim,
                std::slice::from_raw_parts(positions as *const i64, rows),
                floats(tables[0], bf16, table_len * head_dim),
                floats(tables[1], bf16, table_len * head_dim),
            )
        }
        .map_err(PyValueError::new_err)
    })
}

/// RMSNorm in place on the first `heads` heads of `head_dim` of each of the `rows` rows of
/// the bfloat16 `x` (`stride` elements apart), one `weight [head_dim]` (as
/// [`add_rms_norm_bf16`]'s).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_heads_bf16(
    py: Python<'_>,
    x: usize,
    stride: usize,
    rows: usize,
    heads: usize,
    head_dim: usize,
    weight: usize,
    weight_f32: bool,
    eps: f32,
) -> PyResult<()> {
    py.detach(|| {
        // SAFETY: the caller's contract (module docs).
        unsafe {
            let len = if rows == 0 {
                0
            } else {
                (rows - 1) * stride + heads * head_dim
            };
            elementwise::rms_norm_heads_bf16(
                std::slice::from_raw_parts_mut(x as *mut u16, len),
                stride,
                rows,
                heads,
                norm_weight(weight, weight_f32, head_dim),
                eps,
            )
        }
        .map_err(PyValueError::new_err)
    })
}

/// `out [M, I] = gelu_tanh(gate) · up` for bfloat16 `gate_up [M, 2I]`.
#[pyfunction]
pub fn gelu_tanh_mul_bf16(
    py: Python<'_>,
    gate_up: usize,
    out: usize,
    rows: usize,
    inner: usize,
) -> PyResult<()> {
    py.detach(|| {
        // SAFETY: the caller's contract (module docs).
        unsafe {
            elementwise::gelu_tanh_mul_bf16(
                std::slice::from_raw_parts(gate_up as *const u16, rows * 2 * inner),
                std::slice::from_raw_parts_mut(out as *mut u16, rows * inner),
                inner,
            )
        }
        .map_err(PyValueError::new_err)
    })
}

/// `out [M, I] = silu(gate) · up` for bfloat16 `gate_up [M, 2I]`.
#[pyfunction]
pub fn silu_mul_bf16(
    py: Python<'_>,
    gate_up: usize,
    out: usize,
    rows: usize,
    inner: usize,
) -> PyResult<()> {
    py.detach(|| {
        // SAFETY: the caller's contract (module docs).
        unsafe {
            elementwise::silu_mul_bf16(
                std::slice::from_raw_parts(gate_up as *const u16, rows * 2 * inner),
                std::slice::from_raw_parts_mut(out as *mut u16, rows * inner),
                inner,
            )
        }
        .map_err(PyValueError::new_err)
    })
}
