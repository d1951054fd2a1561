//! A Llama-family decoder stack in one call: every layer of a step, bfloat16 activations,
//! weight-only int4 / int8 linears, the paged KV cache, and the final norm.
//!
//! Why: at one decode token a layer is ~15 kernel calls of 2–70 µs each, and driving them
//! from Python (argument checks, tensor allocations, the float32 → bfloat16 casts between
//! them) cost about as much again as the kernels themselves (bench/RESULTS.md, "CPU decode:
//! one call for the decoder stack"). Here the calls follow each other in Rust, reusing the
//! step's buffers, with the thread pool's workers kept hot between them.
//!
//! Numerics: the same kernels, in the same order, rounding where the Python layer rounds
//! (`fastsched.models.llama.DecoderLayer.forward_cpu_bf16`), so the result is bit-equal to
//! the layer-by-layer path:
//!
//! ```text
//! for each layer:                       (δ = None for the first)
//!     x   = add_rms_norm(h += δ, input_norm)
//!     qkv = bf16(x · Wqkvᵀ);  rope on q's and k's heads
//!     cache[slots] = k, v;   a = attention(q, cache)   (padding rows: 0)
//!     x   = add_rms_norm(h += bf16(a · Woᵀ), post_norm)
//!     δ   = bf16(silu_mul(bf16(x · Wgate_upᵀ)) · Wdownᵀ)
//! out = add_rms_norm(h += δ, final_norm)
//! ```
//!
//! A linear layer takes the integer GEMV ([`quant::matmul`]) below `dense_min_rows` rows and
//! the many-row bf16 GEMM ([`quant::gemm::gemm_bf16`]) from there on, as the Python path does.

use crate::attention::{self, bf16_to_f32, f32_to_bf16, CacheShape, Floats, FloatsMut, Isa, Step};
use crate::elementwise;
use crate::pool::Pool;
use crate::quant::{self, gemm, Act, Kernel, Weight};

/// The model's sizes (one tensor-parallel rank: the whole model).
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub eps: f32,
    /// Activation rows from which a linear layer runs the many-row GEMM.
    pub dense_min_rows: usize,
}

impl Dims {
    fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// One decoder layer's weights: RMSNorm weights (bfloat16 `[hidden]`) and the fused
/// projections, q/k/v `[q + 2·kv, hidden]`, o `[hidden, q]`, gate/up `[2·I, hidden]` (gate
/// first), down `[hidden, I]`, each with an optional bfloat16 bias `[N]` (Qwen2's q/k/v).
#[derive(Clone, Copy)]
pub struct Layer<'a> {
    pub input_norm: &'a [u16],
    pub post_norm: &'a [u16],
    pub qkv: Weight<'a>,
    pub o: Weight<'a>,
    pub gate_up: Weight<'a>,
    pub down: Weight<'a>,
    /// The biases of q/k/v, o, gate/up and down, in that order.
    pub biases: [Option<&'a [u16]>; 4],
}

/// The step's RoPE: a position per row and bfloat16 `[len, head_dim]` cos / sin tables.
#[derive(Clone, Copy)]
pub struct Rope<'a> {
    pub positions: &'a [i64],
    pub cos: &'a [u16],
    pub sin: &'a [u16],
}

/// The step's attention inputs (the attention module's layouts): each row's cache slot
/// (negative: a padding row, not written), the per-request metadata, and the requests to
/// attend for, which must own every real row: rows from `num_rows` on are padding.
#[derive(Clone, Copy)]
pub struct Attention<'a> {
    pub slot_mapping: &'a [i64],
    pub step: Step<'a>,
    pub reqs: &'a [i32],
    pub num_rows: usize,
    pub cache_shape: CacheShape,
    pub scale: f32,
}

/// Which SIMD builds run (each detected at run time by its module).
#[derive(Clone, Copy, Debug)]
pub struct Kernels {
    pub gemv: Kernel,
    pub gemm: Kernel,
    pub attention: Isa,
}

impl Kernels {
    pub fn best() -> Kernels {
        Kernels {
            gemv: quant::best_kernel(),
            gemm: gemm::gemm_kernel(),
            attention: attention::best_isa(),
        }
    }
}

