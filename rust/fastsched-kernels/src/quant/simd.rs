//! The GEMV's AVX-512 VNNI kernels (x86_64): the same arithmetic as the portable loop of
//! [`super`], sixteen `vpdpbusd` lanes at a time.

use super::*;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn each_col<F: FnMut(usize, &mut [f32; 4])>(
    cols: std::ops::Range<usize>,
    m0: usize,
    mt: usize,
    n: usize,
    out: OutPtr,
    f: &mut F,
) {
    for col in cols {
        let mut acc = [0f32; 4];
        f(col, &mut acc);
        for (r, v) in acc[..mt].iter().enumerate() {
            *out.0.add((m0 + r) * n + col) = *v;
        }
    }
}

/// Output columns `cols` of activation rows `m0..m0 + mt` into `out` (`[M, n]`): one
/// call a task, the column loop inside the AVX-512 build so the kernels inline into it.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn dot_cols(
    w: &Weight,
    a: &QAct,
    m0: usize,
    mt: usize,
    cols: std::ops::Range<usize>,
    n: usize,
    out: OutPtr,
) {
    match (w, mt) {
        (Weight::Int4(w), 1) => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int4_rows::<1>(w, a, m0, c, acc)
        }),
        (Weight::Int4(w), 2) => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int4_rows::<2>(w, a, m0, c, acc)
        }),
        (Weight::Int4(w), 3) => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int4_rows::<3>(w, a, m0, c, acc)
        }),
        (Weight::Int4(w), _) => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int4_rows::<4>(w, a, m0, c, acc)
        }),
        (Weight::Int8(w), _) if w.scale_group == GROUP => {
            int8_cols::<false>(w, a, m0, mt, cols, n, out)
        }
        (Weight::Int8(w), _) => int8_cols::<true>(w, a, m0, mt, cols, n, out),
    }
}

/// [`dot_cols`] for an int8 weight with scales per group (`SUB16` false) or per half.
#[inline(always)]
unsafe fn int8_cols<const SUB16: bool>(
    w: &Int8,
    a: &QAct,
    m0: usize,
    mt: usize,
    cols: std::ops::Range<usize>,
    n: usize,
    out: OutPtr,
) {
    match mt {
        1 => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int8_rows::<1, SUB16>(w, a, m0, c, acc)
        }),
        2 => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int8_rows::<2, SUB16>(w, a, m0, c, acc)
        }),
        3 => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int8_rows::<3, SUB16>(w, a, m0, c, acc)
        }),
        _ => each_col(cols, m0, mt, n, out, &mut |c, acc| {
            int8_rows::<4, SUB16>(w, a, m0, c, acc)
        }),
    }
}

/// One pair of groups (64 columns) of `MT` activation rows against one weight row whose
/// 64 codes `wq` are unsigned bytes (int4: q, int8: q + 128): `vpdpbusd` from the
/// lanes' `negcorr` gives the signed codes' integer dot (8 lanes a group), scaled by
/// `scale · d` into float accumulators.
#[inline(always)]
unsafe fn pair<const MT: usize>(
    a: &QAct,
    m0: usize,
    p: usize,
    wq: __m512i,
    sv: __m512,
    acc: &mut [__m512; MT],
) {
    let pairs = a.k / (2 * GROUP);
    for (r, acc) in acc.iter_mut().enumerate() {
        let row = m0 + r;
        let xq = _mm512_loadu_si512(a.q.as_ptr().add(row * a.k + p * 64).cast());
        let at = (row * pairs + p) * 16;
        let dot = _mm512_dpbusd_epi32(
            _mm512_loadu_si512(a.negcorr.as_ptr().add(at).cast()),
            wq,
            xq,
        );
        let dl = _mm512_loadu_ps(a.dlanes.as_ptr().add(at));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, dl), *acc);
    }
}

