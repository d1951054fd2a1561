//! Causal attention over a paged KV cache, and the cache write that precedes it.
//!
//! Layouts (row-major): queries and outputs `[T, H, D]`, this step's keys and values
//! `[T, H_kv, D]`, the cache `[2, num_blocks, block_size, H_kv, D]` (0: keys, 1: values).
//! Request `i` owns query rows `query_start_loc[i]..query_start_loc[i + 1]`; its token `t`
//! sits in block `block_tables[i, t / block_size]` at offset `t % block_size`; its query row
//! `j` is at position `seq_lens[i] − query_len + j` and attends to keys `0..=position`, or
//! with a sliding window `W` to those in `(position − W, position]` (transformers' and vLLM's
//! definition: `W` keys, its own included). A key's score is `s = scale · q·k`, or with
//! Gemma 2's logit soft-capping `cap · tanh(s / cap)`, before the softmax ([`Scores`]).
//! Query head `h` reads KV head `h / (H / H_kv)` (grouped-query attention).
//!
//! Method: one task per (request, KV head, tile of query rows), all query heads of the
//! group together, so a key block is widened to float32 once for all of them. Each row
//! runs an online softmax over the cache's blocks in order (float32 scores and sums), and
//! what it computes depends only on its own position and the cache, never on the tile, the
//! task split or the other requests of the step: a request's numbers are the same whether
//! it decodes alone, verifies drafts, or shares the step with a prefill.
//!
//! SIMD: the inner loops are written lane-wise (16 float32 accumulators, no reassociation)
//! and compiled twice, once with AVX-512 enabled, chosen at run time; both give the same
//! bits.

use crate::pool::Pool;

/// A read-only float tensor: float32, or bfloat16 as its bits.
#[derive(Clone, Copy)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// A writable float tensor.
pub enum FloatsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl Floats<'_> {
    pub fn len(&self) -> usize {
        match self {
            Floats::F32(v) => v.len(),
            Floats::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FloatsMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            FloatsMut::F32(v) => v.len(),
            FloatsMut::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The shape of one layer's paged cache.
#[derive(Clone, Copy, Debug)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    fn numel(&self) -> usize {
        2 * self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Element offset of (kv = 0 keys / 1 values, slot, kv head).
    fn offset(&self, kv: usize, slot: usize, kv_head: usize) -> usize {
        ((kv * self.num_blocks * self.block_size + slot) * self.num_kv_heads + kv_head)
            * self.head_dim
    }
}

/// The step's per-request metadata (`fastsched.attention.base.AttentionMetadata`).
#[derive(Clone, Copy)]
pub struct Step<'a> {
    pub query_start_loc: &'a [i32],
    pub seq_lens: &'a [i32],
    /// `[B, max_blocks]`.
    pub block_tables: &'a [i32],
    pub max_blocks: usize,
}

/// How a layer scores a query against its keys (besides the causal mask).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    /// Multiplies `q·k` (usually `head_dim^-0.5`).
    pub scale: f32,
    /// Logit soft-capping: `cap · tanh(s / cap)` (None: off).
    pub softcap: Option<f32>,
    /// Sliding window: a query at position `p` attends the keys in `(p − window, p]` (None:
    /// all keys up to `p`).
    pub window: Option<usize>,
}

impl Scores {
    /// Plain causal attention scaled by `scale`.
    pub fn scaled(scale: f32) -> Scores {
        Scores {
            scale,
            softcap: None,
            window: None,
        }
    }

    /// Fails naming a window of 0 or a cap that is not positive and finite.
    pub fn validate(&self) -> Result<(), String> {
        if self.window == Some(0) {
            return Err("sliding window must be at least 1, got 0".to_string());
        }
        if let Some(cap) = self.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(format!("softcap must be positive and finite, got {cap}"));
        }
        Ok(())
    }

    /// The first position a query at `pos` attends.
    #[inline(always)]
    fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Which inner loops run: the AVX-512 build or the portable one (same arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx512,
}

