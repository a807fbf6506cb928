//! Weights as GGUF stores them, and products on them.
//!
//! - [`WeightType`]: the ggml types, their block geometry and the
//!   activation form each type's product multiplies by;
//! - [`dequantize_into`]: any block type to f32, exactly as ggml;
//! - [`Activations`]: rows quantised to Q8_0, Q8_1 or Q8_K blocks as
//!   llama.cpp quantises them;
//! - [`QuantMatrix`] and [`StoredLinear`]: matrices as stored, and linear
//!   layers stacked from them, with their products over rayon;
//! - [`Isa`]: the instruction set of the row kernels (scalar, AVX2), chosen
//!   by the caller or detected, every set computing the same bits.
//!
//! Kernels exist for `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`,
//! `Q5_K`, `Q6_K`, `F32`, `F16` and `BF16`; other types are dequantised to
//! F32 ([`QuantMatrix::with_kernel`]).

mod activations;
mod dequant;
mod dot;
mod finite;
mod kquants;
mod matrix;
mod product;
mod token_lanes;
mod types;

pub use activations::{Activations, Q8Block, Q8KBlock};
pub use dequant::{dequantize_into, dequantize_parallel};
pub use dot::Isa;
pub use finite::first_non_finite;
pub use matrix::{QuantMatrix, StoredLinear};
pub use types::{ActivationKind, WeightType};
