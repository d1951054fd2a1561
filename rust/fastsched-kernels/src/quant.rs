//! Weight-only int4 / int8 matmuls (crate docs for the method) and their dequantization.
//!
//! Layouts (row-major, one row per output feature `n`; `KB = K / GROUP` groups a row):
//!
//! - [`Int4`]: `packed [N, K/2]` bytes. Each pair of groups (64 columns from `c`) is 32
//!   bytes, byte `j` holding column `c + j` in its low nibble and `c + 32 + j` in its high
//!   one, so one 256-bit load unpacks to the pair's 64 codes in column order. A last, odd
//!   group is 16 bytes: byte `j` holds `c + j` (low) and `c + 16 + j` (high), GGUF's order.
//!   `scale`, `zero`: `[N, KB]` float32. Built by [`pack_int4`].
//! - [`Int8`]: `codes [N, K]` int8, `scale [N, K / scale_group]` float32 (one scale per 32
//!   columns, or per 16: GGUF Q6_K's sub-blocks), and optionally `zero [N, KB]` float32
//!   (GGUF Q5_1 / Q5_K's offsets). Q8_0 and Q5_0 are scales alone, their fp16 `d` widened.

use crate::pool::Pool;
use crate::GROUP;

pub mod gemm;

/// A 4-bit weight, `w = scale · (q − 8) + zero` (module docs for the layout).
#[derive(Clone, Copy)]
pub struct Int4<'a> {
    pub n: usize,
    pub k: usize,
    pub packed: &'a [u8],
    pub scale: &'a [f32],
    pub zero: &'a [f32],
}

/// An 8-bit weight, `w = scale · q + zero`: a scale per `scale_group` (32 or 16) columns,
/// a zero (if any) per [`GROUP`].
#[derive(Clone, Copy)]
pub struct Int8<'a> {
    pub n: usize,
    pub k: usize,
    pub codes: &'a [i8],
    pub scale: &'a [f32],
    pub zero: Option<&'a [f32]>,
    pub scale_group: usize,
}

/// Column counts an [`Int8`] scale may cover: a whole group, or half of one.
pub const SCALE_GROUPS: [usize; 2] = [GROUP, GROUP / 2];

impl Int8<'_> {
    /// The scales of the two halves (16 columns each) of group `g` of output row `col`.
    #[inline(always)]
    fn half_scales(&self, col: usize, g: usize) -> [f32; 2] {
        if self.scale_group == GROUP {
            let s = self.scale[col * (self.k / GROUP) + g];
            [s, s]
        } else {
            let at = col * (self.k / 16) + 2 * g;
            [self.scale[at], self.scale[at + 1]]
        }
    }
}

#[derive(Clone, Copy)]
pub enum Weight<'a> {
    Int4(Int4<'a>),
    Int8(Int8<'a>),
}

/// Activation rows, `[M, K]` row-major.
#[derive(Clone, Copy)]
pub enum Act<'a> {
    F32(&'a [f32]),
    /// bfloat16 as its bits.
    Bf16(&'a [u16]),
}

/// Which inner loop runs: the AVX-512 VNNI one, or the portable one (same arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    Avx512Vnni,
}

/// The fastest kernel this CPU supports, detected at run time.
pub fn best_kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            return Kernel::Avx512Vnni;
        }
    }
    Kernel::Scalar
}

