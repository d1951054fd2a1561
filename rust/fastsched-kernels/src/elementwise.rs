//! The elementwise ops of a decoder layer, each one pass over its rows, rounding where the
//! torch ops they replace round (`fastsched.models.llama`):
//!
//! - [`add_rms_norm_bf16`]: the residual add and RMSNorm, `h ← bf16(h + δ)`, then with
//!   `x̂ = h · rsqrt(mean(h²) + ε)` in float32 either Llama's `bf16(w · bf16(x̂))` (a bfloat16
//!   weight) or Gemma's `bf16(w · x̂)` (a float32 weight, Gemma's `1 + w` already added):
//!   [`NormWeight`];
//! - [`rms_norm_heads_bf16`]: the same RMSNorm in place on each head of q or k (Qwen3's and
//!   Gemma 3's q/k norms);
//! - [`rope`]: rotate-half RoPE in place from a cos/sin table, `bf16(x·cos) + bf16(rot·sin)`
//!   rounded (float32: the same without the bf16 roundings), the same bits as torch's;
//! - [`silu_mul_bf16`]: `bf16(bf16(silu(gate)) · up)`;
//! - [`gelu_tanh_mul_bf16`]: `bf16(bf16(gelu_tanh(gate)) · up)` (Gemma's GeGLU), with
//!   `gelu_tanh(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` as torch computes it.
//!
//! The mean of squares, `exp` and `tanh` differ from torch's in the last float32 bit now and then
//! (summation order; a polynomial `exp`), which a bfloat16 result shows only when it sits
//! on a rounding boundary: hence bfloat16 only for those two. Rows are independent.

use crate::attention::{bf16_to_f32, f32_to_bf16, Floats, FloatsMut};

const LANES: usize = 16;

