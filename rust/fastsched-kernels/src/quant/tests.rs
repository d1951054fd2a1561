//! Each kernel against the scalar reference: dequantize in f64, then matmul.

use super::*;

pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next() % 1_000_000) as f32 / 500_000.0 - 1.0
    }
}

pub(crate) struct Dense {
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) w: Vec<f64>,
}

pub(crate) fn int4_case(rng: &mut Rng, n: usize, k: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>, Dense) {
    let kb = k / GROUP;
    let codes: Vec<u8> = (0..n * k).map(|_| (rng.next() % 16) as u8).collect();
    let scale: Vec<f32> = (0..n * kb)
        .map(|_| 0.01 + 0.05 * rng.uniform().abs())
        .collect();
    let zero: Vec<f32> = (0..n * kb).map(|_| 0.1 * rng.uniform()).collect();
    let w = (0..n * k)
        .map(|i| scale[i / GROUP] as f64 * (codes[i] as f64 - 8.0) + zero[i / GROUP] as f64)
        .collect();
    (pack_int4(&codes, n, k), scale, zero, Dense { n, k, w })
}

pub(crate) fn int8_case(rng: &mut Rng, n: usize, k: usize) -> (Vec<i8>, Vec<f32>, Dense) {
    let codes: Vec<i8> = (0..n * k)
        .map(|_| ((rng.next() % 255) as i32 - 127) as i8)
        .collect();
    let scale: Vec<f32> = (0..n * k / GROUP)
        .map(|_| 0.001 + 0.01 * rng.uniform().abs())
        .collect();
    let w = (0..n * k)
        .map(|i| scale[i / GROUP] as f64 * codes[i] as f64)
        .collect();
    (codes, scale, Dense { n, k, w })
}

/// An int8 weight in one of its layouts (scales per `scale_group` columns, zeros or none),
/// its dense values, and the magnitudes of its code terms `scale · q` (what meets the
/// rounded activations; the zeros meet their exact sums).
pub(crate) struct Int8Case {
    pub(crate) codes: Vec<i8>,
    pub(crate) scale: Vec<f32>,
    pub(crate) zero: Option<Vec<f32>>,
    pub(crate) scale_group: usize,
    pub(crate) dense: Dense,
    pub(crate) code_terms: Vec<f64>,
}

/// The layouts an int8 weight takes: (scale_group, with zeros).
pub(crate) const INT8_LAYOUTS: [(usize, bool); 4] =
    [(32, false), (32, true), (16, false), (16, true)];

pub(crate) fn int8_layout_case(
    rng: &mut Rng,
    n: usize,
    k: usize,
    (scale_group, with_zero): (usize, bool),
) -> Int8Case {
    let codes: Vec<i8> = (0..n * k)
        .map(|_| ((rng.next() % 256) as i32 - 128) as i8)
        .collect();
    let scale: Vec<f32> = (0..n * k / scale_group)
        .map(|_| 0.001 + 0.01 * rng.uniform().abs())
        .collect();
    let zero = with_zero.then(|| {
        (0..n * k / GROUP)
            .map(|_| 0.2 * rng.uniform())
            .collect::<Vec<f32>>()
    });
    let code_terms: Vec<f64> = (0..n * k)
        .map(|i| scale[i / scale_group] as f64 * codes[i] as f64)
        .collect();
    let w = code_terms
        .iter()
        .enumerate()
        .map(|(i, &t)| t + zero.as_ref().map_or(0.0, |z| z[i / GROUP] as f64))
        .collect();
    Int8Case {
        codes,
        scale,
        zero,
        scale_group,
        dense: Dense { n, k, w },
        code_terms,
    }
}

impl Int8Case {
    pub(crate) fn weight(&self) -> Weight<'_> {
        Weight::Int8(Int8 {
            n: self.dense.n,
            k: self.dense.k,
            codes: &self.codes,
            scale: &self.scale,
            zero: self.zero.as_deref(),
            scale_group: self.scale_group,
        })
    }
}

/// Checks `out` against `x · Wᵀ` in f64 within the bound the activations' rounding allows:
/// each x is off by at most half its group's step (`max|x| / 254`), so the error is at
/// most Σ |w| · max|x|_group / 254 (plus float32 accumulation, 1e-5 of Σ |w·x|).
fn check(out: &[f32], x: &[f32], m: usize, d: &Dense, what: &str) {
    check_terms(out, x, m, d, &d.w, what)
}

