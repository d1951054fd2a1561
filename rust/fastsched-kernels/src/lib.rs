//! CPU kernels for weight-only quantized matmuls, `out[M, N] = x[M, K] · Wᵀ`, with `W`
//! kept in its quantized form (groups of [`GROUP`] consecutive input columns):
//!
//! - int4: `w = scale · (q − 8) + zero`, `q` in 0..15 (GGUF Q4_0 / Q4_1);
//! - int8: `w = scale · q + zero`, `q` in −128..127, one scale per 32 or per 16 columns and
//!   an optional zero per 32 (GGUF Q5_0, Q5_1, Q5_K, Q6_K and Q8_0).
//!
//! Method (the one llama.cpp uses): each activation row is quantized once per call to
//! int8 per group (`x ≈ d · qx`, `d = max|x| / 127`), then each weight group meets it as
//! an integer dot product (AVX-512 VNNI `vpdpbusd` where the CPU has it, a scalar loop
//! otherwise) scaled by `scale · d`. A decode step is a GEMV per layer, bound by the
//! bytes of `W` it reads, so reading 0.5–1 byte a weight is what makes it fast.
//! The cost is the activations' rounding to 8 bits (relative error ≤ 1/254 of a group's
//! largest value per element, averaged out over a dot product).

/// Defines `fn $name($args) -> $ret $body` whose body is compiled twice, as is and with
/// AVX-512 (F, BW, VL) enabled, the second chosen at run time where the CPU has it (same
/// arithmetic either way; the wider build lets loops vectorize and `floor`/`round` become
/// instructions, not libm calls). A body handed over as a closure would not do: a closure is
/// compiled as a function of its own, without the caller's target features.
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            if $crate::attention::best_isa() == $crate::attention::Isa::Avx512 {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                // SAFETY: the CPU has AVX-512F/BW/VL (checked at run time).
                return unsafe { wide($($arg),*) };
            }
            body($($arg),*)
        }
    };
}

pub mod pool;
pub mod quant;

/// Input columns sharing one scale (and zero).
pub const GROUP: usize = 32;

// Paged attention and the elementwise ops of a decoder layer (CPU, float32 / bfloat16).
pub mod attention;
pub mod checks;
pub mod decoder;
pub mod elementwise;
