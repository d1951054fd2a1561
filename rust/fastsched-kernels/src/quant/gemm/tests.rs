//! The many-row bf16 GEMM against a f64 reference of the same bf16 operands, its SIMD
//! decode against the scalar one, and batch invariance (a row alone == the row in a batch).

use super::super::tests::{int4_case, int8_case, int8_layout_case, Rng, INT8_LAYOUTS};
use super::*;
use crate::quant::{bf16_to_f32, f32_to_bf16, Int4, Int8};

/// (N, K, M): N not a multiple of NR, K not a multiple of 64 (odd int4 groups), M not a
/// multiple of MR, and a layer-sized one.
const CASES: [(usize, usize, usize); 6] = [
    (1, 32, 1),
    (5, 96, 7),
    (9, 32, 6),
    (70, 160, 13),
    (130, 576, 33),
    (67, 1536, 100),
];

fn kernels() -> Vec<Kernel> {
    let mut v = vec![Kernel::Scalar];
    if gemm_kernel() != Kernel::Scalar {
        v.push(gemm_kernel());
    }
    v
}

/// Runs `f` on an int4 weight and an int8 weight of each layout, of shape `[n, k]`.
fn for_weights(rng: &mut Rng, n: usize, k: usize, mut f: impl FnMut(&Weight)) {
    for layout in INT8_LAYOUTS {
        f(&int8_layout_case(rng, n, k, layout).weight());
    }
    let (packed, scale, zero, _) = int4_case(rng, n, k);
    let (codes, s8, _) = int8_case(rng, n, k);
    f(&Weight::Int4(Int4 {
        n,
        k,
        packed: &packed,
        scale: &scale,
        zero: &zero,
    }));
    f(&Weight::Int8(Int8 {
        n,
        k,
        codes: &codes,
        scale: &s8,
        zero: None,
        scale_group: crate::GROUP,
    }));
}

fn bf16_x(rng: &mut Rng, m: usize, k: usize) -> Vec<u16> {
    (0..m * k).map(|_| f32_to_bf16(rng.uniform())).collect()
}

#[test]
fn decode_matches_the_scalar_rule_bit_exactly() {
    let mut rng = Rng(11);
    for &(n, k, _) in &CASES {
        for_weights(&mut rng, n, k, |w| {
            for col in 0..n {
                let (mut want, mut got) = (vec![0u16; k], vec![0u16; k]);
                decode_scalar(w, col, &mut want);
                match gemm_kernel() {
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512Vnni => unsafe { simd::decode(w, col, &mut got) },
                    _ => decode_scalar(w, col, &mut got),
                }
                assert_eq!(got, want, "[{n}, {k}] column {col}");
            }
        });
    }
}

#[test]
fn gemm_matches_the_bf16_reference() {
    let mut rng = Rng(12);
    let pool = Pool::new(2);
    for &(n, k, m) in &CASES {
        let x = bf16_x(&mut rng, m, k);
        for_weights(&mut rng, n, k, |w| {
            let dense: Vec<Vec<u16>> = (0..n)
                .map(|c| {
                    let mut d = vec![0u16; k];
                    decode_scalar(w, c, &mut d);
                    d
                })
                .collect();
            for kernel in kernels() {
                let mut out = vec![0f32; m * n];
                gemm_bf16(w, &x, m, &mut out, &pool, kernel).unwrap();
                for r in 0..m {
                    for (c, wc) in dense.iter().enumerate() {
                        let terms = x[r * k..(r + 1) * k]
                            .iter()
                            .zip(wc)
                            .map(|(&a, &b)| bf16_to_f32(a) as f64 * bf16_to_f32(b) as f64);
                        let (exact, size) =
                            terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
                        // fp32 accumulation over K products, in some order
                        let bound = 1e-6 * (k as f64).sqrt() * size + 1e-30;
                        let got = out[r * n + c] as f64;
                        assert!(
                            (got - exact).abs() <= bound,
                            "{kernel:?} [{n}, {k}] M={m} row {r} col {c}: {got} vs {exact}"
                        );
                    }
                }
            }
        });
    }
}

#[test]
fn a_row_is_bit_equal_alone_and_in_any_batch() {
    let mut rng = Rng(13);
    let (one, two) = (Pool::new(1), Pool::new(2));
    for &(n, k, m) in &CASES {
        let x = bf16_x(&mut rng, m, k);
        for_weights(&mut rng, n, k, |w| {
            for kernel in kernels() {
                let mut batch = vec![0f32; m * n];
                gemm_bf16(w, &x, m, &mut batch, &two, kernel).unwrap();
                for r in 0..m {
                    let mut alone = vec![0f32; n];
                    gemm_bf16(w, &x[r * k..(r + 1) * k], 1, &mut alone, &one, kernel).unwrap();
                    let row = &batch[r * n..(r + 1) * n];
                    assert!(
                        row.iter()
                            .zip(&alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?} [{n}, {k}] M={m} row {r}"
                    );
                }
            }
        });
    }
}

#[test]
fn bad_lengths_are_refused() {
    let pool = Pool::new(1);
    let (codes, scale) = (vec![0i8; 64], vec![1f32; 2]);
    let w = Weight::Int8(Int8 {
        n: 2,
        k: 32,
        codes: &codes,
        scale: &scale,
        zero: None,
        scale_group: crate::GROUP,
    });
    let err = gemm_bf16(&w, &[0; 31], 1, &mut [0.0; 2], &pool, Kernel::Scalar).unwrap_err();
    assert!(err.contains("x has 31"), "{err}");
}