/// [`check`] with the bound taken over `terms`, the parts of the weights that meet the
/// rounded activations (int8 with zeros: `scale · q`; the zeros meet the exact `Σx`).
fn check_terms(out: &[f32], x: &[f32], m: usize, d: &Dense, terms: &[f64], what: &str) {
    for r in 0..m {
        let xr = &x[r * d.k..][..d.k];
        let amax: Vec<f64> = xr
            .chunks(GROUP)
            .map(|g| g.iter().fold(0f64, |a, v| a.max(v.abs() as f64)))
            .collect();
        for c in 0..d.n {
            let wr = &d.w[c * d.k..][..d.k];
            let exact: f64 = wr.iter().zip(xr).map(|(w, &x)| w * x as f64).sum();
            let bound: f64 = terms[c * d.k..][..d.k]
                .iter()
                .enumerate()
                .map(|(j, w)| w.abs() * amax[j / GROUP] / 254.0)
                .sum::<f64>()
                + 1e-5
                    * wr.iter()
                        .zip(xr)
                        .map(|(w, &x)| (w * x as f64).abs())
                        .sum::<f64>();
            let got = out[r * d.n + c] as f64;
            assert!(
                (got - exact).abs() <= bound,
                "{what}: row {r} col {c}: {got} vs {exact} (bound {bound})"
            );
        }
    }
}

fn kernels() -> Vec<Kernel> {
    let mut v = vec![Kernel::Scalar];
    if best_kernel() != Kernel::Scalar {
        v.push(best_kernel());
    }
    v
}

const SHAPES: [(usize, usize); 5] = [(1, 32), (7, 64), (37, 96), (130, 576), (19, 160)];

#[test]
fn int4_matches_dequantize_then_matmul() {
    let mut rng = Rng(1);
    let pool = Pool::new(2);
    for (n, k) in SHAPES {
        let (packed, scale, zero, dense) = int4_case(&mut rng, n, k);
        let w = Weight::Int4(Int4 {
            n,
            k,
            packed: &packed,
            scale: &scale,
            zero: &zero,
        });
        for m in [1, 3, 8, 33] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
            for kernel in kernels() {
                let mut out = vec![0f32; m * n];
                matmul(&w, Act::F32(&x), m, &mut out, &pool, kernel).unwrap();
                check(
                    &out,
                    &x,
                    m,
                    &dense,
                    &format!("int4 {kernel:?} m={m} n={n} k={k}"),
                );
            }
        }
    }
}

#[test]
fn int8_matches_dequantize_then_matmul() {
    let mut rng = Rng(2);
    let pool = Pool::new(3);
    for (n, k) in SHAPES {
        let (codes, scale, dense) = int8_case(&mut rng, n, k);
        let w = Weight::Int8(Int8 {
            n,
            k,
            codes: &codes,
            scale: &scale,
            zero: None,
            scale_group: crate::GROUP,
        });
        for m in [1, 3, 8, 33] {
            let x: Vec<f32> = (0..m * k).map(|_| 3.0 * rng.uniform()).collect();
            for kernel in kernels() {
                let mut out = vec![0f32; m * n];
                matmul(&w, Act::F32(&x), m, &mut out, &pool, kernel).unwrap();
                check(
                    &out,
                    &x,
                    m,
                    &dense,
                    &format!("int8 {kernel:?} m={m} n={n} k={k}"),
                );
            }
        }
    }
}

#[test]
fn bf16_activations_are_read_as_their_float32_values() {
    let mut rng = Rng(3);
    let pool = Pool::new(1);
    let (n, k, m) = (33, 96, 3);
    let (codes, scale, dense) = int8_case(&mut rng, n, k);
    let w = Weight::Int8(Int8 {
        n,
        k,
        codes: &codes,
        scale: &scale,
        zero: None,
        scale_group: crate::GROUP,
    });
    let bits: Vec<u16> = (0..m * k).map(|_| f32_to_bf16(rng.uniform())).collect();
    let x: Vec<f32> = bits.iter().map(|&b| bf16_to_f32(b)).collect();
    let mut out = vec![0f32; m * n];
    matmul(&w, Act::Bf16(&bits), m, &mut out, &pool, best_kernel()).unwrap();
    check(&out, &x, m, &dense, "bf16 activations");
}