/// Weight rows ahead of the one being read whose bytes are prefetched: the GEMV reads
/// three streams (codes, scales, zeros) once each, and the hardware prefetcher alone
/// left the loads waiting on memory (perf: most samples on the first use of a load).
/// 4 rows ahead: ~10 % more decode tok/s than none; 8 and 16 were in between
/// (bench/RESULTS.md, "CPU decode: one call for the decoder stack").
const PREFETCH_ROWS: usize = 4;

/// Prefetches `len` bytes from byte `at` of the buffer `base` (`size` bytes), the part
/// of them inside it.
#[inline(always)]
unsafe fn prefetch_ahead(base: *const u8, size: usize, at: usize, len: usize) {
    let end = (at + len).min(size);
    let mut i = at;
    while i < end {
        _mm_prefetch::<_MM_HINT_T0>(base.add(i).cast());
        i += 64;
    }
}

/// Lanes 0..8 the pair's first scale, 8..16 its second.
#[inline(always)]
unsafe fn scale_lanes(scale: *const f32) -> __m512 {
    let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(
        idx,
        _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(scale.cast()))),
    )
}

/// Lanes `4h..4h + 4` the scale of the pair's quarter `h` (16 columns: four lanes of
/// `vpdpbusd`), for scales per half group.
#[inline(always)]
unsafe fn quarter_scale_lanes(scale: *const f32) -> __m512 {
    let idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(scale)))
}

/// `acc[r] += Σ_g zero[g] · Σx[g]` over the `kb` groups of activation row `m0 + r`, 16
/// groups a step.
#[inline(always)]
unsafe fn add_zero_terms<const MT: usize>(
    zeros: *const f32,
    a: &QAct,
    m0: usize,
    kb: usize,
    acc: &mut [__m512; MT],
) {
    for g in (0..kb).step_by(16) {
        let mask: __mmask16 = if kb - g >= 16 {
            0xffff
        } else {
            (1u16 << (kb - g)) - 1
        };
        let z = _mm512_maskz_loadu_ps(mask, zeros.add(g));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xsum = _mm512_maskz_loadu_ps(mask, a.xsum.as_ptr().add((m0 + r) * kb + g));
            *acc = _mm512_fmadd_ps(z, xsum, *acc);
        }
    }
}

/// Sum over the last, odd group (not in a pair) of `scale · d · Σ (w_code − offset) · qx`.
fn odd_group(w: &Weight, a: &QAct, row: usize, col: usize, offset: i32) -> f32 {
    let kb = a.k / GROUP;
    if kb.is_multiple_of(2) {
        return 0.0;
    }
    let g = kb - 1;
    let mut codes = [0i32; GROUP];
    group_codes(w, col, g, &mut codes);
    let q = &a.q[row * a.k + g * GROUP..][..GROUP];
    scaled_dot(w, col, g, &codes, offset, q, a.d[row * kb + g])
}

/// 16 floats `s · codes + z` to bf16 (round to nearest even) at `dst`.
#[inline(always)]
unsafe fn store_bf16(codes: __m512i, s: __m512, z: __m512, dst: *mut u16) {
    let v = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), s, z));
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(v), _mm512_set1_epi32(1));
    let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(
        v,
        _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)),
    ));
    _mm256_storeu_si256(dst.cast(), _mm512_cvtepi32_epi16(r));
}

