//! CPU kernels for weight-only quantized matmuls, `out[M, N] = x[M, K] · Wᵀ`, with `W`
//! kept in its quantized form (groups of [`GROUP`] consecutive input columns):
//!
//! - int4: `w = scale · (q − 8) + zero`, `q` in 0..15 (GGUF Q4_0 / Q4_1);
//! - int8: `w = scale · q`, `q` in −127..127 (GGUF Q8_0).
//!
//! Method (the one llama.cpp uses): each activation row is quantized once per call to
//! int8 per group (`x ≈ d · qx`, `d = max|x| / 127`), then each weight group meets it as
//! an integer dot product (AVX-512 VNNI `vpdpbusd` where the CPU has it, a scalar loop
//! otherwise) scaled by `scale · d`. A decode step is a GEMV per layer, bound by the
//! bytes of `W` it reads, so reading 0.5–1 byte a weight is what makes it fast.
//! The cost is the activations' rounding to 8 bits (relative error ≤ 1/254 of a group's
//! largest value per element, averaged out over a dot product).

pub mod pool;
pub mod quant;

/// Input columns sharing one scale (and zero).
pub const GROUP: usize = 32;

// Paged attention and the elementwise ops of a decoder layer (CPU, float32 / bfloat16).
pub mod attention;
pub mod elementwise;
