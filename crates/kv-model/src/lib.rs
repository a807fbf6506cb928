//! # kv-model
//!
//! The model runner: GGUF files ([`gguf`]), their tokenizer
//! ([`tokenizer`]), the Llama, Qwen2 and GPT-2 forward passes over any KV
//! backend of the workspace ([`model`]), computing on the weights as the
//! file stores them ([`weights`]: 4-6 bits per weight multiplied by
//! activations quantised to 8 bits per block, as llama.cpp does).
//!
//! Load a model, generate on a paged `int4+secded84` cache and print what
//! the ECC decoder saw (`examples/generate.rs`):
//!
//! ```no_run
//! use kv_model::{gguf::GgufFile, tokenizer::TextTokenizer};
//! use kv_model::model::{Adapted, CausalLm, LlamaModel};
//! use paged_cache::{LayerSpec, PagedBackend};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let path = std::path::Path::new("SmolLM2-135M-Instruct.Q4_1.gguf");
//! let file = GgufFile::open(path)?;
//! let (model, tokenizer) = (LlamaModel::from_gguf(&file)?, TextTokenizer::from_gguf(&file)?);
//! let layer = LayerSpec::uniform("int4+secded84".parse()?, model.kv_channels());
//! let mut cache = Adapted(PagedBackend::new(&vec![layer; model.layers()], 16, 64)?);
//! let mut ids = tokenizer.encode("The capital of France is")?;
//! let mut logits = model.forward(&ids, &mut cache, ids.len() - 1)?;
//! for _ in 0..24 {
//!     let next = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b]));
//!     ids.push(next.unwrap_or(0) as u32);
//!     logits = model.forward(&ids[ids.len() - 1..], &mut cache, 0)?;
//! }
//! println!("{}\n{:?}", tokenizer.decode(&ids)?, cache.0.read_stats());
//! # Ok(())
//! # }
//! ```
//!
//! The products alone:
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
pub mod hf;
pub mod model;
pub mod tokenizer;
pub mod weights;

pub use error::{ModelError, Result};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
