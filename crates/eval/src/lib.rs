//! Real-model fault-injection evaluation: a Llama-family forward pass read
//! from GGUF whose KV cache runs through kv-quant forms and fault channels,
//! and the metrics and BER sweep of the ECC KV-cache paper's section 6.

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
pub mod gemm_checks;
pub mod generate;
pub mod load;
pub mod lowrank_report;
pub mod metrics;
pub mod niah;
mod niah_plot;
pub mod paths;
pub mod stream_drift;
pub mod sweep;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