#[test]
fn dequantize_bf16_matches_the_reference() {
    let mut rng = Rng(4);
    let pool = Pool::new(2);
    let (n, k) = (70, 160);
    let (packed, scale, zero, d4) = int4_case(&mut rng, n, k);
    let (codes, s8, d8) = int8_case(&mut rng, n, k);
    for (w, dense) in [
        (
            Weight::Int4(Int4 {
                n,
                k,
                packed: &packed,
                scale: &scale,
                zero: &zero,
            }),
            d4,
        ),
        (
            Weight::Int8(Int8 {
                n,
                k,
                codes: &codes,
                scale: &s8,
                zero: None,
                scale_group: crate::GROUP,
            }),
            d8,
        ),
    ] {
        for kernel in kernels() {
            let mut out = vec![0u16; n * k];
            dequantize_bf16(&w, &mut out, &pool, kernel).unwrap();
            for (i, (&b, &e)) in out.iter().zip(&dense.w).enumerate() {
                let got = bf16_to_f32(b) as f64;
                assert!(
                    (got - e).abs() <= e.abs() / 256.0 + 1e-7,
                    "{kernel:?} element {i}: {got} vs {e}"
                );
            }
        }
    }
}

#[test]
fn bad_shapes_are_refused_naming_the_field() {
    let pool = Pool::new(1);
    let codes = vec![0i8; 60];
    let scale = vec![1f32; 2];
    let w = Weight::Int8(Int8 {
        n: 2,
        k: 32,
        codes: &codes,
        scale: &scale,
        zero: None,
        scale_group: crate::GROUP,
    });
    let mut out = vec![0f32; 2];
    let err = matmul(&w, Act::F32(&[0.0; 32]), 1, &mut out, &pool, Kernel::Scalar).unwrap_err();
    assert!(err.contains("codes") && err.contains("60"), "{err}");
    let w = Weight::Int8(Int8 {
        n: 1,
        k: 40,
        codes: &codes[..40],
        scale: &scale[..1],
        zero: None,
        scale_group: crate::GROUP,
    });
    assert!(matmul(
        &w,
        Act::F32(&[0.0; 40]),
        1,
        &mut out[..1],
        &pool,
        Kernel::Scalar
    )
    .unwrap_err()
    .contains("K = 40"));
}

#[test]
fn zero_activation_groups_give_exact_zeros() {
    let mut rng = Rng(5);
    let pool = Pool::new(1);
    let (n, k) = (16, 64);
    let (codes, scale, _) = int8_case(&mut rng, n, k);
    let w = Weight::Int8(Int8 {
        n,
        k,
        codes: &codes,
        scale: &scale,
        zero: None,
        scale_group: crate::GROUP,
    });
    for kernel in kernels() {
        let mut out = vec![1f32; n];
        matmul(&w, Act::F32(&vec![0.0; k]), 1, &mut out, &pool, kernel).unwrap();
        assert!(out.iter().all(|&v| v == 0.0), "{kernel:?}: {out:?}");
    }
}

/// Speculative decoding needs a row's logits whatever shares its step: a row of an M-row
/// call (four rows at a time) has the bits of the same row alone (four columns at a time).
#[test]
fn a_row_has_the_same_bits_alone_or_among_others() {
    let mut rng = Rng(5);
    let pool = Pool::new(2);
    for (n, k) in SHAPES {
        let (packed, scale, zero, _) = int4_case(&mut rng, n, k);
        let (codes, scale8, _) = int8_case(&mut rng, n, k);
        let weights = [
            Weight::Int4(Int4 {
                n,
                k,
                packed: &packed,
                scale: &scale,
                zero: &zero,
            }),
            Weight::Int8(Int8 {
                n,
                k,
                codes: &codes,
                scale: &scale8,
                zero: None,
                scale_group: crate::GROUP,
            }),
        ];
        for w in &weights {
            let m = 6;
            let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
            for kernel in kernels() {
                let mut all = vec![0f32; m * n];
                matmul(w, Act::F32(&x), m, &mut all, &pool, kernel).unwrap();
                for r in 0..m {
                    let mut one = vec![0f32; n];
                    matmul(w, Act::F32(&x[r * k..][..k]), 1, &mut one, &pool, kernel).unwrap();
                    assert_eq!(one, all[r * n..][..n], "{kernel:?} n={n} k={k} row {r}");
                }
            }
        }
    }
}

