//! Loading models: GGUF files ([`gguf`]: reader, dequantisation, writer)
//! and Hugging Face safetensors folders ([`safetensors`]), and
//! [`load_model`], which opens either.

pub mod gguf;
pub mod safetensors;

use std::path::Path;

pub use self::safetensors::load_hf;
use crate::error::Result;
use crate::models::{CausalLm, LlamaModel};
use crate::tokenizer::TextTokenizer;
use gguf::GgufFile;

/// Opens a model: a GGUF file (`llama` or `qwen2` architecture) or a Hugging
/// Face folder.
pub fn load_model(path: &Path) -> Result<(Box<dyn CausalLm>, TextTokenizer)> {
    if path.is_dir() {
        return load_hf(path);
    }
    let file = GgufFile::open(path)?;
    let model = LlamaModel::from_gguf(&file)?;
    let tokenizer = TextTokenizer::from_gguf(&file)?;
    Ok((Box::new(model), tokenizer))
}
