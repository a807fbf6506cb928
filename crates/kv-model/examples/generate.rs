//! The front-page program: loads a GGUF model, greedily generates on a
//! paged `int4+secded84` KV cache and prints the text and the codec
//! statistics of every tile attention read:
//! `cargo run --release -p kv-model --example generate -- MODEL.gguf ["PROMPT"]`
//! (`cargo xtask fetch-model` puts SmolLM2-135M in `~/.cache/reliable-kv`).

use kv_model::gguf::GgufFile;
use kv_model::model::{Adapted, CausalLm, LlamaModel};
use kv_model::tokenizer::TextTokenizer;
use paged_cache::{LayerSpec, PagedBackend};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(path), prompt) = (args.next(), args.next()) else {
        return Err("usage: generate MODEL.gguf [PROMPT]".into());
    };
    let prompt = prompt.unwrap_or_else(|| "The capital of France is".into());

    let file = GgufFile::open(path.as_ref())?;
    let (model, tokenizer) = (
        LlamaModel::from_gguf(&file)?,
        TextTokenizer::from_gguf(&file)?,
    );
    let layer = LayerSpec::uniform("int4+secded84".parse()?, model.kv_channels());
    let mut cache = Adapted(PagedBackend::new(&vec![layer; model.layers()], 16, 64)?);
    let mut ids = tokenizer.encode(&prompt)?;
    let mut logits = model.forward(&ids, &mut cache, ids.len() - 1)?;
    for _ in 0..24 {
        let next = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b]));
        ids.push(next.unwrap_or(0) as u32);
        logits = model.forward(&ids[ids.len() - 1..], &mut cache, 0)?;
    }
    let stats = cache.0.read_stats();
    println!(
        "{}\nkeys:   {:?}\nvalues: {:?}",
        tokenizer.decode(&ids)?,
        stats.keys.values,
        stats.values.values
    );
    Ok(())
}
