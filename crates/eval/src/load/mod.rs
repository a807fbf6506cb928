//! [`load_model`]: a GGUF file (kv-model's [`gguf`](kv_model::gguf)
//! reader), its tensors checked against the memory budget before any is
//! read, or a Hugging Face folder (kv-model's [`hf`](kv_model::hf)).

use std::path::Path;

use crate::error::Result;
use kv_model::gguf::GgufFile;
use kv_model::hf::load_hf;
use kv_model::model::{CausalLm, LlamaModel};
use kv_model::tokenizer::TextTokenizer;

/// Opens a model: a GGUF file (`llama` or `qwen2` architecture) or a Hugging
/// Face folder. A GGUF file whose tensors do not fit the memory budget
/// ([`crate::budget`]) is refused before any of them is read.
pub fn load_model(path: &Path) -> Result<(Box<dyn CausalLm>, TextTokenizer)> {
    if path.is_dir() {
        return Ok(load_hf(path)?);
    }
    let file = GgufFile::open(path)?;
    let bytes: u64 = file.tensors().iter().map(|t| t.bytes).sum();
    crate::budget::check(
        &format!(
            "the weights of {} ({} tensors)",
            path.display(),
            file.tensors().len()
        ),
        bytes,
    )?;
    let model = LlamaModel::from_gguf(&file)?;
    let tokenizer = TextTokenizer::from_gguf(&file)?;
    Ok((Box::new(model), tokenizer))
}