/// An RMSNorm's weight `[N]`, whose dtype says how the norm rounds (module docs).
#[derive(Clone, Copy)]
pub enum NormWeight<'a> {
    /// Llama's: `bf16(w · bf16(x̂))`.
    Bf16(&'a [u16]),
    /// Gemma's, handed over as `1 + w`: `bf16(w · x̂)`, one rounding.
    F32(&'a [f32]),
}

impl NormWeight<'_> {
    pub fn len(&self) -> usize {
        match self {
            NormWeight::Bf16(w) => w.len(),
            NormWeight::F32(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Element `i` of `δ` is added to the residual stream `h` (both `[M, N]`, updated in
/// place) if `delta` is given; then `out[M, N]` = RMSNorm of `h` with `weight [N]`.
pub fn add_rms_norm_bf16(
    hidden: &mut [u16],
    delta: Option<&[u16]>,
    weight: NormWeight,
    eps: f32,
    out: &mut [u16],
) -> Result<(), String> {
    let n = weight.len();
    if n == 0
        || !hidden.len().is_multiple_of(n)
        || out.len() != hidden.len()
        || delta.is_some_and(|d| d.len() != hidden.len())
    {
        return Err(format!(
            "hidden has {} elements, out {}, delta {:?}: not [M, {n}] alike",
            hidden.len(),
            out.len(),
            delta.map(|d| d.len())
        ));
    }
    add_norm_rows(hidden, delta, weight, eps, out);
    Ok(())
}

simd_fn! {
    fn add_norm_rows(hidden: &mut [u16], delta: Option<&[u16]>, weight: NormWeight, eps: f32, out: &mut [u16]) {
        let n = weight.len();
        for (r, (h, o)) in hidden
            .chunks_exact_mut(n)
            .zip(out.chunks_exact_mut(n))
            .enumerate()
        {
            if let Some(delta) = delta {
                add_row(h, &delta[r * n..][..n]);
            }
            let inv = inv_rms(h, eps);
            norm_row(h, inv, weight, o);
        }
    }
}

/// RMSNorm in place on the first `heads` heads of `d` elements (one `weight [d]`) of each of
/// `rows` rows of `x`, `stride` elements apart: q's or k's heads in a fused q/k/v row.
pub fn rms_norm_heads_bf16(
    x: &mut [u16],
    stride: usize,
    rows: usize,
    heads: usize,
    weight: NormWeight,
    eps: f32,
) -> Result<(), String> {
    let d = weight.len();
    let need = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + heads * d
    };
    if d == 0 || x.len() < need || (rows > 1 && stride < heads * d) {
        return Err(format!(
            "x has {} elements, {rows} rows {stride} apart of {heads} heads x {d} need {need}",
            x.len()
        ));
    }
    norm_heads(x, stride, rows, heads, weight, eps);
    Ok(())
}

simd_fn! {
    fn norm_heads(x: &mut [u16], stride: usize, rows: usize, heads: usize, weight: NormWeight, eps: f32) {
        let d = weight.len();
        let mut head = vec![0u16; d];
        for r in 0..rows {
            for h in x[r * stride..][..heads * d].chunks_exact_mut(d) {
                head.copy_from_slice(h);
                norm_row(&head, inv_rms(&head, eps), weight, h);
            }
        }
    }
}

#[inline(always)]
fn add_row(h: &mut [u16], d: &[u16]) {
    for (h, &d) in h.iter_mut().zip(d) {
        *h = f32_to_bf16(bf16_to_f32(*h) + bf16_to_f32(d));
    }
}

/// `1 / sqrt(mean(h²) + ε)` in float32, 16 lane sums.
#[inline(always)]
fn inv_rms(h: &[u16], eps: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = h.chunks_exact(LANES);
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&v| bf16_to_f32(v) * bf16_to_f32(v))
        .sum();
    for c in chunks {
        for l in 0..LANES {
            let v = bf16_to_f32(c[l]);
            acc[l] += v * v;
        }
    }
    let sum = acc.iter().sum::<f32>() + tail;
    1.0 / (sum / h.len() as f32 + eps).sqrt()
}

#[inline(always)]
fn norm_row(h: &[u16], inv: f32, weight: NormWeight, out: &mut [u16]) {
    match weight {
        NormWeight::Bf16(w) => {
            for ((o, &v), &w) in out.iter_mut().zip(h).zip(w) {
                let normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(v) * inv));
                *o = f32_to_bf16(bf16_to_f32(w) * normed);
            }
        }
        NormWeight::F32(w) => {
            for ((o, &v), &w) in out.iter_mut().zip(h).zip(w) {
                *o = f32_to_bf16(bf16_to_f32(v) * inv * w);
            }
        }
    }
}

/// Rotates `heads` heads of `d` dims at the start of each of `positions.len()` rows of `x`
/// (`stride` elements apart) in place: the row at position `p` by row `p` of the `[len, d]`
/// tables `cos` and `sin` (`cat(freqs, freqs)` layout), all of `x`'s dtype.
pub fn rope(
    x: &mut FloatsMut,
    stride: usize,
    heads: usize,
    d: usize,
    positions: &[i64],
    cos: Floats,
    sin: Floats,
) -> Result<(), String> {
    let rows = positions.len();
    let need = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + heads * d
    };
    let len = cos.len() / d.max(1);
    if !d.is_multiple_of(2) || x.len() < need || cos.len() != len * d || sin.len() != cos.len() {
        return Err(format!(
            "x has {} elements ({rows} rows {stride} apart of {heads} x {d} needs {need}); cos {} and sin {} not [len, {d}]",
            x.len(),
            cos.len(),
            sin.len()
        ));
    }
    if let Some(p) = positions.iter().find(|&&p| p < 0 || p as usize >= len) {
        return Err(format!("positions holds {p}, the table has {len} rows"));
    }
    match (x, cos, sin) {
        (FloatsMut::F32(x), Floats::F32(c), Floats::F32(s)) => {
            rope_f32(x, stride, heads, d, positions, c, s)
        }
        (FloatsMut::Bf16(x), Floats::Bf16(c), Floats::Bf16(s)) => {
            rope_bf16(x, stride, heads, d, positions, c, s)
        }
        _ => return Err("x, cos and sin must share a dtype".to_string()),
    }
    Ok(())
}

