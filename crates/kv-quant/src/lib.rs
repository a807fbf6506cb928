//! # kv-quant
//!
//! Turns f32 K/V matrices (`tokens × channels`) into compact stored forms and
//! back, and owns the canonical byte layout of every form that attention,
//! the paged cache and the GPU kernels read.
//!
//! - [`CacheForm`]: the one spelling of a form (`int4-g64`, `fp8-e4m3`,
//!   `int4+secded84+interp`, …), parsed and printed in one place.
//! - [`KvStore`]: quantize, inject seeded faults ([`FaultTarget`]), decode
//!   whole or tile by tile ([`KvStore::decode_rows_into`]) with erasure
//!   recovery and exact statistics ([`KvDecodeStats`]); true sizes from
//!   [`KvStore::stored_bytes`].
//! - Quantizers: integer at 2/3/4/8 bits (symmetric or asymmetric, per token,
//!   per channel, per group, per tensor; f16 or f32 scales), FP8 E4M3/E5M2
//!   ([`Fp8Format`]), NF4 ([`NF4_LEVELS`]).
//! - Protection: INT4 or NF4 codes under Hamming(7,4), SECDED(8,4) or
//!   Golay(24,12) from `gf2-codes` (plain or bit-interleaved), metadata
//!   under SECDED or Reed-Muller RM(2,5) ([`MetaCode`]).
//!
//! ```
//! use kv_quant::{CacheForm, KvStore};
//!
//! let form: CacheForm = "int4-g64".parse()?;
//! let data: Vec<f32> = (0..4 * 128).map(|i| (i as f32 * 0.37).sin()).collect();
//! let store = KvStore::quantize(form, &data, 4, 128)?;
//! assert_eq!(store.stored_bytes(), 4 * 64 + 4 * 2 * (2 + 2)); // nibbles + f16 scale and offset per group
//! let back = store.decode()?;
//! assert!(back.values.iter().zip(&data).all(|(a, b)| (a - b).abs() < 0.07));
//! # Ok::<(), kv_quant::KvQuantError>(())
//! ```

pub mod channel_vq;
mod error;
pub mod fp8;
pub mod int;
mod layout;
pub mod lloyd_max;
pub mod meta;
#[cfg(feature = "ndarray")]
mod ndarray_views;
pub mod nf4;
pub mod outliers;
pub mod qjl;
pub mod rotation;
mod simd;
pub mod spec;
mod store;
pub mod table;
pub mod vq;

pub use channel_vq::ChannelVq;
pub use error::{KvQuantError, Result};
pub use fp8::Fp8Format;
pub use layout::GroupLayout;
pub use lloyd_max::LloydMax;
pub use meta::MetaCode;
pub use nf4::NF4_LEVELS;
pub use outliers::SparseStore;
pub use qjl::QjlSketch;
pub use rotation::Hadamard;
pub use simd::f16_to_f32 as widen_f16;
pub use spec::{
    BlockPlan, CacheForm, CoeffCode, ErasurePolicy, Fp8Spec, Granularity, IntSpec, LayerForms,
    LloydMaxSpec, LowRankMethod, LowRankSpec, MAX_OUTLIER_BASIS_POINTS, MetaProtection, Nf4Spec,
    Protection, Quantizer, RankRule, Rotation, ScaleType, Segments, ShardSpec, ShardValues,
    SparseSpec, VqSpec,
};
pub use store::{
    ChannelSlices, DecodeScratch, DecodedMatrix, FaultTarget, GatheredLevels, Injection,
    KvDecodeStats, KvStore, LevelMap, LevelPacking, LevelRows, NonFinite, ParamBound,
    QuantizeOptions, RowBufferSizes, RowBuffers, RowBuffersMut, RowEncoder, RowsView, ScrubStats,
    SegmentRows, VqCodeRows,
};
pub use table::{ProtectedTable, TableBytes};
pub use vq::{FitOptions, VqCodebook};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