/// Every int8 layout (scales per 16 columns as GGUF Q6_K, zeros as Q5_1 / Q5_K) on both
/// kernels, odd group counts included, against dequantize-then-matmul.
#[test]
fn int8_layouts_match_dequantize_then_matmul() {
    let mut rng = Rng(6);
    let pool = Pool::new(2);
    for layout in INT8_LAYOUTS {
        for (n, k) in SHAPES {
            let case = int8_layout_case(&mut rng, n, k, layout);
            for m in [1, 3, 5] {
                let x: Vec<f32> = (0..m * k).map(|_| 3.0 * rng.uniform()).collect();
                for kernel in kernels() {
                    let mut out = vec![0f32; m * n];
                    matmul(&case.weight(), Act::F32(&x), m, &mut out, &pool, kernel).unwrap();
                    let what = format!("int8 {layout:?} {kernel:?} m={m} n={n} k={k}");
                    check_terms(&out, &x, m, &case.dense, &case.code_terms, &what);
                }
            }
        }
    }
}

/// The SIMD kernel computes what the scalar one does, per layout: the same integer dots,
/// scaled per lane; only the float sums' order differs.
#[test]
fn int8_layouts_agree_across_kernels_and_batch_rows() {
    let mut rng = Rng(7);
    let pool = Pool::new(2);
    for layout in INT8_LAYOUTS {
        for (n, k) in SHAPES {
            let case = int8_layout_case(&mut rng, n, k, layout);
            let w = case.weight();
            let m = 6;
            let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
            for kernel in kernels() {
                let mut all = vec![0f32; m * n];
                matmul(&w, Act::F32(&x), m, &mut all, &pool, kernel).unwrap();
                for r in 0..m {
                    let mut one = vec![0f32; n];
                    matmul(&w, Act::F32(&x[r * k..][..k]), 1, &mut one, &pool, kernel).unwrap();
                    assert_eq!(
                        one,
                        all[r * n..][..n],
                        "{layout:?} {kernel:?} n={n} k={k} row {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn int8_layouts_dequantize_to_their_values() {
    let mut rng = Rng(8);
    let pool = Pool::new(2);
    for layout in INT8_LAYOUTS {
        let case = int8_layout_case(&mut rng, 70, 160, layout);
        for kernel in kernels() {
            let mut out = vec![0u16; 70 * 160];
            dequantize_bf16(&case.weight(), &mut out, &pool, kernel).unwrap();
            for (i, (&b, &e)) in out.iter().zip(&case.dense.w).enumerate() {
                let got = bf16_to_f32(b) as f64;
                assert!(
                    (got - e).abs() <= e.abs() / 256.0 + 1e-7,
                    "{layout:?} {kernel:?} element {i}: {got} vs {e}"
                );
            }
        }
    }
}

#[test]
fn int8_scale_group_and_zero_lengths_are_checked() {
    let (codes, scale, zero) = (vec![0i8; 64], vec![1f32; 2], vec![0f32; 1]);
    let w = |scale_group, zero| {
        Weight::Int8(Int8 {
            n: 1,
            k: 64,
            codes: &codes,
            scale: &scale,
            zero,
            scale_group,
        })
    };
    assert!(w(8, None)
        .validate()
        .unwrap_err()
        .contains("scale_group = 8"));
    assert!(w(16, None)
        .validate()
        .unwrap_err()
        .contains("scale has 2 elements"));
    assert!(w(32, Some(&zero))
        .validate()
        .unwrap_err()
        .contains("zero has 1 elements"));
    assert!(w(32, None).validate().is_ok());
}

#[test]
fn a_weight_shape_whose_size_wraps_is_refused() {
    // n · k = 2^64 would wrap to 0 and match empty buffers
    let w = Weight::Int8(Int8 {
        n: 1 << 32,
        k: 1 << 32,
        codes: &[],
        scale: &[],
        zero: None,
        scale_group: GROUP,
    });
    assert!(w.validate().unwrap_err().contains("too large"));
    let ok = Weight::Int8(Int8 {
        n: 1,
        k: 32,
        codes: &[0; 32],
        scale: &[1.0],
        zero: None,
        scale_group: GROUP,
    });
    let err = check_call(&ok, 0, 0, 1 << 60).unwrap_err(); // m · k would wrap
    assert!(err.contains("x has 0 elements"), "{err}");
}
