//! The stack against a float64 Llama (and Qwen3, and a Gemma-style stack with every option)
//! written out from its definition, the invariance of a row to what shares its step, and
//! the shape checks.

use super::*;
use crate::attention::bf16_to_f32;
use crate::elementwise::NormWeight;
use crate::quant::tests::{int4_case, int8_case, Dense, Rng};
use crate::quant::{Int4, Int8};

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const INTER: usize = 96;
const LAYERS: usize = 2;
const BLOCK: usize = 4;
const BLOCKS: usize = 8;

/// A weight kept in both forms: the kernels' buffers and the float64 matrix they stand for.
enum Stored {
    Int4(Vec<u8>, Vec<f32>, Vec<f32>, Dense),
    Int8(Vec<i8>, Vec<f32>, Dense),
}

impl Stored {
    fn new(rng: &mut Rng, n: usize, k: usize, int8: bool) -> Stored {
        if int8 {
            // int8_case's weights are ~4x int4_case's; scaled to match, so that two layers
            // do not blow the activations up
            let (c, mut s, mut d) = int8_case(rng, n, k);
            s.iter_mut().for_each(|s| *s *= 0.25);
            d.w.iter_mut().for_each(|w| *w *= 0.25);
            Stored::Int8(c, s, d)
        } else {
            let (p, s, z, d) = int4_case(rng, n, k);
            Stored::Int4(p, s, z, d)
        }
    }

    fn weight(&self) -> Weight<'_> {
        match self {
            Stored::Int4(p, s, z, d) => Weight::Int4(Int4 {
                n: d.n,
                k: d.k,
                packed: p,
                scale: s,
                zero: z,
            }),
            Stored::Int8(c, s, d) => Weight::Int8(Int8 {
                n: d.n,
                k: d.k,
                codes: c,
                scale: s,
                zero: None,
                scale_group: crate::GROUP,
            }),
        }
    }

    fn dense(&self) -> &Dense {
        match self {
            Stored::Int4(.., d) | Stored::Int8(.., d) => d,
        }
    }
}

/// Which per-layer options the test model has.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Llama,
    /// q/k norms (bfloat16 weights).
    Qwen3,
    /// float32 `1 + w` norms, q/k norms, output norms, GELU-tanh; layer 0 a 3-key sliding
    /// window on its own RoPE table, layer 1 soft-capped; a non-default scale.
    Gemma,
}

/// An RMSNorm weight in the form the variant hands the stack.
enum Norm {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

impl Norm {
    fn new(rng: &mut Rng, n: usize, f32_weight: bool) -> Norm {
        let values = (0..n).map(|_| 1.0 + 0.3 * rng.uniform());
        if f32_weight {
            Norm::F32(values.collect())
        } else {
            Norm::Bf16(values.map(|v| bf(v as f64)).collect())
        }
    }

    fn weight(&self) -> NormWeight<'_> {
        match self {
            Norm::Bf16(w) => NormWeight::Bf16(w),
            Norm::F32(w) => NormWeight::F32(w),
        }
    }

    fn values(&self) -> Vec<f64> {
        match self {
            Norm::Bf16(w) => w.iter().map(|&b| bf16_to_f32(b) as f64).collect(),
            Norm::F32(w) => w.iter().map(|&v| v as f64).collect(),
        }
    }
}

struct Model {
    variant: Variant,
    /// Per layer: input, post, then (Gemma) attn_out, mlp_out.
    norms: Vec<Vec<Norm>>,
    /// Per layer (Qwen3, Gemma): q_norm, k_norm.
    qk_norms: Vec<[Norm; 2]>,
    final_norm: Norm,
    weights: Vec<[Stored; 4]>,
    /// cos and sin per RoPE: base 10000, and (Gemma's local layers) base 10.
    tables: Vec<(Vec<u16>, Vec<u16>)>,
}

fn bf(v: f64) -> u16 {
    f32_to_bf16(v as f32)
}

