//! Algorithm-based fault tolerance for GEMM: `C = A·B` in FP32, BF16, FP16
//! and FP8 storage with f32 accumulation, row and column checksums, the
//! V-ABFT threshold of `v-abft-gemm-design.md` (both variance estimators,
//! sampling with exact confirmation), the A-ABFT and fixed-threshold
//! baselines, bit-flip injection, and single-error location and correction.
//!
//! ```
//! use abft_gemm::{gemm, verify_rows, Distribution, Matrix, Precision, VAbft};
//! let p = Precision::Bf16;
//! let a = Matrix::random(64, 256, Distribution::Uniform, 1.0, p, 1);
//! let b = Matrix::random(256, 32, Distribution::Uniform, 1.0, p, 2);
//! let mut c = gemm(&a, &b, p)?.c;
//! let vabft = VAbft::design(p.e_max_ascend());
//! assert!(!verify_rows(&a, &b, &c, &vabft).fired());
//! c.data[5 * 32 + 7] *= 2f32.powi(64); // an exponent-bit upset
//! assert_eq!(verify_rows(&a, &b, &c, &vabft).flagged, [5]);
//! # Ok::<(), abft_gemm::AbftError>(())
//! ```

pub mod check;
pub mod error;
pub mod gemm;
pub mod linear_check;
pub mod matrix;
pub mod precision;
pub mod study;
pub mod threshold;

pub use check::{
    Correction, Verdict, locate_and_correct, verify_cols, verify_rows, verify_rows_sampled,
};
pub use error::{AbftError, Result};
pub use gemm::{Checksums, Product, col_checksums, gemm, linear_into, row_checksums};
pub use linear_check::{CheckedLinear, LinearRule, LinearVerdict};
pub use matrix::{Distribution, Matrix};
pub use precision::{FlipDirection, Precision, flip_bit};
pub use threshold::{AAbft, FixedThreshold, Sampling, Stats, Threshold, VAbft, VarianceEstimator};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