/// The fastest build this CPU supports, detected at run time.
pub fn best_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
    }
    Isa::Scalar
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest even, as torch's `.to(torch.bfloat16)`.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Writes this step's keys and values `[T, H_kv, D]` (`stride` elements from one row to the
/// next) at `slot_mapping` (one slot a row, negative: a padding row, not written),
/// converted to the cache's dtype.
pub fn write_cache(
    key: Floats,
    value: Floats,
    stride: usize,
    slot_mapping: &[i64],
    cache: &mut FloatsMut,
    shape: CacheShape,
) -> Result<(), String> {
    let row = shape.num_kv_heads * shape.head_dim;
    let slots = shape.num_blocks * shape.block_size;
    let t = slot_mapping.len();
    let need = if t == 0 { 0 } else { (t - 1) * stride + row };
    if key.len() < need || value.len() < need || (t > 1 && stride < row) {
        return Err(format!(
            "key has {} and value {} elements, {t} rows of [{}, {}] {stride} apart need {need}",
            key.len(),
            value.len(),
            shape.num_kv_heads,
            shape.head_dim,
        ));
    }
    if cache.len() != shape.numel() {
        return Err(format!(
            "kv_cache has {} elements, {shape:?} needs {}",
            cache.len(),
            shape.numel()
        ));
    }
    if let Some(s) = slot_mapping.iter().find(|&&s| s >= slots as i64) {
        return Err(format!(
            "slot_mapping holds {s}, the cache has {slots} slots"
        ));
    }
    for (i, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        for (kv, src) in [key, value].into_iter().enumerate() {
            let dst = shape.offset(kv, slot as usize, 0);
            copy_row(src, i * stride, cache, dst, row);
        }
    }
    Ok(())
}

fn copy_row(src: Floats, from: usize, dst: &mut FloatsMut, to: usize, n: usize) {
    match (src, dst) {
        (Floats::F32(s), FloatsMut::F32(d)) => d[to..to + n].copy_from_slice(&s[from..from + n]),
        (Floats::Bf16(s), FloatsMut::Bf16(d)) => d[to..to + n].copy_from_slice(&s[from..from + n]),
        (Floats::F32(s), FloatsMut::Bf16(d)) => {
            for (d, &s) in d[to..to + n].iter_mut().zip(&s[from..from + n]) {
                *d = f32_to_bf16(s);
            }
        }
        (Floats::Bf16(s), FloatsMut::F32(d)) => {
            for (d, &s) in d[to..to + n].iter_mut().zip(&s[from..from + n]) {
                *d = bf16_to_f32(s);
            }
        }
    }
}

/// Query rows a task takes at most (a prefill chunk is split into tiles of this many).
const TILE_ROWS: usize = 16;
/// Below this many multiply-adds a call runs on the calling thread alone.
const MIN_PARALLEL_WORK: usize = 1 << 17;

/// One task: query rows `rows` of request `req`, all query heads of KV head `kv_head`.
struct Task {
    req: usize,
    kv_head: usize,
    rows: std::ops::Range<usize>,
}

/// What every task reads.
struct Ctx<'a> {
    query: Floats<'a>,
    q_stride: usize,
    cache: Floats<'a>,
    shape: CacheShape,
    step: Step<'a>,
    num_heads: usize,
    scores: Scores,
    out: OutPtr,
}

