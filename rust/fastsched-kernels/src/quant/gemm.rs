//! The many-row matmul: `out[M, N] = x[M, K] · Wᵀ` with bfloat16 activations, for prefill
//! chunks and batched decoding, where the integer GEMV's per-row weight reads stop paying.
//!
//! Numerics: exactly today's dense path (the weight dequantized to bf16 by
//! [`super::dequantize_bf16`]'s rule, `bf16(scale · q + (zero − 8 · scale))`, multiplied in
//! bf16 with fp32 accumulation), up to summation order; no activation is rounded to int8.
//!
//! Method: a task takes a block of output columns, decodes them once into an L1-sized bf16
//! buffer (int4: a 16-entry bf16 table per group and `vpermw`; int8: convert and scale),
//! then runs every row of `x` against the buffer in `MR × NR` register tiles of AVX-512
//! BF16 `vdpbf16ps` (lanes along K, one horizontal reduction per output at the end). So a
//! weight is decoded once a call, whatever M is, and no `[N, K]` temporary is allocated.
//!
//! Batch invariance: an output's value is one accumulator's chain over K in a fixed order
//! and one fixed reduction tree, whatever its tile, so row `r` of an M-row call is bit-equal
//! to the same row alone.

use super::{group_codes, Kernel, OutPtr, Weight};
use crate::pool::Pool;
use crate::GROUP;

/// Output columns of a register tile (the buffer is padded to a multiple of it).
const NR: usize = 4;
/// Activation rows of a register tile: `MR · NR` accumulators plus `NR` weight vectors and
/// one activation vector fit AVX-512's 32 registers.
const MR: usize = 6;
/// Bytes of decoded weight a task keeps hot (about half of a 32 KiB L1d).
const BUF_BYTES: usize = 16 * 1024;
/// Bytes of activation rows a task keeps in L2 (a quarter of a 1 MiB L2) across its blocks.
const X_BYTES: usize = 256 * 1024;

/// The kernel `gemm_bf16` runs: AVX-512 BF16 (`vdpbf16ps`) or the portable loop.
pub fn gemm_kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if super::best_kernel() == Kernel::Avx512Vnni
            && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            return Kernel::Avx512Vnni;
        }
    }
    Kernel::Scalar
}

/// `out[M, N] (float32) = x[M, K] (bfloat16 bits) · Wᵀ`, split over `pool` by output columns.
/// `kernel` is [`gemm_kernel`]'s (or `Scalar`).
pub fn gemm_bf16(
    w: &Weight,
    x: &[u16],
    m: usize,
    out: &mut [f32],
    pool: &Pool,
    kernel: Kernel,
) -> Result<(), String> {
    let (n, k) = super::check_call(w, x.len(), out.len(), m)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let nb = (BUF_BYTES / (2 * k) / NR * NR).clamp(NR, 64);
    let blocks = n.div_ceil(nb);
    // a few tasks per thread (a shared machine deschedules threads unevenly)
    let tasks = blocks.min(4 * pool.threads());
    let per = blocks.div_ceil(tasks);
    let outp = OutPtr(out.as_mut_ptr());
    // rows in chunks whose activations stay in L2 across a task's column blocks (a block is
    // decoded again for each chunk: cheap next to a chunk's multiplications)
    let mc = (X_BYTES / (2 * k) / MR * MR).max(MR);
    let run = |t: usize| {
        let mut buf = vec![0u16; nb * k];
        for r0 in (0..m).step_by(mc) {
            let rows = r0..(r0 + mc).min(m);
            for b in t * per..((t + 1) * per).min(blocks) {
                let (lo, hi) = (b * nb, ((b + 1) * nb).min(n));
                // SAFETY: tasks write disjoint column ranges [lo, hi) of `out`, alive for the call.
                unsafe { block(w, x, rows.clone(), n, lo, hi, &mut buf, outp, kernel) };
            }
        }
    };
    pool.run(tasks, &run); // one task runs on the caller
    Ok(())
}