/// Row `col` of the weight as bf16 into `dst` (`[K]`); an odd last int4 group is left
/// to the caller.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn dequantize_row(w: &Weight, col: usize, dst: &mut [u16]) {
    match w {
        Weight::Int4(w) => {
            let (k, kb) = (w.k, w.k / GROUP);
            let row = w.packed.as_ptr().add(col * k / 2);
            for p in 0..kb / 2 {
                let mut codes = [0u8; 64];
                for j in 0..32 {
                    let b = *row.add(p * 32 + j);
                    codes[j] = b & 15;
                    codes[32 + j] = b >> 4;
                }
                for q in 0..4 {
                    let g = col * kb + 2 * p + q / 2;
                    let (sc, z) = (w.scale[g], w.zero[g] - 8.0 * w.scale[g]);
                    let c =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(q * 16).cast()));
                    store_bf16(
                        c,
                        _mm512_set1_ps(sc),
                        _mm512_set1_ps(z),
                        dst.as_mut_ptr().add(p * 64 + q * 16),
                    );
                }
            }
        }
        Weight::Int8(w) => {
            let (k, kb) = (w.k, w.k / GROUP);
            let row = w.codes.as_ptr().add(col * k);
            for g in 0..kb {
                let scales = w.half_scales(col, g);
                let z = _mm512_set1_ps(w.zero.map_or(0.0, |z| z[col * kb + g]));
                for (h, &s) in scales.iter().enumerate() {
                    let c =
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(row.add(g * GROUP + h * 16).cast()));
                    store_bf16(
                        c,
                        _mm512_set1_ps(s),
                        z,
                        dst.as_mut_ptr().add(g * GROUP + h * 16),
                    );
                }
            }
        }
    }
}

/// Integer dots of `MT` activation rows with one int4 weight row: per quad of groups
/// (64 bytes, 128 columns) one load unpacks to two vectors of codes, the low nibbles
/// (groups `g`, `g + 2`) and the high ones (`g + 1`, `g + 3`), met by the activations in
/// that order (`QAct::qa`); each `vpdpbusd` lane sums 4 products of an unsigned code and
/// a signed activation, scaled by `scale · d` into float accumulators. The codes' offset
/// (`−8 · scale · d · Σq`) and the zeros' term (`zero · Σx`) are added per group after.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn int4_rows<const MT: usize>(
    w: &Int4,
    a: &QAct,
    m0: usize,
    col: usize,
    out: &mut [f32; 4],
) {
    let (k, kb) = (a.k, a.k / GROUP);
    let pairs = kb / 2;
    let mut acc = [_mm512_setzero_ps(); MT];
    let scale = w.scale.as_ptr().add(col * kb);
    let row = w.packed.as_ptr().add(col * k / 2);
    prefetch_ahead(
        w.packed.as_ptr(),
        w.packed.len(),
        (col + PREFETCH_ROWS) * k / 2,
        k / 2,
    );
    prefetch_ahead(
        w.scale.as_ptr().cast(),
        4 * w.scale.len(),
        4 * (col + PREFETCH_ROWS) * kb,
        4 * kb,
    );
    prefetch_ahead(
        w.zero.as_ptr().cast(),
        4 * w.zero.len(),
        4 * (col + PREFETCH_ROWS) * kb,
        4 * kb,
    );
    let low = _mm512_set1_epi8(15);
    let (idx_lo, idx_hi) = (
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
    );
    let zero = _mm512_setzero_si512();
    for j in 0..pairs / 2 {
        let bytes = _mm512_loadu_si512(row.add(j * 64).cast());
        let lo = _mm512_and_si512(bytes, low);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low);
        let s4 = _mm512_castps128_ps512(_mm_loadu_ps(scale.add(4 * j)));
        let (sv_lo, sv_hi) = (
            _mm512_permutexvar_ps(idx_lo, s4),
            _mm512_permutexvar_ps(idx_hi, s4),
        );
        for (r, acc) in acc.iter_mut().enumerate() {
            let xq = a.qa.as_ptr().add((m0 + r) * k + j * 128);
            let dl = a.dlanes.as_ptr().add(((m0 + r) * pairs + 2 * j) * 16);
            let dot = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xq.cast()));
            *acc = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(dot),
                _mm512_mul_ps(sv_lo, _mm512_loadu_ps(dl)),
                *acc,
            );
            let dot = _mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512(xq.add(64).cast()));
            *acc = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(dot),
                _mm512_mul_ps(sv_hi, _mm512_loadu_ps(dl.add(16))),
                *acc,
            );
        }
    }
    if pairs % 2 == 1 {
        // the last pair alone: 32 bytes, its groups in their own order
        let p = pairs - 1;
        let bytes = _mm256_loadu_si256(row.add(p * 32).cast());
        let low = _mm256_set1_epi8(15);
        let lo = _mm256_and_si256(bytes, low);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low);
        let wq = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        let sv = scale_lanes(scale.add(2 * p));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xq = _mm512_loadu_si512(a.qa.as_ptr().add((m0 + r) * k + p * 64).cast());
            let dl = _mm512_loadu_ps(a.dlanes.as_ptr().add(((m0 + r) * pairs + p) * 16));
            let dot = _mm512_dpbusd_epi32(zero, wq, xq);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, dl), *acc);
        }
    }
    // per group, 16 a step: zero · Σx (every group), −8 · scale · dΣq (the paired ones;
    // an odd last group is `odd_group`'s, offset included)
    let zeros = w.zero.as_ptr().add(col * kb);
    let minus8 = _mm512_set1_ps(-8.0);
    let mask = |n: usize| -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    };
    for g in (0..kb).step_by(16) {
        let (all, paired) = (mask(kb - g), mask((2 * pairs).saturating_sub(g)));
        let z = _mm512_maskz_loadu_ps(all, zeros.add(g));
        let s8 = _mm512_mul_ps(_mm512_maskz_loadu_ps(paired, scale.add(g)), minus8);
        for (r, acc) in acc.iter_mut().enumerate() {
            let at = (m0 + r) * kb + g;
            *acc = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(all, a.xsum.as_ptr().add(at)), *acc);
            *acc = _mm512_fmadd_ps(
                s8,
                _mm512_maskz_loadu_ps(paired, a.dsum.as_ptr().add(at)),
                *acc,
            );
        }
    }
    for r in 0..MT {
        out[r] = _mm512_reduce_add_ps(acc[r]);
        if kb % 2 == 1 {
            out[r] += odd_group(&Weight::Int4(*w), a, m0 + r, col, 8);
        }
    }
}