impl Weight<'_> {
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Weight::Int4(w) => (w.n, w.k),
            Weight::Int8(w) => (w.n, w.k),
        }
    }

    /// Checks the buffers' lengths against the shape; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        let (n, k) = self.shape();
        if k == 0 || k % GROUP != 0 {
            return Err(format!("K = {k} must be a positive multiple of {GROUP}"));
        }
        if n.checked_mul(k).is_none_or(|nk| nk > isize::MAX as usize) {
            return Err(format!("[{n}, {k}] is too large a weight"));
        }
        let kb = k / GROUP;
        let check = |field: &str, len: usize, want: usize| {
            if len == want {
                Ok(())
            } else {
                Err(format!(
                    "{field} has {len} elements, [{n}, {k}] needs {want}"
                ))
            }
        };
        match self {
            Weight::Int4(w) => {
                check("packed", w.packed.len(), n * k / 2)?;
                check("scale", w.scale.len(), n * kb)?;
                check("zero", w.zero.len(), n * kb)
            }
            Weight::Int8(w) => {
                if !SCALE_GROUPS.contains(&w.scale_group) {
                    return Err(format!(
                        "scale_group = {} must be one of {SCALE_GROUPS:?}",
                        w.scale_group
                    ));
                }
                check("codes", w.codes.len(), n * k)?;
                check("scale", w.scale.len(), n * (k / w.scale_group))?;
                match w.zero {
                    Some(z) => check("zero", z.len(), n * kb),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Packs `codes [N, K]` (each 0..15) into [`Int4`]'s layout.
pub fn pack_int4(codes: &[u8], n: usize, k: usize) -> Vec<u8> {
    assert!(
        k.is_multiple_of(GROUP) && codes.len() == n * k,
        "codes must be [N, K] with K a multiple of {GROUP}"
    );
    let mut out = vec![0u8; n * k / 2];
    for (row, dst) in codes.chunks_exact(k).zip(out.chunks_exact_mut(k / 2)) {
        let pairs = k / (2 * GROUP);
        for p in 0..pairs {
            let (src, d) = (&row[p * 64..p * 64 + 64], &mut dst[p * 32..p * 32 + 32]);
            for j in 0..32 {
                d[j] = (src[j] & 15) | ((src[32 + j] & 15) << 4);
            }
        }
        if (k / GROUP) % 2 == 1 {
            let (src, d) = (&row[pairs * 64..], &mut dst[pairs * 32..]);
            for j in 0..16 {
                d[j] = (src[j] & 15) | ((src[16 + j] & 15) << 4);
            }
        }
    }
    out
}

/// Activation rows quantized per group: `x ≈ d · q`.
struct QAct {
    k: usize,
    q: Vec<i8>,     // [M, K]
    d: Vec<f32>,    // [M, KB]
    dsum: Vec<f32>, // [M, KB]: d · Σq
    xsum: Vec<f32>, // [M, KB]: Σx (exact, for the int4 zero term)
    /// [M, pairs, 16]: the activation scales of the lanes the SIMD kernels multiply: int8,
    /// and int4's last pair when it has an odd number, d of a pair's first group in lanes
    /// 0..8 and the second's in 8..16; int4 quads (pairs `2j`, `2j + 1`: groups `g..g + 4`),
    /// two vectors, `[d(g) | d(g + 2)]` and `[d(g + 1) | d(g + 3)]`.
    dlanes: Vec<f32>,
    /// int8 only, [M, pairs, 16]: −128 · (the sum of the 4 codes a `vpdpbusd` lane takes),
    /// the lane's start value, so that the unsigned codes' offset cancels exactly.
    negcorr: Vec<i32>,
    /// int4 only, [M, K]: `q` with each quad's groups in the order its weight bytes unpack
    /// to, `g, g + 2, g + 1, g + 3` (the low nibbles of 64 bytes, then the high ones); a last
    /// odd pair and odd group as in `q`.
    qa: Vec<i8>,
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

simd_fn! {
    fn quantize_act(x: Act, m: usize, k: usize, bias: i32) -> QAct {
        let kb = k / GROUP;
        let pairs = kb / 2;
        let mut a = QAct {
            k,
            q: vec![0; m * k],
            d: vec![0.0; m * kb],
            dsum: vec![0.0; m * kb],
            xsum: vec![0.0; m * kb],
            dlanes: vec![0.0; m * pairs * 16],
            negcorr: if bias == 8 { Vec::new() } else { vec![0; m * pairs * 16] },
            qa: if bias == 8 { vec![0; m * k] } else { Vec::new() },
        };
        let mut buf = [0f32; GROUP];
        for g in 0..m * kb {
            match x {
                Act::F32(v) => buf.copy_from_slice(&v[g * GROUP..(g + 1) * GROUP]),
                Act::Bf16(v) => {
                    for (b, &s) in buf.iter_mut().zip(&v[g * GROUP..(g + 1) * GROUP]) {
                        *b = bf16_to_f32(s);
                    }
                }
            }
            let amax = buf.iter().fold(0f32, |acc, v| acc.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut qsum = 0i32;
            for (q, &v) in a.q[g * GROUP..(g + 1) * GROUP].iter_mut().zip(&buf) {
                let r = (v * inv).round().clamp(-127.0, 127.0) as i8;
                *q = r;
                qsum += r as i32;
            }
            a.d[g] = d;
            a.dsum[g] = d * qsum as f32;
            a.xsum[g] = buf.iter().sum();
        }
        if bias == 8 {
            // int4: quads of groups in unpacking order, then the last odd pair as it is
            a.qa.copy_from_slice(&a.q);
            for row in 0..m {
                for j in 0..pairs / 2 {
                    let g = row * kb + 4 * j;
                    for (slot, from) in [0, 2, 1, 3].into_iter().enumerate() {
                        let dst = (g + slot) * GROUP;
                        a.qa[dst..dst + GROUP].copy_from_slice(&a.q[(g + from) * GROUP..][..GROUP]);
                        let lanes = &mut a.dlanes[(row * pairs + 2 * j + slot / 2) * 16..][..16];
                        lanes[slot % 2 * 8..][..8].fill(a.d[g + from]);
                    }
                }
                if pairs % 2 == 1 {
                    let p = pairs - 1;
                    let lanes = &mut a.dlanes[(row * pairs + p) * 16..][..16];
                    lanes[..8].fill(a.d[row * kb + 2 * p]);
                    lanes[8..].fill(a.d[row * kb + 2 * p + 1]);
                }
            }
            return a;
        }
        for row in 0..m {
            for p in 0..pairs {
                let lanes = &mut a.dlanes[(row * pairs + p) * 16..][..16];
                lanes[..8].fill(a.d[row * kb + 2 * p]);
                lanes[8..].fill(a.d[row * kb + 2 * p + 1]);
                let q = &a.q[row * k + p * 64..][..64];
                for (lane, c) in a.negcorr[(row * pairs + p) * 16..][..16]
                    .iter_mut()
                    .enumerate()
                {
                    *c = -bias
                        * q[lane * 4..lane * 4 + 4]
                            .iter()
                            .map(|&v| v as i32)
                            .sum::<i32>();
                }
            }
        }
        a
    }
}

/// The output pointer shared by the tasks of one call; each writes its own columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Checks a matmul's weight and that `x` and `out` hold `[M, K]` and `[M, N]` elements;
/// returns `(N, K)`.
pub(crate) fn check_call(
    w: &Weight,
    xlen: usize,
    outlen: usize,
    m: usize,
) -> Result<(usize, usize), String> {
    w.validate()?;
    let (n, k) = w.shape();
    if Some(xlen) != m.checked_mul(k) || Some(outlen) != m.checked_mul(n) {
        return Err(format!(
            "x has {xlen} elements and out {outlen}, [M={m}, K={k}] x [N={n}] needs {:?} and {:?}",
            m.checked_mul(k),
            m.checked_mul(n)
        ));
    }
    Ok((n, k))
}

/// Output rows a task takes: enough that a task is not dwarfed by the pool's overhead.
const MIN_ROWS_PER_TASK: usize = 16;

/// `out[M, N] = x[M, K] · Wᵀ` (float32 out), split over `pool`'s threads by output rows.
pub fn matmul(
    w: &Weight,
    x: Act,
    m: usize,
    out: &mut [f32],
    pool: &Pool,
    kernel: Kernel,
) -> Result<(), String> {
    let xlen = match x {
        Act::F32(v) => v.len(),
        Act::Bf16(v) => v.len(),
    };
    let (n, k) = check_call(w, xlen, out.len(), m)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let a = quantize_act(
        x,
        m,
        k,
        match w {
            Weight::Int4(_) => 8,
            Weight::Int8(_) => 128,
        },
    );
    let outp = OutPtr(out.as_mut_ptr());
    // Tasks: a few per thread (a shared machine deschedules threads unevenly), each with
    // at least MIN_ROWS_PER_TASK rows; small calls run on the caller alone.
    let tasks = (n / MIN_ROWS_PER_TASK).clamp(1, 4 * pool.threads());
    let tasks = if n * k * m < 1 << 16 { 1 } else { tasks };
    let rows_per = n.div_ceil(tasks);
    let run = |t: usize| {
        let (lo, hi) = (t * rows_per, ((t + 1) * rows_per).min(n));
        if lo < hi {
            // SAFETY: tasks write disjoint column ranges [lo, hi) of `out`, alive for the call.
            unsafe { rows(w, &a, m, n, lo, hi, outp, kernel) };
        }
    };
    pool.run(tasks, &run); // one task runs on the caller
    Ok(())
}

/// Output columns `lo..hi` of every row.
#[allow(clippy::too_many_arguments)]
unsafe fn rows(
    w: &Weight,
    a: &QAct,
    m: usize,
    n: usize,
    lo: usize,
    hi: usize,
    out: OutPtr,
    kernel: Kernel,
) {
    let mut m0 = 0;
    while m0 < m {
        let mt = (m - m0).min(4);
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Avx512Vnni {
            simd::dot_cols(w, a, m0, mt, lo..hi, n, out);
            m0 += mt;
            continue;
        }
        for col in lo..hi {
            let mut acc = [0f32; 4];
            scalar_dot_rows(w, a, m0, mt, col, &mut acc);
            for (r, v) in acc[..mt].iter().enumerate() {
                *out.0.add((m0 + r) * n + col) = *v;
            }
        }
        m0 += mt;
    }
}

/// The per-group terms the scalar loop's dot products of raw codes leave out: int4's
/// `−8 · scale · d · Σq + zero · Σx`; int8's `zero · Σx` (its codes are signed).
fn correction(w: &Weight, a: &QAct, row: usize, col: usize) -> f32 {
    let kb = a.k / GROUP;
    let (dsum, xsum) = (&a.dsum[row * kb..][..kb], &a.xsum[row * kb..][..kb]);
    match w {
        Weight::Int4(w) => {
            let (s, z) = (&w.scale[col * kb..][..kb], &w.zero[col * kb..][..kb]);
            (0..kb).map(|g| z[g] * xsum[g] - 8.0 * s[g] * dsum[g]).sum()
        }
        Weight::Int8(w) => match w.zero {
            Some(z) => (0..kb).map(|g| z[col * kb + g] * xsum[g]).sum(),
            None => 0.0,
        },
    }
}

/// Group `g` of output row `col` as `w = s[h] · code + z` for its halves `h` of 16 columns
/// (int4: `z = zero − 8 · scale`).
fn group_affine(w: &Weight, col: usize, g: usize) -> ([f32; 2], f32) {
    let kb = w.shape().1 / GROUP;
    match w {
        Weight::Int4(w) => {
            let s = w.scale[col * kb + g];
            ([s, s], w.zero[col * kb + g] - 8.0 * s)
        }
        Weight::Int8(w) => (
            w.half_scales(col, g),
            w.zero.map_or(0.0, |z| z[col * kb + g]),
        ),
    }
}

/// `Σ scale · d · (code − offset) · qx` over group `g` of output row `col` (its `codes`)
/// against the activations `q` of scale `d`: one product for a group of one scale, one a
/// half for int8 scales of 16 columns.
fn scaled_dot(
    w: &Weight,
    col: usize,
    g: usize,
    codes: &[i32; GROUP],
    offset: i32,
    q: &[i8],
    d: f32,
) -> f32 {
    let dot = |r: std::ops::Range<usize>| -> f32 {
        codes[r.clone()]
            .iter()
            .zip(&q[r])
            .map(|(&c, &x)| (c - offset) * x as i32)
            .sum::<i32>() as f32
    };
    let kb = w.shape().1 / GROUP;
    match w {
        Weight::Int4(w) => w.scale[col * kb + g] * d * dot(0..GROUP),
        Weight::Int8(w) if w.scale_group == GROUP => w.scale[col * kb + g] * d * dot(0..GROUP),
        Weight::Int8(w) => {
            let [s0, s1] = w.half_scales(col, g);
            d * (s0 * dot(0..16) + s1 * dot(16..GROUP))
        }
    }
}

/// The codes of group `g` of output row `col`, in column order.
fn group_codes(w: &Weight, col: usize, g: usize, codes: &mut [i32; GROUP]) {
    match w {
        Weight::Int4(w) => {
            let kb = w.k / GROUP;
            let row = &w.packed[col * w.k / 2..][..w.k / 2];
            if g / 2 < kb / 2 {
                let pair = &row[(g / 2) * 32..][..32];
                let shift = 4 * (g % 2) as u32;
                for (c, &b) in codes.iter_mut().zip(pair) {
                    *c = ((b >> shift) & 15) as i32;
                }
            } else {
                let last = &row[(g / 2) * 32..][..16];
                for j in 0..16 {
                    codes[j] = (last[j] & 15) as i32;
                    codes[16 + j] = (last[j] >> 4) as i32;
                }
            }
        }
        Weight::Int8(w) => {
            for (c, &q) in codes
                .iter_mut()
                .zip(&w.codes[col * w.k + g * GROUP..][..GROUP])
            {
                *c = q as i32;
            }
        }
    }
}

/// The portable inner loop: the same arithmetic as the SIMD one, one group at a time.
#[allow(clippy::needless_range_loop)]
fn scalar_dot_rows(w: &Weight, a: &QAct, m0: usize, mt: usize, col: usize, acc: &mut [f32; 4]) {
    let kb = a.k / GROUP;
    let mut codes = [0i32; GROUP];
    for g in 0..kb {
        group_codes(w, col, g, &mut codes);
        for r in 0..mt {
            let row = m0 + r;
            let q = &a.q[row * a.k + g * GROUP..][..GROUP];
            acc[r] += scaled_dot(w, col, g, &codes, 0, q, a.d[row * kb + g]);
        }
    }
    for (r, v) in acc[..mt].iter_mut().enumerate() {
        *v += correction(w, a, m0 + r, col);
    }
}

#[cfg(target_arch = "x86_64")]
mod simd;

/// bf16 bits of `v`, rounded to nearest even.
fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The whole weight as bfloat16 `[N, K]` (for large M, where a dense GEMM wins).
pub fn dequantize_bf16(
    w: &Weight,
    out: &mut [u16],
    pool: &Pool,
    kernel: Kernel,
) -> Result<(), String> {
    w.validate()?;
    let (n, k) = w.shape();
    if out.len() != n * k {
        return Err(format!(
            "out has {} elements, [{n}, {k}] needs {}",
            out.len(),
            n * k
        ));
    }
    let kb = k / GROUP;
    let tasks = (n / 64).clamp(1, 4 * pool.threads());
    let rows_per = n.div_ceil(tasks);
    let outp = OutPtr(out.as_mut_ptr() as *mut f32);
    pool.run(tasks, &|t| {
        let mut codes = [0i32; GROUP];
        for col in t * rows_per..((t + 1) * rows_per).min(n) {
            // SAFETY: each task writes its own rows of `out`.
            let dst =
                unsafe { std::slice::from_raw_parts_mut((outp.get() as *mut u16).add(col * k), k) };
            let mut first = 0;
            #[cfg(target_arch = "x86_64")]
            if kernel == Kernel::Avx512Vnni {
                // SAFETY: the CPU has AVX-512 (checked by `best_kernel`).
                unsafe { simd::dequantize_row(w, col, dst) };
                first = match w {
                    Weight::Int4(_) => kb / 2 * 2,
                    Weight::Int8(_) => kb,
                };
            }
            for g in first..kb {
                group_codes(w, col, g, &mut codes);
                let (s, z) = group_affine(w, col, g);
                for (j, (d, &c)) in dst[g * GROUP..][..GROUP].iter_mut().zip(&codes).enumerate() {
                    *d = f32_to_bf16(s[j / 16] * c as f32 + z);
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