/// Columns `lo..hi` of `rows`: decode them into `buf`, then the register tiles.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    w: &Weight,
    x: &[u16],
    rows: std::ops::Range<usize>,
    n: usize,
    lo: usize,
    hi: usize,
    buf: &mut [u16],
    out: OutPtr,
    kernel: Kernel,
) {
    let k = w.shape().1;
    let cols = hi - lo;
    let padded = cols.div_ceil(NR) * NR;
    for c in 0..padded {
        let dst = &mut buf[c * k..(c + 1) * k];
        if c >= cols {
            dst.fill(0);
            continue;
        }
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => simd::decode(w, lo + c, dst),
            _ => decode_scalar(w, lo + c, dst),
        }
    }
    // rows outermost: a tile's rows of `x` stay in L1 across the block's columns, so `x` is
    // read from L2 once a block
    let mut m0 = rows.start;
    while m0 < rows.end {
        let mt = (rows.end - m0).min(MR);
        let xr = &x[m0 * k..(m0 + mt) * k];
        for c0 in (0..padded).step_by(NR) {
            let wc = &buf[c0 * k..(c0 + NR) * k];
            let mut acc = [[0f32; NR]; MR];
            match kernel {
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512Vnni => simd::tile(xr, mt, k, wc, &mut acc),
                _ => tile_scalar(xr, mt, k, wc, &mut acc),
            }
            for (r, row) in acc[..mt].iter().enumerate() {
                for (j, v) in row.iter().enumerate().take(cols.saturating_sub(c0).min(NR)) {
                    *out.get().add((m0 + r) * n + lo + c0 + j) = *v;
                }
            }
        }
        m0 += mt;
    }
}

/// Row `col` of the weight as bf16 bits, [`super::dequantize_bf16`]'s rule.
pub(super) fn decode_scalar(w: &Weight, col: usize, dst: &mut [u16]) {
    let kb = w.shape().1 / GROUP;
    let mut codes = [0i32; GROUP];
    for g in 0..kb {
        group_codes(w, col, g, &mut codes);
        let (s, z) = super::group_affine(w, col, g);
        for (j, (d, &c)) in dst[g * GROUP..][..GROUP].iter_mut().zip(&codes).enumerate() {
            *d = super::f32_to_bf16(s[j / 16].mul_add(c as f32, z));
        }
    }
}

