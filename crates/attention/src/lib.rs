//! # attention
//!
//! Attention for KV-cache research, on the CPU:
//!
//! - [`Rope`]: rotary embedding in both pair layouts ([`RopeLayout`]), apply
//!   and undo.
//! - [`reference_attention`]: the f64 oracle (causal mask, `1/√d` scale,
//!   GQA/MQA).
//! - [`Attention`]: blockwise online-softmax attention in f32 for decode
//!   (split-K across threads with an exact log-sum-exp merge) and prefill,
//!   never materialising the score matrix.
//! - [`KvSource`]: the one trait attention reads caches through, tile by
//!   tile: plain f32 rows ([`DenseKv`]), every kv-quant form ([`kv_quant::KvStore`]:
//!   FP16, FP8, INT8, INT4 at any granularity, ECC-protected INT4 with its
//!   erasure policy). Decode statistics come back with the output, miscorrected
//!   and silent words included (from each store's fault ledger).
//! - [`Numerics`]: exact f32 scores, or int8-quantized queries scored with
//!   integer dot products against integer keys (llama.cpp's way), with a
//!   stated and tested error bound.
//! - [`Attention::decode_into`] / [`Attention::prefill_into`]: the same
//!   calls into caller-owned buffers with a reusable [`Workspace`], so a
//!   decode step allocates nothing.
//! - [`stored::StoredPart`]: the stored-layer interface, one part of one
//!   layer of a paged cache in any form, made from a parsed form by
//!   [`stored::open_part`] (and "how to add a cache form").
//! - [`KvBackend`]: the one interface between a model's forward pass and its
//!   cache (append, attend, commit or roll back a step); [`DenseBackend`]
//!   keeps f32 rows, the oracle.
//! - [`Evicting`]: any backend with SnapKV's token eviction at the end of
//!   the prefill ([`SnapKv`]), the kept rows written compactly.
//!
//! ```
//! use attention::{Attention, DenseKv, HeadShape, Mask};
//! use kv_quant::{CacheForm, KvStore};
//!
//! let shape = HeadShape::new(4, 2, 64)?; // 4 query heads share 2 KV heads
//! let tokens = 300;
//! let k: Vec<f32> = (0..tokens * 128).map(|i| (i as f32 * 0.01).sin()).collect();
//! let v: Vec<f32> = (0..tokens * 128).map(|i| (i as f32 * 0.02).cos()).collect();
//! let q: Vec<f32> = (0..4 * 64).map(|i| (i as f32 * 0.05).sin()).collect();
//!
//! let attn = Attention::new(shape);
//! let exact = attn.decode(&q, tokens - 1, &DenseKv::new(&k, tokens, 128)?, &DenseKv::new(&v, tokens, 128)?, &Mask::Causal)?;
//!
//! let form: CacheForm = "int4+secded84+interp".parse()?;
//! let (ks, vs) = (KvStore::quantize(form, &k, tokens, 128)?, KvStore::quantize(form, &v, tokens, 128)?);
//! let quantized = attn.decode(&q, tokens - 1, &ks, &vs, &Mask::Causal)?;
//! assert_eq!(quantized.stats.keys.values.words, (tokens * 128) as u64); // one SECDED word per value
//! let err = exact.out.iter().zip(&quantized.out).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
//! assert!(err < 0.05, "{err}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod attend;
mod backend;
mod draft_overlay;
mod error;
mod evict;
mod evicting;
mod isa;
mod kernel;
mod low_rank;
#[cfg(feature = "ndarray")]
mod ndarray_views;
mod numerics;
mod pair_codes;
mod reference;
mod rope;
mod shape;
mod shard;
mod source;
pub mod stored;
mod tile_grid;
mod workspace;

pub use attend::{
    Attention, AttentionConfig, AttentionInfo, AttentionOutput, AttentionStats, OnNonFinite,
};
pub use backend::{
    DenseBackend, KvBackend, ModelKvShape, ReadView, StepRows, check_fit, commit_then_truncate,
    keep_past_step, no_draft_view, run_step,
};
pub use draft_overlay::DraftOverlay;
pub use error::{AttentionError, Result};
pub use evict::SnapKv;
pub use evicting::{Evicting, Eviction};
pub use isa::Isa;
pub use low_rank::{LowRankScratch, PreRopeKeys, certificates};
pub use numerics::Numerics;
pub use pair_codes::PairCodeRows;
pub use reference::{ReferenceOutput, reference_attention};
pub use rope::{Rope, RopeLayout};
pub use shape::{HeadShape, Mask};
pub use shard::{SHARD_VALUE_FIT, ShardBytes, ShardFaults, ShardLayer};
pub use source::{BlockedScratch, DenseKv, KvSource, StoreScratch, Tile, TileRows};
pub use workspace::Workspace;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
