//! [`load_model`]: a GGUF file (kv-model's [`gguf`](kv_model::gguf)
//! reader), its tensors checked against the memory budget before any is
//! read, or a Hugging Face folder (kv-model's [`hf`](kv_model::hf)).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Result;
use kv_model::gguf::GgufFile;
use kv_model::hf::load_hf;
use kv_model::model::{CausalLm, LlamaModel, LoadOptions};
use kv_model::tokenizer::TextTokenizer;

/// Whether [`load_model`] loads weights holding NaN or infinity (off:
/// such a file is refused).
static ALLOW_NON_FINITE: AtomicBool = AtomicBool::new(false);

/// Lets [`load_model`] load GGUF weights holding NaN or infinity (a fault
/// experiment's damaged file; `--allow-non-finite-weights`).
pub fn allow_non_finite_weights(allow: bool) {
    ALLOW_NON_FINITE.store(allow, Ordering::Relaxed);
}

/// Opens a model: a GGUF file (`llama` or `qwen2` architecture) or a Hugging
/// Face folder. A GGUF file whose tensors do not fit the memory budget
/// ([`crate::budget`]) is refused before any of them is read; one that
/// does not hold what its architecture says is refused as it loads
/// ([`LlamaModel::from_gguf_with`]).
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
    let options = LoadOptions {
        allow_non_finite: ALLOW_NON_FINITE.load(Ordering::Relaxed),
    };
    let model = LlamaModel::from_gguf_with(&file, &options)?;
    let tokenizer = TextTokenizer::from_gguf(&file)?;
    Ok((Box::new(model), tokenizer))
}
