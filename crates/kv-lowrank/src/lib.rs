//! # kv-lowrank
//!
//! Per-head low-rank subspaces of the KV cache (the low-rank subspace
//! paper's SubSpace-G and SubSpace-A):
//!
//! - [`Basis`]: orthonormal `r × d` bases and their means, fitted by PCA in
//!   f64 with a fixed rank or by retained energy ([`Spectrum`]), stored in
//!   f16 or int8 with true bytes.
//! - [`FrequentDirections`]: the deterministic streaming sketch with
//!   `0 ≤ ‖Ax‖² − ‖Âx‖² ≤ ‖A − A_r‖²_F/(m − r)`.
//! - [`LowRankStore`]: one K or V matrix as per-head coefficients in token
//!   chunks (one calibrated chunk for `pca-*` forms, online chunks with
//!   rollover for `fd-*` forms), the coefficients in a kv-quant store (f16,
//!   int8, int4, protectable and fault-injectable like every other form),
//!   and per-token residual norms.
//! - [`ShardKeys`]: Shard's key path: one PCA basis per layer over all KV
//!   heads' de-RoPEd keys, bits per group of components from a dynamic
//!   program under a budget, symmetric integer coefficients, an int8 basis.
//! - [`Certificate`]: runtime bounds on logit, softmax and output errors
//!   from those residual norms.
//!
//! The spellings (`pca-r32`, `pca-e0.99-c8`, `fd-r16-l128`) belong to
//! kv-quant's one grammar; attention computes in coefficient space over
//! these stores (the `attention` crate's `LowRankAttention`).
//!
//! ```
//! use kv_lowrank::{Basis, BasisStorage, HeadBases, LowRankStore};
//! use kv_quant::{CacheForm, RankRule};
//! use std::sync::Arc;
//!
//! let (tokens, head_dim) = (200, 16);
//! // Keys of one head near a 4-dimensional subspace.
//! let keys: Vec<f32> = (0..tokens * head_dim)
//!     .map(|i| { let (t, c) = (i / head_dim, i % head_dim); ((t * (c % 4 + 1)) as f32 * 0.1).sin() })
//!     .collect();
//! let (basis, spectrum) = Basis::fit(&keys, tokens, head_dim, RankRule::Fixed(4), BasisStorage::F16)?;
//! assert!(spectrum.energy_at(4) > 0.99);
//! let bases = HeadBases { heads: vec![Arc::new(basis)] };
//! let form: CacheForm = "pca-r4".parse()?;
//! let store = LowRankStore::build(form, &keys, tokens, head_dim, head_dim, Some(&bases))?;
//! assert!(store.max_residual(0, 0..tokens) < 0.1);
//! assert!(store.stored_bytes() < tokens * head_dim * 2 / 3); // a third of f16
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod basis;
pub mod certificate;
mod error;
pub mod fd;
#[cfg(feature = "ndarray")]
mod ndarray_views;
mod projector;
pub mod shard_keys;
mod store;

pub use basis::{Basis, BasisStorage, Spectrum};
pub use certificate::Certificate;
pub use error::{LowRankError, Result};
pub use fd::FrequentDirections;
pub use projector::Projector;
pub use shard_keys::ShardKeys;
pub use store::{Chunk, HeadBases, LowRankStore, StoreScratch, coefficient_form, low_rank_spec};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