simd_fn! {
    fn rope_f32(x: &mut [f32], stride: usize, heads: usize, d: usize, positions: &[i64], c: &[f32], s: &[f32]) {
        for (r, &p) in positions.iter().enumerate() {
            let (c, s) = (&c[p as usize * d..][..d], &s[p as usize * d..][..d]);
            for h in x[r * stride..][..heads * d].chunks_exact_mut(d) {
                rope_head(h, c, s, |v| v, |v| v);
            }
        }
    }
}

simd_fn! {
    fn rope_bf16(x: &mut [u16], stride: usize, heads: usize, d: usize, positions: &[i64], c: &[u16], s: &[u16]) {
        for (r, &p) in positions.iter().enumerate() {
            let (c, s) = (&c[p as usize * d..][..d], &s[p as usize * d..][..d]);
            for h in x[r * stride..][..heads * d].chunks_exact_mut(d) {
                rope_head(h, c, s, bf16_to_f32, f32_to_bf16);
            }
        }
    }
}

#[inline(always)]
fn rope_head<T: Copy>(
    h: &mut [T],
    c: &[T],
    s: &[T],
    wide: impl Fn(T) -> f32,
    narrow: impl Fn(f32) -> T,
) {
    let half = h.len() / 2;
    let round = |v: f32| wide(narrow(v));
    for i in 0..half {
        let (a, b) = (wide(h[i]), wide(h[i + half]));
        let lo = round(round(a * wide(c[i])) + round(-b * wide(s[i])));
        let hi = round(round(b * wide(c[i + half])) + round(a * wide(s[i + half])));
        h[i] = narrow(lo);
        h[i + half] = narrow(hi);
    }
}

/// `out[M, I] = bf16(bf16(silu(gate)) · up)` for `gate_up [M, 2I]` (gate first).
pub fn silu_mul_bf16(gate_up: &[u16], out: &mut [u16], inner: usize) -> Result<(), String> {
    if inner == 0 || !out.len().is_multiple_of(inner) || gate_up.len() != 2 * out.len() {
        return Err(format!(
            "gate_up has {} and out {} elements, not [M, 2 x {inner}] and [M, {inner}]",
            gate_up.len(),
            out.len()
        ));
    }
    silu_mul_rows(gate_up, out, inner);
    Ok(())
}

simd_fn! {
    fn silu_mul_rows(gate_up: &[u16], out: &mut [u16], inner: usize) {
        for (gu, o) in gate_up
            .chunks_exact(2 * inner)
            .zip(out.chunks_exact_mut(inner))
        {
            let (g, u) = gu.split_at(inner);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                let g = bf16_to_f32(g);
                let silu = bf16_to_f32(f32_to_bf16(g / (1.0 + exp(-g))));
                *o = f32_to_bf16(silu * bf16_to_f32(u));
            }
        }
    }
}

/// `out[M, I] = bf16(bf16(gelu_tanh(gate)) · up)` for `gate_up [M, 2I]` (gate first).
pub fn gelu_tanh_mul_bf16(gate_up: &[u16], out: &mut [u16], inner: usize) -> Result<(), String> {
    if inner == 0 || !out.len().is_multiple_of(inner) || gate_up.len() != 2 * out.len() {
        return Err(format!(
            "gate_up has {} and out {} elements, not [M, 2 x {inner}] and [M, {inner}]",
            gate_up.len(),
            out.len()
        ));
    }
    gelu_tanh_mul_rows(gate_up, out, inner);
    Ok(())
}

simd_fn! {
    fn gelu_tanh_mul_rows(gate_up: &[u16], out: &mut [u16], inner: usize) {
        for (gu, o) in gate_up
            .chunks_exact(2 * inner)
            .zip(out.chunks_exact_mut(inner))
        {
            let (g, u) = gu.split_at(inner);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                let gelu = bf16_to_f32(f32_to_bf16(gelu_tanh(bf16_to_f32(g))));
                *o = f32_to_bf16(gelu * bf16_to_f32(u));
            }
        }
    }
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, in torch's order of operations.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = 0.797_884_6; // √(2/π)
    let inner = BETA * (x + 0.044_715 * (x * x * x));
    0.5 * x * (1.0 + tanh(inner))
}

