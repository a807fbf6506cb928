//! Run-time selected wide-vector paths of the decoders: f16 → f32
//! conversion with F16C/AVX-512 instructions, and a wrapper that compiles
//! the level loops for AVX2 when the CPU has it. Every path gives the same
//! values as the scalar code (no fused multiply-add is introduced: Rust
//! never contracts `a * b + c`).

/// Converts little-endian IEEE half floats (`2·out.len()` bytes, the
/// FP16 form's row bytes) to f32, exactly, with AVX-512 or F16C when the
/// CPU has them.
///
/// # Panics
/// If `src` does not hold exactly `2·out.len()` bytes.
pub fn f16_to_f32(src: &[u8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len(), "f16_to_f32: byte count");
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { x86::f16_to_f32_avx512(src, out) };
        }
        if is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has F16C and AVX.
            return unsafe { x86::f16_to_f32_f16c(src, out) };
        }
    }
    f16_to_f32_scalar(src, out);
}

fn f16_to_f32_scalar(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Runs `f` compiled for AVX2 when the CPU has it (the closure and what it
/// inlines are compiled inside a function with those features enabled).
#[inline(always)]
pub(crate) fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { x86::run_avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// # Safety
    /// The CPU must have AVX-512F; `src` holds `2·out.len()` bytes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_to_f32_avx512(src: &[u8], out: &mut [f32]) {
        let (chunks, tail) = out.as_chunks_mut::<16>();
        for (i, o) in chunks.iter_mut().enumerate() {
            let s = &src[32 * i..][..32];
            // SAFETY: `s` holds 32 bytes and `o` 16 floats; unaligned access.
            unsafe {
                let h = _mm256_loadu_si256(s.as_ptr().cast());
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        }
        let done = 16 * chunks.len();
        super::f16_to_f32_scalar(&src[2 * done..], tail);
    }

    /// # Safety
    /// The CPU must have F16C and AVX; `src` holds `2·out.len()` bytes.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_to_f32_f16c(src: &[u8], out: &mut [f32]) {
        let (chunks, tail) = out.as_chunks_mut::<8>();
        for (i, o) in chunks.iter_mut().enumerate() {
            let s = &src[16 * i..][..16];
            // SAFETY: `s` holds 16 bytes and `o` 8 floats; unaligned access.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().cast());
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }
        let done = 8 * chunks.len();
        super::f16_to_f32_scalar(&src[2 * done..], tail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_f16_converts_like_the_scalar_path() {
        // All 65536 bit patterns, NaN payloads compared by bits.
        let src: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let (mut fast, mut slow) = (vec![0f32; 65536], vec![0f32; 65536]);
        f16_to_f32(&src, &mut fast);
        f16_to_f32_scalar(&src, &mut slow);
        assert!(
            fast.iter()
                .zip(&slow)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        // Odd lengths exercise the tails.
        for n in [0, 1, 7, 9, 15, 17, 33] {
            let mut out = vec![0f32; n];
            f16_to_f32(&src[2 * 1000..2 * (1000 + n)], &mut out);
            assert_eq!(out, slow[1000..1000 + n]);
        }
    }
}
