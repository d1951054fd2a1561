use super::*;

/// A small deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A step with a filled cache: `(query_len, seq_len)` per request, blocks handed out
/// shuffled so requests' blocks interleave.
struct Case {
    shape: CacheShape,
    num_heads: usize,
    cache: Vec<f32>,
    query: Vec<f32>,
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    tables: Vec<i32>,
    max_blocks: usize,
}

fn case(
    reqs: &[(usize, usize)],
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    seed: u64,
) -> Case {
    let block_size = 4;
    let max_blocks = reqs.iter().map(|r| r.1.div_ceil(block_size)).max().unwrap();
    let num_blocks = reqs.len() * max_blocks + 3;
    let shape = CacheShape {
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
    };
    let mut rng = Rng(seed);
    let cache = rng.vec(shape.numel());
    let mut order: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..order.len()).rev() {
        let j = ((rng.next() + 1.0) * 0.5 * (i + 1) as f32) as usize % (i + 1);
        order.swap(i, j);
    }
    let tables = (0..reqs.len() * max_blocks).map(|i| order[i]).collect();
    let mut qsl = vec![0i32];
    for r in reqs {
        qsl.push(qsl.last().unwrap() + r.0 as i32);
    }
    let rows = *qsl.last().unwrap() as usize;
    Case {
        shape,
        num_heads,
        cache,
        query: rng.vec(rows * num_heads * head_dim),
        qsl,
        seq_lens: reqs.iter().map(|r| r.1 as i32).collect(),
        tables,
        max_blocks,
    }
}

