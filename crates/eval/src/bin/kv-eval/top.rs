//! `kv-eval top`: the top-k next tokens of a prompt.

use std::path::PathBuf;

use kv_eval::cache::{CacheMode, KvCache};

use crate::Error;
use crate::source::{load_model, model_path};

/// The top-k next tokens of a prompt with their logits and probabilities.
#[derive(clap::Args)]
pub(crate) struct TopArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// The prompt.
    #[arg(long, default_value = "The capital of France is")]
    pub(crate) prompt: String,
    /// How many tokens to list.
    #[arg(short, default_value_t = 8)]
    pub(crate) k: usize,
}

/// Runs `kv-eval top`.
pub(crate) fn run(args: TopArgs) -> Result<(), Error> {
    let TopArgs { model, prompt, k } = args;
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    if k == 0 {
        return Err("-k 0 asks for no tokens".into());
    }
    let (model, tokenizer) = load_model(&model_path(&model)?)?;
    let ids = tokenizer.encode(&prompt)?;
    if ids.is_empty() {
        return Err(format!("{prompt:?} has no tokens").into());
    }
    if let Some(trained) = model.context()
        && ids.len() > trained
    {
        return Err(format!(
            "the prompt is {} tokens, past the {trained} tokens the model was trained \
             to: shorten it",
            ids.len()
        )
        .into());
    }
    if ids.len() > 64 {
        println!("{} tokens: {:?} ...", ids.len(), &ids[..64]);
    } else {
        println!("{prompt:?} -> {ids:?}");
    }
    let mut cache = KvCache::new(CacheMode::Plain, None, 0)?;
    let logits = model.forward(&ids, &mut cache, ids.len() - 1)?;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for &i in order.iter().take(k) {
        println!(
            "{i:6} {:12?} logit {:8.3} p {:.4}",
            tokenizer.decode(&[i as u32])?,
            logits[i],
            f64::from(logits[i] - max).exp() / z
        );
    }
    Ok(())
}
