//! Real-model fault-injection evaluation: kv-model's models (GGUF and
//! Hugging Face checkpoints) with their KV cache in kv-quant forms and
//! fault channels, on the paper's re-encode protocol or the paged cache,
//! and the metrics, BER sweep and experiments of the ECC KV-cache paper's
//! section 6 and beyond.

pub mod error;

pub use error::{EvalError, Result};
pub mod accumulate;
pub mod adaptive;
pub mod backend;
pub mod batch;
pub mod budget;
pub mod cache;
pub mod calibration;
pub mod frontier;
pub mod frontier_merge;
pub mod gemm_checks;
pub mod generate;
pub mod load;
pub mod lowrank_report;
pub mod metrics;
pub mod niah;
mod niah_plot;
pub mod paths;
mod report_files;
pub mod stream_drift;
pub mod sweep;
pub mod weight_faults;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