impl Case {
    fn step(&self) -> Step<'_> {
        Step {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_tables: &self.tables,
            max_blocks: self.max_blocks,
        }
    }

    fn run(&self, reqs: &[i32], isa: Isa, pool: &Pool) -> Vec<f32> {
        self.run_scored(reqs, isa, pool, Scores::scaled(0.125))
    }

    fn run_scored(&self, reqs: &[i32], isa: Isa, pool: &Pool, scores: Scores) -> Vec<f32> {
        let mut out = vec![0f32; self.query.len()];
        paged_attention(
            Floats::F32(&self.query),
            self.num_heads * self.shape.head_dim,
            &mut FloatsMut::F32(&mut out),
            self.num_heads,
            Floats::F32(&self.cache),
            self.shape,
            self.step(),
            reqs,
            scores,
            pool,
            isa,
        )
        .unwrap();
        out
    }

    fn reference(&self) -> Vec<f32> {
        self.reference_scored(Scores::scaled(0.125))
    }

    /// Two-pass softmax in float64, straight from the contract (module docs).
    fn reference_scored(&self, scores: Scores) -> Vec<f32> {
        let CacheShape {
            block_size,
            num_kv_heads,
            head_dim: d,
            ..
        } = self.shape;
        let group = self.num_heads / num_kv_heads;
        let mut out = vec![0f32; self.query.len()];
        for req in 0..self.seq_lens.len() {
            let (start, end) = (self.qsl[req] as usize, self.qsl[req + 1] as usize);
            let seq_len = self.seq_lens[req] as usize;
            for row in start..end {
                let pos = seq_len - (end - start) + row - start;
                for h in 0..self.num_heads {
                    let q = &self.query[(row * self.num_heads + h) * d..][..d];
                    let slot = |t: usize| {
                        self.tables[req * self.max_blocks + t / block_size] as usize * block_size
                            + t % block_size
                    };
                    let key = |kv, t| &self.cache[self.shape.offset(kv, slot(t), h / group)..][..d];
                    // keys first..=pos: the window's W keys, or all
                    let first = scores.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let s: Vec<f64> = (first..=pos)
                        .map(|t| {
                            let s = q
                                .iter()
                                .zip(key(0, t))
                                .map(|(a, b)| (*a as f64) * (*b as f64))
                                .sum::<f64>()
                                * scores.scale as f64;
                            scores
                                .softcap
                                .map_or(s, |c| c as f64 * (s / c as f64).tanh())
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let p: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = p.iter().sum();
                    for (i, o) in out[(row * self.num_heads + h) * d..][..d]
                        .iter_mut()
                        .enumerate()
                    {
                        *o = ((first..=pos)
                            .map(|t| p[t - first] * key(1, t)[i] as f64)
                            .sum::<f64>()
                            / z) as f32;
                    }
                }
            }
        }
        out
    }
}

const MIXED: &[(usize, usize)] = &[(1, 9), (3, 11), (1, 1), (20, 20), (7, 30), (1, 4), (5, 8)];

#[test]
fn matches_the_reference_on_mixed_decode_verify_and_prefill_rows() {
    let pool = Pool::new(2);
    for (heads, kv_heads, d) in [(4, 2, 32), (6, 3, 20), (2, 2, 16)] {
        let c = case(MIXED, heads, kv_heads, d, 7);
        let all: Vec<i32> = (0..MIXED.len() as i32).collect();
        let want = c.reference();
        for isa in [Isa::Scalar, best_isa()] {
            let got = c.run(&all, isa, &pool);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-5,
                    "heads {heads}/{kv_heads} d {d} {isa:?}: element {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn a_sliding_window_and_a_softcap_match_the_reference() {
    // windows shorter than a block, a block exactly, across blocks; chunks starting inside
    // and before the window; a cap small enough to bend the scores (|s| up to ~2 here)
    let pool = Pool::new(2);
    let c = case(MIXED, 4, 2, 32, 17);
    let all: Vec<i32> = (0..MIXED.len() as i32).collect();
    for (window, softcap) in [
        (Some(1), None),
        (Some(3), None),
        (Some(4), Some(0.8)),
        (Some(9), None),
        (None, Some(0.5)),
        (Some(100), Some(2.0)),
    ] {
        let scores = Scores {
            scale: 0.125,
            softcap,
            window,
        };
        let want = c.reference_scored(scores);
        for isa in [Isa::Scalar, best_isa()] {
            let got = c.run_scored(&all, isa, &pool, scores);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-5,
                    "window {window:?} softcap {softcap:?} {isa:?}: element {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn a_window_covering_the_sequence_gives_plain_causal_bits() {
    let c = case(MIXED, 4, 2, 32, 19);
    let all: Vec<i32> = (0..MIXED.len() as i32).collect();
    let windowed = Scores {
        window: Some(30),
        ..Scores::scaled(0.125)
    };
    let pool = Pool::new(1);
    assert_eq!(
        c.run(&all, best_isa(), &pool),
        c.run_scored(&all, best_isa(), &pool, windowed)
    );
}

#[test]
fn rejects_a_zero_window_and_a_bad_cap() {
    let c = case(&[(1, 5)], 2, 1, 16, 1);
    for (scores, what) in [
        (
            Scores {
                window: Some(0),
                ..Scores::scaled(0.125)
            },
            "window",
        ),
        (
            Scores {
                softcap: Some(0.0),
                ..Scores::scaled(0.125)
            },
            "softcap",
        ),
    ] {
        let mut out = vec![0f32; c.query.len()];
        let err = paged_attention(
            Floats::F32(&c.query),
            2 * 16,
            &mut FloatsMut::F32(&mut out),
            2,
            Floats::F32(&c.cache),
            c.shape,
            c.step(),
            &[0],
            scores,
            &Pool::new(1),
            Isa::Scalar,
        )
        .unwrap_err();
        assert!(err.contains(what), "{err}");
    }
}

#[test]
fn simd_and_scalar_builds_give_the_same_bits() {
    let pool = Pool::new(1);
    let c = case(MIXED, 9, 3, 64, 3);
    let all: Vec<i32> = (0..MIXED.len() as i32).collect();
    assert_eq!(
        c.run(&all, Isa::Scalar, &pool),
        c.run(&all, best_isa(), &pool)
    );
}

#[test]
fn a_request_gets_the_same_bits_whatever_shares_the_step() {
    // Request 4 (7 rows after 23 cached tokens) alone, with the others, and across threads.
    let c = case(MIXED, 4, 2, 32, 11);
    let d = 4 * 32;
    let rows = c.qsl[4] as usize * d..c.qsl[5] as usize * d;
    let alone = c.run(&[4], best_isa(), &Pool::new(1));
    let all: Vec<i32> = (0..MIXED.len() as i32).collect();
    let shared = c.run(&all, best_isa(), &Pool::new(3));
    assert_eq!(alone[rows.clone()], shared[rows]);
}

#[test]
fn a_verification_row_equals_the_decode_at_its_position() {
    // Same cache, same tables: request 0 verifies 3 tokens ending at 12, request 1 decodes
    // at position 10 (the middle one).
    let mut c = case(&[(3, 12), (1, 11)], 4, 1, 16, 5);
    c.tables.copy_within(0..c.max_blocks, c.max_blocks);
    let d = 4 * 16;
    let q = c.query[d..2 * d].to_vec();
    c.query[3 * d..4 * d].copy_from_slice(&q);
    let out = c.run(&[0, 1], best_isa(), &Pool::new(1));
    assert_eq!(out[d..2 * d], out[3 * d..4 * d]);
}

#[test]
fn bf16_cache_and_query_stay_close_to_float32() {
    let c = case(MIXED, 4, 2, 32, 13);
    let round = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<u16>>();
    let (q, cache) = (round(&c.query), round(&c.cache));
    let mut out = vec![0u16; q.len()];
    let all: Vec<i32> = (0..MIXED.len() as i32).collect();
    paged_attention(
        Floats::Bf16(&q),
        4 * 32,
        &mut FloatsMut::Bf16(&mut out),
        4,
        Floats::Bf16(&cache),
        c.shape,
        c.step(),
        &all,
        Scores::scaled(0.125),
        &Pool::new(1),
        best_isa(),
    )
    .unwrap();
    for (a, b) in out.iter().zip(c.reference()) {
        assert!(
            (bf16_to_f32(*a) - b).abs() < 2e-2,
            "{} vs {b}",
            bf16_to_f32(*a)
        );
    }
}

#[test]
fn rejects_a_block_id_outside_the_cache() {
    let mut c = case(&[(1, 5)], 2, 1, 16, 1);
    c.tables[1] = c.shape.num_blocks as i32;
    let mut out = vec![0f32; c.query.len()];
    let err = paged_attention(
        Floats::F32(&c.query),
        2 * 16,
        &mut FloatsMut::F32(&mut out),
        2,
        Floats::F32(&c.cache),
        c.shape,
        c.step(),
        &[0],
        Scores::scaled(0.125),
        &Pool::new(1),
        Isa::Scalar,
    )
    .unwrap_err();
    assert!(err.contains("block_tables"), "{err}");
}

#[test]
fn write_cache_skips_padding_slots_and_rounds_to_bf16() {
    let shape = CacheShape {
        num_blocks: 2,
        block_size: 2,
        num_kv_heads: 1,
        head_dim: 2,
    };
    let mut cache = vec![0u16; shape.numel()];
    let key = [1.0f32, 2.0, 3.0, 4.0, 1.0 + 1.0 / 256.0, 6.0];
    let value = [-1.0f32, -2.0, -3.0, -4.0, -5.0, -6.0];
    write_cache(
        Floats::F32(&key),
        Floats::F32(&value),
        2,
        &[3, -1, 0],
        &mut FloatsMut::Bf16(&mut cache),
        shape,
    )
    .unwrap();
    let got: Vec<f32> = cache.iter().map(|&b| bf16_to_f32(b)).collect();
    // 1 + 2^-8 is a tie between bf16 neighbours 1 and 1 + 2^-7: rounds to even (1).
    assert_eq!(
        got,
        [1.0, 6.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, -5.0, -6.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]
    );
    let err = write_cache(
        Floats::F32(&key),
        Floats::F32(&value),
        2,
        &[4, 0, 1],
        &mut FloatsMut::Bf16(&mut cache),
        shape,
    )
    .unwrap_err();
    assert!(err.contains("slot_mapping"), "{err}");
}

#[test]
fn rejects_a_request_listed_twice() {
    // two tasks of one request would write its rows of `out` at the same time
    let c = case(&[(2, 5), (1, 3)], 2, 1, 16, 1);
    let mut out = vec![0f32; c.query.len()];
    let err = paged_attention(
        Floats::F32(&c.query),
        2 * 16,
        &mut FloatsMut::F32(&mut out),
        2,
        Floats::F32(&c.cache),
        c.shape,
        c.step(),
        &[1, 0, 1],
        Scores::scaled(0.125),
        &Pool::new(1),
        Isa::Scalar,
    )
    .unwrap_err();
    assert!(err.contains("twice"), "{err}");
}
