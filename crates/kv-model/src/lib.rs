//! # kv-model
//!
//! The model runner's foundation: products on weights as GGUF files store
//! them. A decode step multiplies every weight once; llama.cpp streams the
//! stored 4-6 bits per weight for it, where an f32 copy streams 32. This
//! crate keeps the stored blocks and multiplies them by activations
//! quantised to 8 bits per block, as llama.cpp does, with scalar and AVX2
//! kernels that give the same bits.
//!
//! ```
//! use kv_model::weights::{Isa, QuantMatrix, StoredLinear};
//! // Two rows of 32 weights in F32 (GGUF files hold Q4_K, Q6_K, ...).
//! let w: Vec<f32> = (0..64).map(|i| (i % 7) as f32 - 3.0).collect();
//! let layer = StoredLinear::new(vec![QuantMatrix::from_f32(2, 32, &w)?])?;
//! let x = vec![0.5f32; 32];
//! let mut out = vec![0.0; 2];
//! layer.product_into(&mut out, &x, false, Isa::detect())?;
//! let want: f32 = w[..32].iter().map(|w| w * 0.5).sum();
//! assert_eq!(out[0], want);
//! # Ok::<(), kv_model::ModelError>(())
//! ```

pub mod error;
pub mod gguf;
pub mod tokenizer;
pub mod weights;

pub use error::{ModelError, Result};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