fn model(seed: u64, variant: Variant) -> Model {
    let mut rng = Rng(seed);
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let gemma = variant == Variant::Gemma;
    let mut norms = Vec::new();
    let mut qk_norms = Vec::new();
    let mut weights = Vec::new();
    for l in 0..LAYERS {
        norms.push(
            (0..if gemma { 4 } else { 2 })
                .map(|_| Norm::new(&mut rng, HIDDEN, gemma))
                .collect(),
        );
        if variant != Variant::Llama {
            qk_norms.push([0, 1].map(|_| Norm::new(&mut rng, HEAD_DIM, gemma)));
        }
        // layer 1 int8, layer 0 int4: both kinds in one stack
        let int8 = l == 1;
        weights.push([
            Stored::new(&mut rng, q + 2 * kv, HIDDEN, int8),
            Stored::new(&mut rng, HIDDEN, q, int8),
            Stored::new(&mut rng, 2 * INTER, HIDDEN, int8),
            Stored::new(&mut rng, HIDDEN, INTER, int8),
        ]);
    }
    let final_norm = Norm::new(&mut rng, HIDDEN, gemma);
    let len = 32;
    let tables = [10000f64, 10.0]
        .iter()
        .map(|&base| {
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for p in 0..len {
                for j in 0..HEAD_DIM {
                    let freq = base.powf(-2.0 * (j % (HEAD_DIM / 2)) as f64 / HEAD_DIM as f64);
                    cos.push(bf((p as f64 * freq).cos()));
                    sin.push(bf((p as f64 * freq).sin()));
                }
            }
            (cos, sin)
        })
        .collect();
    Model {
        variant,
        norms,
        qk_norms,
        final_norm,
        weights,
        tables,
    }
}

fn dims(dense_min_rows: usize) -> Dims {
    Dims {
        hidden: HIDDEN,
        num_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        intermediate: INTER,
        eps: 1e-5,
        dense_min_rows,
    }
}

/// Layer `l`'s scores and RoPE table.
fn options(variant: Variant, l: usize) -> (Scores, usize) {
    let plain = Scores::scaled(1.0 / (HEAD_DIM as f32).sqrt());
    match (variant, l) {
        (Variant::Gemma, 0) => (
            Scores {
                scale: 0.2,
                window: Some(3),
                softcap: None,
            },
            1,
        ),
        (Variant::Gemma, _) => (
            Scores {
                scale: 0.2,
                window: None,
                softcap: Some(1.5),
            },
            0,
        ),
        _ => (plain, 0),
    }
}

fn layers(m: &Model) -> Vec<Layer<'_>> {
    (0..LAYERS)
        .map(|l| {
            let w = &m.weights[l];
            let norms = &m.norms[l];
            let (scores, rope_table) = options(m.variant, l);
            Layer {
                input_norm: norms[0].weight(),
                post_norm: norms[1].weight(),
                qk_norms: m.qk_norms.get(l).map(|n| [n[0].weight(), n[1].weight()]),
                out_norms: [
                    norms.get(2).map(Norm::weight),
                    norms.get(3).map(Norm::weight),
                ],
                qkv: w[0].weight(),
                o: w[1].weight(),
                gate_up: w[2].weight(),
                down: w[3].weight(),
                biases: [None; 4],
                activation: if m.variant == Variant::Gemma {
                    Activation::GeluTanh
                } else {
                    Activation::Silu
                },
                scores,
                rope_table,
            }
        })
        .collect()
}

fn shape() -> CacheShape {
    CacheShape {
        num_blocks: BLOCKS,
        block_size: BLOCK,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    }
}

/// One request per entry of `lens` (query rows, all of its tokens: no cached context), in
/// blocks 1, 2, … in order, plus `padding` rows; returns the final-normed output.
fn run(
    m: &Model,
    embedded: &[u16],
    lens: &[usize],
    padding: usize,
    dense_min_rows: usize,
) -> Vec<u16> {
    run_layers(m, &layers(m), embedded, lens, padding, dense_min_rows)
}