/// The output shared by the tasks of one call; each writes its own rows and heads.
#[derive(Clone, Copy)]
enum OutPtr {
    F32(*mut f32),
    Bf16(*mut u16),
}
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Attention for the requests `reqs` of the step (indices into its rows of metadata):
/// writes their query rows of `out` (`[T, H, D]`, query's dtype), leaves the others. Query
/// row `t` starts at element `t · q_stride` (heads and dims contiguous within a row).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    query: Floats,
    q_stride: usize,
    out: &mut FloatsMut,
    num_heads: usize,
    cache: Floats,
    shape: CacheShape,
    step: Step,
    reqs: &[i32],
    scores: Scores,
    pool: &Pool,
    isa: Isa,
) -> Result<(), String> {
    scores.validate()?;
    let CacheShape {
        block_size,
        num_kv_heads,
        head_dim,
        ..
    } = shape;
    if num_kv_heads == 0
        || head_dim == 0
        || block_size == 0
        || !num_heads.is_multiple_of(num_kv_heads)
    {
        return Err(format!(
            "num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (both > 0)"
        ));
    }
    if cache.len() != shape.numel() {
        return Err(format!(
            "kv_cache has {} elements, {shape:?} needs {}",
            cache.len(),
            shape.numel()
        ));
    }
    let row = num_heads * head_dim;
    let tokens = out.len() / row;
    let need = if tokens == 0 {
        0
    } else {
        (tokens - 1) * q_stride + row
    };
    if out.len() != tokens * row || query.len() < need || (tokens > 1 && q_stride < row) {
        return Err(format!(
            "query has {} elements ({q_stride} a row) and out {}, not [T, {num_heads}, {head_dim}] alike",
            query.len(),
            out.len()
        ));
    }
    let b = step.seq_lens.len();
    if step.query_start_loc.len() != b + 1 || step.block_tables.len() != b * step.max_blocks {
        return Err(format!(
            "query_start_loc has {} and block_tables {} elements, {b} requests need {} and {b} x {}",
            step.query_start_loc.len(),
            step.block_tables.len(),
            b + 1,
            step.max_blocks
        ));
    }
    let mut tasks = Vec::new();
    let mut work = 0usize;
    for &r in reqs {
        let req = usize::try_from(r)
            .ok()
            .filter(|&r| r < b)
            .ok_or(format!("reqs holds {r}, the step has {b} requests"))?;
        let (start, end) = (step.query_start_loc[req], step.query_start_loc[req + 1]);
        let seq_len = step.seq_lens[req];
        if start < 0 || end < start || end as usize > tokens || seq_len < end - start {
            return Err(format!(
                "request {req}: query rows {start}..{end} and seq_len {seq_len} do not fit {tokens} rows"
            ));
        }
        let used = (seq_len as usize).div_ceil(block_size);
        if used > step.max_blocks {
            return Err(format!(
                "request {req}: seq_len {seq_len} needs {used} blocks, block_tables has {}",
                step.max_blocks
            ));
        }
        let table = &step.block_tables[req * step.max_blocks..][..used];
        if let Some(&bad) = table
            .iter()
            .find(|&&blk| blk < 0 || blk as usize >= shape.num_blocks)
        {
            return Err(format!(
                "request {req}: block_tables holds {bad}, the cache has {} blocks",
                shape.num_blocks
            ));
        }
        let (start, end) = (start as usize, end as usize);
        work += (end - start) * num_heads * head_dim * seq_len as usize;
        for kv_head in 0..num_kv_heads {
            for lo in (start..end).step_by(TILE_ROWS) {
                tasks.push(Task {
                    req,
                    kv_head,
                    rows: lo..(lo + TILE_ROWS).min(end),
                });
            }
        }
    }
    crate::checks::check_distinct_rows(reqs, step.query_start_loc)?; // the tasks write `out` unlocked
    let ctx = Ctx {
        query,
        q_stride,
        cache,
        shape,
        step,
        num_heads,
        scores,
        out: match out {
            FloatsMut::F32(v) => OutPtr::F32(v.as_mut_ptr()),
            FloatsMut::Bf16(v) => OutPtr::Bf16(v.as_mut_ptr()),
        },
    };
    let run = |i: usize| {
        // SAFETY: the tasks' (row, head) ranges of `out` are disjoint; it lives for the call.
        unsafe { run_task(&ctx, &tasks[i], isa) }
    };
    if work < MIN_PARALLEL_WORK || tasks.len() < 2 {
        (0..tasks.len()).for_each(run);
    } else {
        pool.run(tasks.len(), &run);
    }
    Ok(())
}

unsafe fn run_task(ctx: &Ctx, task: &Task, isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::task(ctx, task),
        _ => task_body(ctx, task),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn task(ctx: &Ctx, task: &Task) {
        task_body(ctx, task)
    }
}

const LANES: usize = 16;

#[inline(always)]
fn load(src: Floats, from: usize, dst: &mut [f32]) {
    let n = dst.len();
    match src {
        Floats::F32(s) => dst.copy_from_slice(&s[from..from + n]),
        Floats::Bf16(s) => {
            for (d, &s) in dst.iter_mut().zip(&s[from..from + n]) {
                *d = bf16_to_f32(s);
            }
        }
    }
}

/// `Σ a·b` with 16 lane sums added in a fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut half = LANES / 2;
    while half > 0 {
        for l in 0..half {
            acc[l] += acc[l + half];
        }
        half /= 2;
    }
    acc[0] + tail
}

