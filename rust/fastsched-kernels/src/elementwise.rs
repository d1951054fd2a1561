//! The elementwise ops of a decoder layer, each one pass over its rows, rounding where the
//! torch ops they replace round (`fastsched.models.llama`):
//!
//! - [`add_rms_norm_bf16`]: the residual add and RMSNorm, `h ← bf16(h + δ)`, then
//!   `bf16(w · bf16(h · rsqrt(mean(h²) + ε)))` with the mean in float32;
//! - [`rope`]: rotate-half RoPE in place from a cos/sin table, `bf16(x·cos) + bf16(rot·sin)`
//!   rounded (float32: the same without the bf16 roundings), the same bits as torch's;
//! - [`silu_mul_bf16`]: `bf16(bf16(silu(gate)) · up)`.
//!
//! The mean of squares and `exp` differ from torch's in the last float32 bit now and then
//! (summation order; a polynomial `exp`), which a bfloat16 result shows only when it sits
//! on a rounding boundary: hence bfloat16 only for those two. Rows are independent.

use crate::attention::{bf16_to_f32, f32_to_bf16, Floats, FloatsMut};

const LANES: usize = 16;

/// Element `i` of `δ` is added to the residual stream `h` (both `[M, N]`, updated in
/// place) if `delta` is given; then `out[M, N]` = RMSNorm of `h` with `weight [N]`.
pub fn add_rms_norm_bf16(
    hidden: &mut [u16],
    delta: Option<&[u16]>,
    weight: &[u16],
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
    fn add_norm_rows(hidden: &mut [u16], delta: Option<&[u16]>, weight: &[u16], eps: f32, out: &mut [u16]) {
        let n = weight.len();
        for (r, (h, o)) in hidden
            .chunks_exact_mut(n)
            .zip(out.chunks_exact_mut(n))
            .enumerate()
        {
            if let Some(delta) = delta {
                add_row(h, &delta[r * n..][..n]);
            }
            norm_row(h, weight, eps, o);
        }
    }
}

#[inline(always)]
fn add_row(h: &mut [u16], d: &[u16]) {
    for (h, &d) in h.iter_mut().zip(d) {
        *h = f32_to_bf16(bf16_to_f32(*h) + bf16_to_f32(d));
    }
}

#[inline(always)]
fn norm_row(h: &[u16], w: &[u16], eps: f32, out: &mut [u16]) {
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
    let inv = 1.0 / (sum / h.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(h).zip(w) {
        let normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(v) * inv));
        *o = f32_to_bf16(bf16_to_f32(w) * normed);
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
        add_rms_norm_bf16(&mut hidden, Some(&delta), &weight, 0.0, &mut out).unwrap();
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