/// The portable tile: products of bf16 values, summed in fp32 in K order.
fn tile_scalar(x: &[u16], mt: usize, k: usize, wc: &[u16], acc: &mut [[f32; NR]; MR]) {
    let f = |b: u16| f32::from_bits((b as u32) << 16);
    for (r, row) in acc[..mt].iter_mut().enumerate() {
        let xr = &x[r * k..(r + 1) * k];
        for (j, a) in row.iter_mut().enumerate() {
            let wr = &wc[j * k..(j + 1) * k];
            *a = xr
                .iter()
                .zip(wr)
                .fold(0f32, |s, (&a, &b)| f(a).mul_add(f(b), s));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::*;
    use std::arch::x86_64::*;

    /// Row `col` of the weight as bf16 into `dst` (`[K]`), bit-equal to `decode_scalar`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn decode(w: &Weight, col: usize, dst: &mut [u16]) {
        let out = dst.as_mut_ptr();
        match w {
            Weight::Int4(w) => {
                let (k, kb) = (w.k, w.k / GROUP);
                let row = w.packed.as_ptr().add(col * k / 2);
                let (scale, zero) = (&w.scale[col * kb..][..kb], &w.zero[col * kb..][..kb]);
                // bf16(scale · q + (zero − 8 · scale)) for q in 0..16, twice: `vpermw` reads an
                // index's low 5 bits, so a byte's low nibble indexes it without masking
                let iota = _mm512_set_ps(
                    15., 14., 13., 12., 11., 10., 9., 8., 7., 6., 5., 4., 3., 2., 1., 0.,
                );
                let table = |g: usize| {
                    let v = _mm512_fmadd_ps(
                        iota,
                        _mm512_set1_ps(scale[g]),
                        _mm512_set1_ps(zero[g] - 8.0 * scale[g]),
                    );
                    _mm512_castps_si512(std::mem::transmute::<__m512bh, __m512>(
                        _mm512_cvtne2ps_pbh(v, v),
                    ))
                };
                for p in 0..kb / 2 {
                    let words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(row.add(p * 32).cast()));
                    let lo = _mm512_permutexvar_epi16(words, table(2 * p));
                    let hi =
                        _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(words), table(2 * p + 1));
                    _mm512_storeu_si512(out.add(p * 64).cast(), lo);
                    _mm512_storeu_si512(out.add(p * 64 + 32).cast(), hi);
                }
                if kb % 2 == 1 {
                    let g = kb - 1;
                    let words = _mm256_cvtepu8_epi16(_mm_loadu_si128(row.add(g / 2 * 32).cast()));
                    let idx = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(words),
                        _mm256_srli_epi16::<4>(words),
                    );
                    let v = _mm512_permutexvar_epi16(idx, table(g));
                    _mm512_storeu_si512(out.add(g * GROUP).cast(), v);
                }
            }
            Weight::Int8(w) => {
                let (k, kb) = (w.k, w.k / GROUP);
                let row = w.codes.as_ptr().add(col * k);
                for g in 0..kb {
                    let (s, z) = super::super::group_affine(&Weight::Int8(*w), col, g);
                    let z = _mm512_set1_ps(z);
                    let half = |h: usize| {
                        let c = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                            row.add(g * GROUP + 16 * h).cast(),
                        ));
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(s[h]), z)
                    };
                    let v = _mm512_cvtne2ps_pbh(half(1), half(0));
                    _mm512_storeu_si512(
                        out.add(g * GROUP).cast(),
                        std::mem::transmute::<__m512bh, __m512i>(v),
                    );
                }
            }
        }
    }

    /// `MT ≤ MR` rows of `x` against the `NR` decoded columns `wc`.
    pub(super) unsafe fn tile(
        x: &[u16],
        mt: usize,
        k: usize,
        wc: &[u16],
        acc: &mut [[f32; NR]; MR],
    ) {
        match mt {
            1 => tile_mt::<1>(x, k, wc, acc),
            2 => tile_mt::<2>(x, k, wc, acc),
            3 => tile_mt::<3>(x, k, wc, acc),
            4 => tile_mt::<4>(x, k, wc, acc),
            5 => tile_mt::<5>(x, k, wc, acc),
            _ => tile_mt::<6>(x, k, wc, acc),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile_mt<const MT: usize>(x: &[u16], k: usize, wc: &[u16], out: &mut [[f32; NR]; MR]) {
        let (xp, wp) = (x.as_ptr(), wc.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); NR]; MT];
        let load =
            |p: *const u16| std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast()));
        for kk in (0..k).step_by(GROUP) {
            let wv: [__m512bh; NR] = std::array::from_fn(|j| load(wp.add(j * k + kk)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let xv = load(xp.add(r * k + kk));
                for j in 0..NR {
                    acc[j] = _mm512_dpbf16_ps(acc[j], xv, wv[j]);
                }
            }
        }
        for r in 0..MT {
            _mm_storeu_ps(out[r].as_mut_ptr(), reduce4(acc[r]));
        }
    }

    /// The four vectors' sums, one a lane, each by the same tree (whatever its neighbours).
    #[inline(always)]
    unsafe fn reduce4(v: [__m512; NR]) -> __m128 {
        let ab = _mm512_add_ps(
            _mm512_unpacklo_ps(v[0], v[1]),
            _mm512_unpackhi_ps(v[0], v[1]),
        );
        let cd = _mm512_add_ps(
            _mm512_unpacklo_ps(v[2], v[3]),
            _mm512_unpackhi_ps(v[2], v[3]),
        );
        // per 128-bit lane: [a, b, c, d] partial sums
        let abcd = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(ab, cd),
            _mm512_shuffle_ps::<0xee>(ab, cd),
        );
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(abcd),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(abcd))),
        );
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
    }
}

#[cfg(test)]
mod tests;
