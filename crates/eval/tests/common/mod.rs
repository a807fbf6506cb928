//! Shared helpers of the integration tests: a dependency-free seeded
//! generator and the tiny random model.

#![allow(dead_code, unreachable_pub)]

pub(crate) mod qwen2;
pub(crate) mod tiny;

/// xorshift64*: deterministic test weights without a dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// A uniform draw in [-1, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// `n` uniform draws scaled by `scale`.
    pub(crate) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}