/// [`run`] with `layers` standing for the model's.
fn run_layers(
    m: &Model,
    layers: &[Layer],
    embedded: &[u16],
    lens: &[usize],
    padding: usize,
    dense_min_rows: usize,
) -> Vec<u16> {
    let rows: usize = lens.iter().sum::<usize>() + padding;
    let mut hidden = embedded[..rows * HIDDEN].to_vec();
    let mut out = vec![0u16; rows * HIDDEN];
    let mut caches: Vec<Vec<u16>> = (0..LAYERS)
        .map(|_| vec![0u16; 2 * BLOCKS * BLOCK * KV_HEADS * HEAD_DIM])
        .collect();
    let max_blocks = 3;
    let (mut qsl, mut seq_lens, mut tables, mut positions, mut slots) =
        (vec![0i32], vec![], vec![], vec![], vec![]);
    let mut next_block = 1;
    for &len in lens {
        qsl.push(qsl.last().unwrap() + len as i32);
        seq_lens.push(len as i32);
        let first = next_block;
        for b in 0..max_blocks {
            tables.push(if b < len.div_ceil(BLOCK) {
                first + b as i32
            } else {
                0
            });
        }
        next_block += len.div_ceil(BLOCK) as i32;
        for p in 0..len {
            positions.push(p as i64);
            slots.push(((first as usize + p / BLOCK) * BLOCK + p % BLOCK) as i64);
        }
    }
    positions.extend(std::iter::repeat_n(0, padding));
    slots.extend(std::iter::repeat_n(-1, padding));
    let reqs: Vec<i32> = (0..lens.len() as i32).collect();
    let mut cache_views: Vec<FloatsMut> = caches.iter_mut().map(|c| FloatsMut::Bf16(c)).collect();
    let rope_tables: Vec<RopeTable> = m
        .tables
        .iter()
        .map(|(cos, sin)| RopeTable { cos, sin })
        .collect();
    validate(&dims(dense_min_rows), layers, m.final_norm.weight()).unwrap();
    forward(
        &dims(dense_min_rows),
        layers,
        m.final_norm.weight(),
        &mut cache_views,
        &mut hidden,
        &mut out,
        Rope {
            positions: &positions,
            tables: &rope_tables,
        },
        Attention {
            slot_mapping: &slots,
            step: Step {
                query_start_loc: &qsl,
                seq_lens: &seq_lens,
                block_tables: &tables,
                max_blocks,
            },
            reqs: &reqs,
            num_rows: rows - padding,
            cache_shape: shape(),
        },
        &Pool::new(2),
        Kernels::best(),
    )
    .unwrap();
    out
}

fn rms_norm(x: &[f64], w: &Norm) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + 1e-5).sqrt();
    x.iter().zip(w.values()).map(|(v, w)| v * inv * w).collect()
}

fn matvec(d: &Dense, x: &[f64]) -> Vec<f64> {
    (0..d.n)
        .map(|c| {
            d.w[c * d.k..][..d.k]
                .iter()
                .zip(x)
                .map(|(w, x)| w * x)
                .sum()
        })
        .collect()
}

fn rotate(x: &mut [f64], p: usize, (cos, sin): &(Vec<u16>, Vec<u16>)) {
    let half = HEAD_DIM / 2;
    let (c, s) = (
        &cos[p * HEAD_DIM..][..HEAD_DIM],
        &sin[p * HEAD_DIM..][..HEAD_DIM],
    );
    for head in x.chunks_exact_mut(HEAD_DIM) {
        let old = head.to_vec();
        for i in 0..HEAD_DIM {
            let rot = if i < half {
                -old[i + half]
            } else {
                old[i - half]
            };
            head[i] = old[i] * bf16_to_f32(c[i]) as f64 + rot * bf16_to_f32(s[i]) as f64;
        }
    }
}

