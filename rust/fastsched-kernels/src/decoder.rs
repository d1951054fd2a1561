//! A Llama-family decoder stack in one call: every layer of a step, bfloat16 activations,
//! weight-only int4 / int8 linears, the paged KV cache, and the final norm; with the per-layer
//! options of Qwen3 (q/k norms) and Gemma 2 / 3 (norms after attention and MLP, GeGLU,
//! sliding-window layers with their own RoPE table, logit soft-capping, `1 + w` norms).
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
//!     qkv = bf16(x · Wqkvᵀ);  [q_norm, k_norm on each head];  rope on q's and k's heads
//!     cache[slots] = k, v;   a = attention(q, cache)   (padding rows: 0)
//!     δ   = bf16(a · Woᵀ);   [δ = attn_out_norm(δ)]
//!     x   = add_rms_norm(h += δ, post_norm)
//!     δ   = bf16(act_mul(bf16(x · Wgate_upᵀ)) · Wdownᵀ);   [δ = mlp_out_norm(δ)]
//! out = add_rms_norm(h += δ, final_norm)
//! ```
//!
//! (bracketed: where the layer has it; `act_mul` SiLU or GELU-tanh times up; the attention
//! with the layer's [`Scores`] and RoPE table). Gemma's embedding scale and final logit
//! soft-capping sit outside the stack, on the caller's side.
//!
//! A linear layer takes the integer GEMV ([`quant::matmul`]) below `dense_min_rows` rows and
//! the many-row bf16 GEMM ([`quant::gemm::gemm_bf16`]) from there on, as the Python path does.

use crate::attention::{
    self, bf16_to_f32, f32_to_bf16, CacheShape, Floats, FloatsMut, Isa, Scores, Step,
};
use crate::elementwise::{self, NormWeight};
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

/// The MLP's activation of the gate, times up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (Gemma's GeGLU).
    GeluTanh,
}

/// One decoder layer: its RMSNorm weights (`[hidden]`; q/k norms `[head_dim]`), the fused
/// projections, q/k/v `[q + 2·kv, hidden]`, o `[hidden, q]`, gate/up `[2·I, hidden]` (gate
/// first), down `[hidden, I]`, each with an optional bfloat16 bias `[N]` (Qwen2's q/k/v), and
/// its options (module docs).
#[derive(Clone, Copy)]
pub struct Layer<'a> {
    pub input_norm: NormWeight<'a>,
    /// The norm before the MLP (Llama's post_attention_layernorm, Gemma's
    /// pre_feedforward_layernorm).
    pub post_norm: NormWeight<'a>,
    /// Per-head norms of q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norms: Option<[NormWeight<'a>; 2]>,
    /// Norms of the attention's and the MLP's outputs before their residual adds (Gemma's
    /// post_attention_layernorm and post_feedforward_layernorm).
    pub out_norms: [Option<NormWeight<'a>>; 2],
    pub qkv: Weight<'a>,
    pub o: Weight<'a>,
    pub gate_up: Weight<'a>,
    pub down: Weight<'a>,
    /// The biases of q/k/v, o, gate/up and down, in that order.
    pub biases: [Option<&'a [u16]>; 4],
    pub activation: Activation,
    /// The attention's scale, window and soft-cap.
    pub scores: Scores,
    /// Which of the step's RoPE tables rotates q and k (Gemma 3's local layers have their own).
    pub rope_table: usize,
}

/// The step's RoPE: a position per row and bfloat16 `[len, head_dim]` cos / sin tables, one
/// pair per distinct RoPE of the model (each layer names its own).
#[derive(Clone, Copy)]
pub struct Rope<'a> {
    pub positions: &'a [i64],
    pub tables: &'a [RopeTable<'a>],
}

/// One RoPE's bfloat16 cos and sin tables, `[len, head_dim]` each.
#[derive(Clone, Copy)]
pub struct RopeTable<'a> {
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

/// The largest of [`Dims`]' sizes [`validate`] takes.
pub const MAX_DIM: usize = 1 << 20;

/// Checks that every layer's weights and norms have the shapes `dims` implies, and its
/// attention options make sense.
pub fn validate(dims: &Dims, layers: &[Layer], final_norm: NormWeight) -> Result<(), String> {
    let (h, i) = (dims.hidden, dims.intermediate);
    // Products of the dims index the buffers: bounded so that none of them wraps.
    let sizes = [h, dims.num_heads, dims.num_kv_heads, dims.head_dim, i];
    if h == 0
        || sizes.iter().any(|&d| d > MAX_DIM)
        || dims.head_dim == 0
        || dims.num_kv_heads == 0
        || !dims.num_heads.is_multiple_of(dims.num_kv_heads)
    {
        return Err(format!("bad dims {dims:?}"));
    }
    let (q, kv) = (dims.q_size(), dims.kv_size());
    if final_norm.len() != h {
        return Err(format!(
            "final norm has {} elements, hidden is {h}",
            final_norm.len()
        ));
    }
    for (l, layer) in layers.iter().enumerate() {
        let [q_norm, k_norm] = layer.qk_norms.map_or([None; 2], |n| n.map(Some));
        for (name, norm, want) in [
            ("input_norm", Some(layer.input_norm), h),
            ("post_norm", Some(layer.post_norm), h),
            ("attn_out_norm", layer.out_norms[0], h),
            ("mlp_out_norm", layer.out_norms[1], h),
            ("q_norm", q_norm, dims.head_dim),
            ("k_norm", k_norm, dims.head_dim),
        ] {
            if let Some(norm) = norm.filter(|n| n.len() != want) {
                return Err(format!(
                    "layer {l}: {name} has {} elements, expected {want}",
                    norm.len()
                ));
            }
        }
        layer
            .scores
            .validate()
            .map_err(|e| format!("layer {l}: {e}"))?;
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
    final_norm: NormWeight,
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
    if let Some((l, layer)) = layers
        .iter()
        .enumerate()
        .find(|(_, layer)| layer.rope_table >= rope.tables.len())
    {
        return Err(format!(
            "layer {l} takes RoPE table {}, the step has {}",
            layer.rope_table,
            rope.tables.len()
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
        if let Some([q_norm, k_norm]) = layer.qk_norms {
            let (nh, nkv) = (dims.num_heads, dims.num_kv_heads);
            elementwise::rms_norm_heads_bf16(&mut buf.qkv, width, m, nh, q_norm, dims.eps)?;
            elementwise::rms_norm_heads_bf16(&mut buf.qkv[q..], width, m, nkv, k_norm, dims.eps)?;
        }
        let table = rope.tables[layer.rope_table];
        elementwise::rope(
            &mut FloatsMut::Bf16(&mut buf.qkv),
            width,
            heads,
            dims.head_dim,
            rope.positions,
            Floats::Bf16(table.cos),
            Floats::Bf16(table.sin),
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
            layer.scores,
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
        if let Some(norm) = layer.out_norms[0] {
            elementwise::rms_norm_heads_bf16(&mut buf.delta, h, m, 1, norm, dims.eps)?;
        }
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
        match layer.activation {
            Activation::Silu => elementwise::silu_mul_bf16(&buf.gate_up, &mut buf.act, i)?,
            Activation::GeluTanh => elementwise::gelu_tanh_mul_bf16(&buf.gate_up, &mut buf.act, i)?,
        }
        linear(
            &layer.down,
            layer.biases[3],
            &buf.act,
            &mut buf.delta,
            &mut buf.wide,
        )?;
        if let Some(norm) = layer.out_norms[1] {
            elementwise::rms_norm_heads_bf16(&mut buf.delta, h, m, 1, norm, dims.eps)?;
        }
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