/// Integer dots of `MT` activation rows with one int8 weight row, a pair of groups (64
/// columns) a step; scales per group, or (`SUB16`) per 16 columns, four lanes each; the
/// zeros' term (`zero · Σx`) added per group after.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn int8_rows<const MT: usize, const SUB16: bool>(
    w: &Int8,
    a: &QAct,
    m0: usize,
    col: usize,
    out: &mut [f32; 4],
) {
    let (k, kb) = (a.k, a.k / GROUP);
    let mut acc = [_mm512_setzero_ps(); MT];
    let row_scales = k / w.scale_group;
    let scale = w.scale.as_ptr().add(col * row_scales);
    prefetch_ahead(
        w.codes.as_ptr().cast(),
        w.codes.len(),
        (col + PREFETCH_ROWS) * k,
        k,
    );
    prefetch_ahead(
        w.scale.as_ptr().cast(),
        4 * w.scale.len(),
        4 * (col + PREFETCH_ROWS) * row_scales,
        4 * row_scales,
    );
    if let Some(zero) = w.zero {
        prefetch_ahead(
            zero.as_ptr().cast(),
            4 * zero.len(),
            4 * (col + PREFETCH_ROWS) * kb,
            4 * kb,
        );
    }
    let flip = _mm512_set1_epi8(-128);
    let row = w.codes.as_ptr().add(col * k);
    for p in 0..kb / 2 {
        // signed codes made unsigned (q + 128); `negcorr` takes 128 · Σqx back off
        let wq = _mm512_xor_si512(_mm512_loadu_si512(row.add(p * 64).cast()), flip);
        let sv = if SUB16 {
            quarter_scale_lanes(scale.add(4 * p))
        } else {
            scale_lanes(scale.add(2 * p))
        };
        pair::<MT>(a, m0, p, wq, sv, &mut acc);
    }
    if let Some(zero) = w.zero {
        add_zero_terms::<MT>(zero.as_ptr().add(col * kb), a, m0, kb, &mut acc);
    }
    for r in 0..MT {
        out[r] = _mm512_reduce_add_ps(acc[r]);
        if kb % 2 == 1 {
            out[r] += odd_group(&Weight::Int8(*w), a, m0 + r, col, 0);
        }
    }
}