/// A key's score from its dot product with the query ([`Scores`]).
#[inline(always)]
fn score(dot: f32, s: Scores) -> f32 {
    let x = dot * s.scale;
    match s.softcap {
        Some(cap) => cap * (x / cap).tanh(),
        None => x,
    }
}

#[inline(always)]
fn scale_in_place(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

#[inline(always)]
fn axpy(acc: &mut [f32], p: f32, v: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(v) {
        *a += p * v;
    }
}

#[inline(always)]
unsafe fn task_body(ctx: &Ctx, task: &Task) {
    let CacheShape {
        block_size: bs,
        head_dim: d,
        ..
    } = ctx.shape;
    let group = ctx.num_heads / ctx.shape.num_kv_heads;
    let step = &ctx.step;
    let (req, kv_head) = (task.req, task.kv_head);
    let q_start = step.query_start_loc[req] as usize;
    let q_len = step.query_start_loc[req + 1] as usize - q_start;
    let context = step.seq_lens[req] as usize - q_len;
    let rows = task.rows.len();
    let n = rows * group;
    // Row r of the tile is at position first_pos + r.
    let first_pos = context + task.rows.start - q_start;
    let last_pos = first_pos + rows - 1;
    let mut q = vec![0f32; n * d];
    for r in 0..rows {
        for g in 0..group {
            let head = kv_head * group + g;
            load(
                ctx.query,
                (task.rows.start + r) * ctx.q_stride + head * d,
                &mut q[(r * group + g) * d..][..d],
            );
        }
    }
    let mut acc = vec![0f32; n * d];
    let mut max = vec![f32::NEG_INFINITY; n];
    let mut sum = vec![0f32; n];
    let mut keys = vec![0f32; bs * d];
    let mut values = vec![0f32; bs * d];
    let mut scores = vec![0f32; bs];
    let table = &step.block_tables[req * step.max_blocks..];
    let first_blk = ctx.scores.first_key(first_pos) / bs;
    for (blk, &block) in table
        .iter()
        .enumerate()
        .take(last_pos / bs + 1)
        .skip(first_blk)
    {
        let t0 = blk * bs;
        let nk = bs.min(last_pos + 1 - t0);
        let block = block as usize;
        for o in 0..nk {
            let slot = block * bs + o;
            load(
                ctx.cache,
                ctx.shape.offset(0, slot, kv_head),
                &mut keys[o * d..][..d],
            );
            load(
                ctx.cache,
                ctx.shape.offset(1, slot, kv_head),
                &mut values[o * d..][..d],
            );
        }
        for r in 0..rows {
            let pos = first_pos + r;
            // this row's keys within the block: offsets begin..end
            let begin = ctx.scores.first_key(pos).saturating_sub(t0);
            let end = nk.min((pos + 1).saturating_sub(t0));
            if begin >= end {
                continue;
            }
            for g in 0..group {
                let i = r * group + g;
                let qi = &q[i * d..][..d];
                let mut block_max = f32::NEG_INFINITY;
                for t in begin..end {
                    let s = score(dot(qi, &keys[t * d..][..d]), ctx.scores);
                    scores[t] = s;
                    block_max = block_max.max(s);
                }
                let acc_i = &mut acc[i * d..][..d];
                if block_max > max[i] {
                    let correction = (max[i] - block_max).exp();
                    sum[i] *= correction;
                    scale_in_place(acc_i, correction);
                    max[i] = block_max;
                }
                for t in begin..end {
                    let p = (scores[t] - max[i]).exp();
                    sum[i] += p;
                    axpy(acc_i, p, &values[t * d..][..d]);
                }
            }
        }
    }
    for r in 0..rows {
        for g in 0..group {
            let i = r * group + g;
            let inv = 1.0 / sum[i];
            let at = ((task.rows.start + r) * ctx.num_heads + kv_head * group + g) * d;
            let acc_i = &acc[i * d..][..d];
            match ctx.out {
                OutPtr::F32(p) => {
                    let dst = std::slice::from_raw_parts_mut(p.add(at), d);
                    for (o, &a) in dst.iter_mut().zip(acc_i) {
                        *o = a * inv;
                    }
                }
                OutPtr::Bf16(p) => {
                    let dst = std::slice::from_raw_parts_mut(p.add(at), d);
                    for (o, &a) in dst.iter_mut().zip(acc_i) {
                        *o = f32_to_bf16(a * inv);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