/// `x` rounded to bfloat16 where the stack stores a bfloat16 tensor.
fn r(x: Vec<f64>) -> Vec<f64> {
    x.into_iter().map(|v| bf16_to_f32(bf(v)) as f64).collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

/// One request of `len` tokens through the stack in float64, rounded to bfloat16 where the
/// stack stores its tensors (the stack's other roundings, e.g. RoPE's and RMSNorm's
/// intermediate ones, are left out).
fn reference(m: &Model, embedded: &[u16], len: usize) -> Vec<Vec<f64>> {
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut h: Vec<Vec<f64>> = (0..len)
        .map(|t| {
            embedded[t * HIDDEN..][..HIDDEN]
                .iter()
                .map(|&b| bf16_to_f32(b) as f64)
                .collect()
        })
        .collect();
    for l in 0..LAYERS {
        let w = &m.weights[l];
        let norms = &m.norms[l];
        let (scores, table) = options(m.variant, l);
        let qkv: Vec<Vec<f64>> = (0..len)
            .map(|t| {
                let mut v = r(matvec(w[0].dense(), &r(rms_norm(&h[t], &norms[0]))));
                if let Some([q_norm, k_norm]) = m.qk_norms.get(l) {
                    for (head, x) in v[..q + kv].chunks_exact_mut(HEAD_DIM).enumerate() {
                        let normed = rms_norm(x, if head < HEADS { q_norm } else { k_norm });
                        x.copy_from_slice(&r(normed));
                    }
                }
                rotate(&mut v[..q + kv], t, &m.tables[table]);
                r(v)
            })
            .collect();
        for t in 0..len {
            let mut a = vec![0f64; q];
            let first = scores.window.map_or(0, |w| (t + 1).saturating_sub(w));
            for head in 0..HEADS {
                let g = head / (HEADS / KV_HEADS);
                let qh = &qkv[t][head * HEAD_DIM..][..HEAD_DIM];
                let logits: Vec<f64> = (first..=t)
                    .map(|u| {
                        let kh = &qkv[u][q + g * HEAD_DIM..][..HEAD_DIM];
                        let s = qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>()
                            * scores.scale as f64;
                        scores
                            .softcap
                            .map_or(s, |c| c as f64 * (s / c as f64).tanh())
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = logits.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = p.iter().sum();
                for (j, pu) in p.iter().enumerate() {
                    let vh = &qkv[first + j][q + kv + g * HEAD_DIM..][..HEAD_DIM];
                    for d in 0..HEAD_DIM {
                        a[head * HEAD_DIM + d] += pu / total * vh[d];
                    }
                }
            }
            let mut o = r(matvec(w[1].dense(), &r(a)));
            if let Some(norm) = norms.get(2) {
                o = r(rms_norm(&o, norm));
            }
            h[t] = r(h[t].iter().zip(&o).map(|(h, o)| h + o).collect());
            let gu = r(matvec(w[2].dense(), &r(rms_norm(&h[t], &norms[1]))));
            let act = r((0..INTER)
                .map(|j| {
                    let gate = gu[j];
                    let activated = if m.variant == Variant::Gemma {
                        gelu_tanh(gate)
                    } else {
                        gate / (1.0 + (-gate).exp())
                    };
                    activated * gu[INTER + j]
                })
                .collect());
            let mut down = r(matvec(w[3].dense(), &act));
            if let Some(norm) = norms.get(3) {
                down = r(rms_norm(&down, norm));
            }
            h[t] = r(h[t].iter().zip(&down).map(|(h, d)| h + d).collect());
        }
    }
    h.iter().map(|x| rms_norm(x, &m.final_norm)).collect()
}

fn embedded(rows: usize, seed: u64) -> Vec<u16> {
    let mut rng = Rng(seed);
    (0..rows * HIDDEN)
        .map(|_| bf(rng.uniform() as f64))
        .collect()
}

#[test]
fn matches_a_float64_reference_on_both_linear_paths_with_every_layer_option() {
    let x = embedded(6, 11);
    // 100: every linear on the integer GEMV (activations rounded to int8); 1: every linear on
    // the bf16 GEMM. Bound: a row's relative L2 error after two layers of bfloat16 (and int8)
    // roundings; a wrong head, position, window, norm or residual gives errors of order 1.
    for variant in [Variant::Llama, Variant::Qwen3, Variant::Gemma] {
        let m = model(7, variant);
        let want = reference(&m, &x, 6);
        for (dense_min_rows, bound) in [(100, 0.05), (1, 0.05)] {
            let got = run(&m, &x, &[6], 0, dense_min_rows);
            for (t, row) in want.iter().enumerate() {
                let got = &got[t * HIDDEN..][..HIDDEN];
                let err: f64 = row
                    .iter()
                    .zip(got)
                    .map(|(v, &g)| (bf16_to_f32(g) as f64 - v).powi(2))
                    .sum();
                let norm: f64 = row.iter().map(|v| v * v).sum();
                let rel = (err / norm).sqrt();
                assert!(
                    rel <= bound,
                    "{variant:?} dense_min_rows {dense_min_rows}: row {t}: relative L2 error {rel:.4} > {bound}"
                );
            }
        }
    }
}

/// An edit of a layer's options.
type LayerChange = fn(&mut Layer);

#[test]
fn each_gemma_option_changes_the_result() {
    // the reference test's bound must not be loose enough to pass a stack ignoring an option
    let x = embedded(6, 11);
    let m = model(7, Variant::Gemma);
    let full = run(&m, &x, &[6], 0, 100);
    let changes: [(&str, LayerChange); 6] = [
        ("window", |l| l.scores.window = None),
        ("softcap", |l| l.scores.softcap = None),
        ("rope table", |l| l.rope_table = 0),
        ("qk norms", |l| l.qk_norms = None),
        ("out norms", |l| l.out_norms = [None; 2]),
        ("activation", |l| l.activation = Activation::Silu),
    ];
    for (name, change) in changes {
        let mut ls = layers(&m);
        ls.iter_mut().for_each(change);
        let out = run_layers(&m, &ls, &x, &[6], 0, 100);
        assert_ne!(out, full, "without {name} the output is the same");
    }
}

#[test]
fn a_request_gets_the_same_bits_whatever_shares_its_step() {
    for variant in [Variant::Llama, Variant::Gemma] {
        let m = model(3, variant);
        let x = embedded(8, 5);
        // request A (3 rows) alone, then with request B (4 rows) and a padding row after it
        let alone = run(&m, &x, &[3], 0, 16);
        let shared = run(&m, &x, &[3, 4], 1, 16);
        assert_eq!(alone[..], shared[..3 * HIDDEN], "{variant:?}");
        // B's rows are its own: B alone (its rows first) gives them too
        let b_alone = run(&m, &x[3 * HIDDEN..], &[4], 0, 16);
        assert_eq!(b_alone[..], shared[3 * HIDDEN..7 * HIDDEN], "{variant:?}");
    }
}

#[test]
fn validate_names_the_layer_and_part_of_a_bad_shape_or_option() {
    let m = model(1, Variant::Gemma);
    let fin = m.final_norm.weight();
    let mut ls = layers(&m);
    ls[1].o = ls[1].down;
    let err = validate(&dims(16), &ls, fin).unwrap_err();
    assert!(err.contains("layer 1: o"), "{err}");
    let short = NormWeight::Bf16(&[0u16; 8]);
    let err = validate(&dims(16), &layers(&m), short).unwrap_err();
    assert!(err.contains("final norm"), "{err}");
    let mut ls = layers(&m);
    ls[0].biases[0] = Some(&[0u16; HIDDEN]); // [hidden], q/k/v has more outputs
    let err = validate(&dims(16), &ls, fin).unwrap_err();
    assert!(err.contains("layer 0: qkv's bias"), "{err}");
    let mut ls = layers(&m);
    ls[1].qk_norms.as_mut().unwrap()[1] = m.norms[0][0].weight(); // [hidden], not [head_dim]
    let err = validate(&dims(16), &ls, fin).unwrap_err();
    assert!(err.contains("layer 1: k_norm"), "{err}");
    let mut ls = layers(&m);
    ls[0].out_norms[1] = Some(short);
    let err = validate(&dims(16), &ls, fin).unwrap_err();
    assert!(err.contains("layer 0: mlp_out_norm"), "{err}");
    let mut ls = layers(&m);
    ls[1].scores.window = Some(0);
    let err = validate(&dims(16), &ls, fin).unwrap_err();
    assert!(err.contains("layer 1: sliding window"), "{err}");
    // sizes whose products would wrap (heads x head_dim = 2^64 ≡ 0) are refused before use
    let huge = Dims {
        num_heads: 1 << 62,
        num_kv_heads: 1 << 62,
        head_dim: 4,
        ..dims(16)
    };
    assert!(validate(&huge, &layers(&m), fin)
        .unwrap_err()
        .contains("bad dims"));
}

#[test]
fn a_step_without_rows_does_nothing() {
    let m = model(2, Variant::Llama);
    assert!(run(&m, &[], &[], 0, 16).is_empty());
}