/// `tanh(x)` as `±(1 − 2 / (e^{2|x|} + 1))`: within ~2 float32 ulps of 1 everywhere and
/// near-correctly rounded close to ±1, which is what `1 + tanh` needs (not accurate
/// relative to a tiny `tanh` itself); vectorizes through [`exp`]. Exactly ±1 from
/// |x| > [`TANH_SATURATES`] on, as torch's CPU `tanh` gives it, so that a GELU of a gate
/// below about −5 is 0 as torch's is, not a few 1e-7.
#[inline(always)]
fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let t = if a > TANH_SATURATES {
        0.0
    } else {
        2.0 / (exp(2.0 * a) + 1.0)
    };
    (1.0 - t).copysign(x)
}

/// Where torch's vectorized float32 `tanh` (the one its bfloat16 GELU runs) returns ±1
/// (measured on torch 2.x: exactly ±1 above it, `1 − 2^-24` just below).
const TANH_SATURATES: f32 = 8.664_34;

/// `eˣ` to ~2 float32 ulps, written so that it vectorizes: `2ⁿ · p(r)`, `x = n·ln2 + r`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.987_569_1e-4f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 5e-1;
    let p = p * r * r + r + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(v: f32) -> u16 {
        f32_to_bf16(v)
    }

    #[test]
    fn exp_is_within_two_ulps_of_libm() {
        for i in -8700..8800 {
            let x = i as f32 * 0.01;
            let (a, b) = (exp(x), x.exp());
            assert!(((a - b) / b).abs() < 2.5e-7, "exp({x}) = {a}, libm {b}");
        }
    }

    #[test]
    fn add_rms_norm_adds_the_residual_then_normalizes_in_float32() {
        let mut hidden: Vec<u16> = [1.0, 2.0, 3.0, 4.0, 0.5, 0.5, 0.5, 0.5].map(bf).to_vec();
        let delta: Vec<u16> = [1.0, 0.0, -1.0, 0.0, 0.5, -0.5, 0.5, -0.5].map(bf).to_vec();
        let weight: Vec<u16> = [1.0, 2.0, 1.0, 0.5].map(bf).to_vec();
        let mut out = vec![0u16; 8];
        add_rms_norm_bf16(
            &mut hidden,
            Some(&delta),
            NormWeight::Bf16(&weight),
            0.0,
            &mut out,
        )
        .unwrap();
        let h: Vec<f32> = hidden.iter().map(|&b| bf16_to_f32(b)).collect();
        assert_eq!(h, [2.0, 2.0, 2.0, 4.0, 1.0, 0.0, 1.0, 0.0]);
        let want = |row: &[f32], w: &[f32]| -> Vec<f32> {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
            row.iter()
                .zip(w)
                .map(|(v, w)| bf16_to_f32(bf(w * bf16_to_f32(bf(v * inv)))))
                .collect()
        };
        let got: Vec<f32> = out.iter().map(|&b| bf16_to_f32(b)).collect();
        let w = [1.0, 2.0, 1.0, 0.5];
        assert_eq!(got[..4], want(&h[..4], &w)[..]);
        assert_eq!(got[4..], want(&h[4..], &w)[..]);
    }

    #[test]
    fn a_float32_weight_norms_with_one_rounding() {
        // Gemma: bf16(x̂ · w) with w = 1 + checkpoint weight in float32
        let mut hidden: Vec<u16> = [1.0, 2.0, 3.0, 4.0].map(bf).to_vec();
        let weight = [1.0f32, 1.003, 0.5, 2.0];
        let mut out = vec![0u16; 4];
        add_rms_norm_bf16(&mut hidden, None, NormWeight::F32(&weight), 0.0, &mut out).unwrap();
        let inv = 1.0 / 7.5f32.sqrt();
        for (i, &v) in [1.0f32, 2.0, 3.0, 4.0].iter().enumerate() {
            assert_eq!(out[i], bf(v * inv * weight[i]), "element {i}");
        }
    }

    #[test]
    fn head_norms_touch_only_their_heads_each_normed_alone() {
        // rows of 2 heads of 4, then 2 more elements, 12 apart
        let row = [1.0, 2.0, 3.0, 4.0, 0.5, 0.5, -0.5, 0.5, 7.0, 8.0, 9.0, 10.0];
        let mut x: Vec<u16> = row.iter().chain(&row).map(|&v| bf(v)).collect();
        let weight: Vec<u16> = [1.0, 2.0, 1.0, 0.5].map(bf).to_vec();
        rms_norm_heads_bf16(&mut x, 12, 2, 2, NormWeight::Bf16(&weight), 1e-6).unwrap();
        for r in 0..2 {
            for h in 0..2 {
                let mut head: Vec<u16> = row[h * 4..][..4].iter().map(|&v| bf(v)).collect();
                let mut want = vec![0u16; 4];
                add_rms_norm_bf16(&mut head, None, NormWeight::Bf16(&weight), 1e-6, &mut want)
                    .unwrap();
                assert_eq!(x[r * 12 + h * 4..][..4], want[..], "row {r} head {h}");
            }
            let rest: Vec<u16> = row[8..].iter().map(|&v| bf(v)).collect();
            assert_eq!(x[r * 12 + 8..][..4], rest[..], "row {r}: not a head");
        }
        let err =
            rms_norm_heads_bf16(&mut x, 12, 3, 2, NormWeight::Bf16(&weight), 1e-6).unwrap_err();
        assert!(err.contains("3 rows"), "{err}");
    }

    #[test]
    fn gelu_tanh_mul_matches_its_definition_in_float64() {
        let gates = [-12.0, -4.0, -1.0, -0.01, 0.0, 0.3, 1.0, 2.5, 8.0];
        let gate_up: Vec<u16> = gates.iter().chain(&[1.5; 9]).map(|&v| bf(v)).collect();
        let mut out = vec![0u16; 9];
        gelu_tanh_mul_bf16(&gate_up, &mut out, 9).unwrap();
        for (i, &g) in gates.iter().enumerate() {
            let g = g as f64;
            let gelu = 0.5
                * g
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh());
            let want = bf16_to_f32(bf(bf16_to_f32(bf(gelu as f32)) * 1.5));
            let got = bf16_to_f32(out[i]);
            assert!(
                (got - want).abs() <= want.abs() / 128.0,
                "gate {g}: {got} vs {want}"
            );
        }
        assert!(gelu_tanh_mul_bf16(&gate_up, &mut out[..4], 9).is_err());
    }

    #[test]
    fn rope_rotates_each_half_pair_by_its_rows_angle() {
        // d = 4: pairs (0, 2) and (1, 3); position 1 rotates by 90° and 180°.
        let (cos, sin) = (
            [1.0f32, 1.0, 1.0, 1.0, 0.0, -1.0, 0.0, -1.0],
            [0.0f32, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0],
        );
        let mut x = vec![1.0f32, 2.0, 3.0, 4.0, 9.0, 1.0, 2.0, 3.0, 4.0];
        let (c, s) = (cos.to_vec(), sin.to_vec());
        rope(
            &mut FloatsMut::F32(&mut x),
            5,
            1,
            4,
            &[0, 1],
            Floats::F32(&c),
            Floats::F32(&s),
        )
        .unwrap();
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0, 9.0, -3.0, -2.0, 1.0, -4.0]);
        let err = rope(
            &mut FloatsMut::F32(&mut x),
            5,
            1,
            4,
            &[2],
            Floats::F32(&c),
            Floats::F32(&s),
        )
        .unwrap_err();
        assert!(err.contains("positions"), "{err}");
    }

    #[test]
    fn silu_mul_matches_its_definition() {
        let gate_up: Vec<u16> = [-2.0, 0.0, 3.0, 1.0, 2.0, -1.5].map(bf).to_vec();
        let mut out = vec![0u16; 3];
        silu_mul_bf16(&gate_up, &mut out, 3).unwrap();
        for (i, &g) in [-2.0f32, 0.0, 3.0].iter().enumerate() {
            let want = bf16_to_f32(bf(
                bf16_to_f32(bf(g / (1.0 + (-g).exp()))) * [1.0, 2.0, -1.5][i]
            ));
            assert_eq!(bf16_to_f32(out[i]), want);
        }
    }
}