/// Checks that every layer's weights and norms have the shapes `dims` implies.
pub fn validate(dims: &Dims, layers: &[Layer], final_norm: &[u16]) -> Result<(), String> {
    let (h, q, kv, i) = (
        dims.hidden,
        dims.q_size(),
        dims.kv_size(),
        dims.intermediate,
    );
    if h == 0
        || dims.head_dim == 0
        || dims.num_kv_heads == 0
        || !dims.num_heads.is_multiple_of(dims.num_kv_heads)
    {
        return Err(format!("bad dims {dims:?}"));
    }
    if final_norm.len() != h {
        return Err(format!(
            "final norm has {} elements, hidden is {h}",
            final_norm.len()
        ));
    }
    for (l, layer) in layers.iter().enumerate() {
        for (name, norm) in [
            ("input_norm", layer.input_norm),
            ("post_norm", layer.post_norm),
        ] {
            if norm.len() != h {
                return Err(format!(
                    "layer {l}: {name} has {} elements, hidden is {h}",
                    norm.len()
                ));
            }
        }
        for ((name, w, want), bias) in [
            ("qkv", &layer.qkv, (q + 2 * kv, h)),
            ("o", &layer.o, (h, q)),
            ("gate_up", &layer.gate_up, (2 * i, h)),
            ("down", &layer.down, (h, i)),
        ]
        .into_iter()
        .zip(layer.biases)
        {
            if let Some(b) = bias.filter(|b| b.len() != want.0) {
                return Err(format!(
                    "layer {l}: {name}'s bias has {} elements, expected {}",
                    b.len(),
                    want.0
                ));
            }
            w.validate()
                .map_err(|e| format!("layer {l}: {name}: {e}"))?;
            if w.shape() != want {
                return Err(format!(
                    "layer {l}: {name} is {:?}, expected {want:?}",
                    w.shape()
                ));
            }
        }
    }
    Ok(())
}

/// Runs every layer on `hidden [M, hidden]` (the residual stream after the embedding,
/// updated in place) and writes the final-normed `out [M, hidden]`; `caches[l]` is layer
/// `l`'s `[2, num_blocks, block_size, H_kv, D]` cache. [`validate`] must have passed.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    dims: &Dims,
    layers: &[Layer],
    final_norm: &[u16],
    caches: &mut [FloatsMut],
    hidden: &mut [u16],
    out: &mut [u16],
    rope: Rope,
    attn: Attention,
    pool: &Pool,
    kernels: Kernels,
) -> Result<(), String> {
    let (h, q, kv, i) = (
        dims.hidden,
        dims.q_size(),
        dims.kv_size(),
        dims.intermediate,
    );
    let m = hidden.len() / h;
    if hidden.len() != m * h || out.len() != hidden.len() {
        return Err(format!(
            "hidden has {} and out {} elements, not [M, {h}] alike",
            hidden.len(),
            out.len()
        ));
    }
    if caches.len() != layers.len() {
        return Err(format!(
            "{} caches for {} layers",
            caches.len(),
            layers.len()
        ));
    }
    if rope.positions.len() != m || attn.slot_mapping.len() != m || attn.num_rows > m {
        return Err(format!(
            "positions has {} rows, slot_mapping {}, num_rows {}; hidden has {m}",
            rope.positions.len(),
            attn.slot_mapping.len(),
            attn.num_rows
        ));
    }
    if m == 0 {
        return Ok(());
    }
    let width = q + 2 * kv;
    let mut buf = Buffers {
        normed: vec![0; m * h],
        qkv: vec![0; m * width],
        attn: vec![0; m * q],
        gate_up: vec![0; m * 2 * i],
        act: vec![0; m * i],
        delta: vec![0; m * h],
        wide: Vec::new(),
    };
    let linear =
        |w: &Weight, bias: Option<&[u16]>, x: &[u16], y: &mut [u16], wide: &mut Vec<f32>| {
            linear(w, bias, x, m, y, wide, dims.dense_min_rows, pool, kernels)
        };
    let heads = dims.num_heads + dims.num_kv_heads;
    for (l, (layer, cache)) in layers.iter().zip(caches.iter_mut()).enumerate() {
        let delta = (l > 0).then_some(&buf.delta[..]);
        elementwise::add_rms_norm_bf16(hidden, delta, layer.input_norm, dims.eps, &mut buf.normed)?;
        linear(
            &layer.qkv,
            layer.biases[0],
            &buf.normed,
            &mut buf.qkv,
            &mut buf.wide,
        )?;
        elementwise::rope(
            &mut FloatsMut::Bf16(&mut buf.qkv),
            width,
            heads,
            dims.head_dim,
            rope.positions,
            Floats::Bf16(rope.cos),
            Floats::Bf16(rope.sin),
        )?;
        let qkv = &buf.qkv[..];
        attention::write_cache(
            Floats::Bf16(&qkv[q..]),
            Floats::Bf16(&qkv[q + kv..]),
            width,
            attn.slot_mapping,
            cache,
            attn.cache_shape,
        )?;
        buf.attn[attn.num_rows * q..].fill(0);
        let cache = match cache {
            FloatsMut::F32(c) => Floats::F32(c),
            FloatsMut::Bf16(c) => Floats::Bf16(c),
        };
        attention::paged_attention(
            Floats::Bf16(qkv),
            width,
            &mut FloatsMut::Bf16(&mut buf.attn),
            dims.num_heads,
            cache,
            attn.cache_shape,
            attn.step,
            attn.reqs,
            attn.scale,
            pool,
            kernels.attention,
        )?;
        linear(
            &layer.o,
            layer.biases[1],
            &buf.attn,
            &mut buf.delta,
            &mut buf.wide,
        )?;
        elementwise::add_rms_norm_bf16(
            hidden,
            Some(&buf.delta),
            layer.post_norm,
            dims.eps,
            &mut buf.normed,
        )?;
        linear(
            &layer.gate_up,
            layer.biases[2],
            &buf.normed,
            &mut buf.gate_up,
            &mut buf.wide,
        )?;
        elementwise::silu_mul_bf16(&buf.gate_up, &mut buf.act, i)?;
        linear(
            &layer.down,
            layer.biases[3],
            &buf.act,
            &mut buf.delta,
            &mut buf.wide,
        )?;
    }
    let delta = (!layers.is_empty()).then_some(&buf.delta[..]);
    elementwise::add_rms_norm_bf16(hidden, delta, final_norm, dims.eps, out)
}

/// The step's activations, allocated once for all layers.
struct Buffers {
    normed: Vec<u16>,
    qkv: Vec<u16>,
    attn: Vec<u16>,
    gate_up: Vec<u16>,
    act: Vec<u16>,
    delta: Vec<u16>,
    /// A linear layer's float32 result before its rounding to bfloat16.
    wide: Vec<f32>,
}

/// `y [M, N] = bf16(x [M, K] · Wᵀ)`, then `bf16(y + bias)` with a bias (the Python layer's
/// bfloat16 add after the projection).
#[allow(clippy::too_many_arguments)]
fn linear(
    w: &Weight,
    bias: Option<&[u16]>,
    x: &[u16],
    m: usize,
    y: &mut [u16],
    wide: &mut Vec<f32>,
    dense_min_rows: usize,
    pool: &Pool,
    kernels: Kernels,
) -> Result<(), String> {
    wide.resize(y.len(), 0.0);
    if m >= dense_min_rows {
        gemm::gemm_bf16(w, x, m, wide, pool, kernels.gemm)?;
    } else {
        quant::matmul(w, Act::Bf16(x), m, wide, pool, kernels.gemv)?;
    }
    for (y, &v) in y.iter_mut().zip(wide.iter()) {
        *y = f32_to_bf16(v);
    }
    if let Some(bias) = bias {
        for row in y.chunks_exact_mut(bias.len()) {
            for (y, &b) in row.iter_mut().zip(bias) {
                *y = f32_to_bf16(bf16_to_f32(*y) + bf16_to_f32(b));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
